"""Geometry of a dense GGUF model: one frozen dataclass, read from the metadata and checked
against the tensors once, at load (spec §1, §2). Pure Python.

Architectures: one row each in `dense_archs.ARCHITECTURES` (its `supported_markdown` lists
them); what differs between them is read from the row (`rules`), never from
the name. Widths come from the keys (with llama.cpp's defaults) and every tensor the graph uses
must have exactly the shape they imply, so a file whose tensor shapes disagree with its metadata
is refused here, naming the tensor; a tensor the graph would not use (``rope_freqs.weight``,
shared experts, ...) means a feature this engine does not implement and is refused by name too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..rope import rope_magnitude, scaled_frequencies
from .dense_archs import ARCHITECTURES, ArchRules
from .dense_keys import (MAX_CONTEXT, MAX_EXPERTS, MAX_LAYERS, MAX_VOCAB, bad, count, factors, kv_heads,
                         multipliers, real, rope_freq_scale)
from .gguf import STRING, GgufFile
from .gguf_types import require_supported


@dataclass(frozen=True)
class DenseGeometry:
    arch: str
    num_layers: int
    d_model: int
    ff_dim: int  # width of the dense FFN; for MoE archs the width of one expert
    num_heads: int
    num_kv_heads: int
    key_dim: int  # head_dim of q and k (attention.key_length)
    value_dim: int  # head_dim of v (attention.value_length)
    rope_dims: int  # rotated dims per head (partial rotary when < key_dim)
    rope_base: float  # gemma3: the base of the global layers
    rope_freq_scale: float  # 1 / rope.scaling.factor (linear scaling; gemma3: global layers only)
    rms_eps: float
    vocab: int
    context_length: int
    tied_head: bool  # no output.weight: token_embd.weight is the head
    qkv_bias: bool  # blk.N.attn_{q,k,v}.bias (qwen2; optional on llama)
    output_bias: bool  # output.bias (qwen2, optional)
    num_experts: int = 0
    num_experts_used: int = 0
    sliding_window: int = 0  # gemma3 sliding layers; 0 = every layer sees the whole past
    rope_scaling: str = "linear"  # rope.scaling.type: none, linear, yarn, longrope
    rope_orig_context: int = 0  # rope.scaling.original_context_length (0: context_length)
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor
    yarn_log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier
    rope_factors: tuple = ()  # ((tensor stem, f32 values), ...) of the row's frequency-factor tensors
    embedding_multiplier: float = 0.0  # granite's embedding_scale: x = row · it (0: none)
    residual_multiplier: float = 0.0  # granite's residual_scale: x += it · sublayer output (0: none)
    attention_multiplier: float = 0.0  # granite's attention.scale: the score scale (0: 1/sqrt(key_length))
    logit_scale: float = 0.0  # granite's logit_scale: logits · f32(1 / it) (0: none)
    declared_window: int = 0  # attention.sliding_window of a row without sliding layers (not applied)
    conv_layers: tuple = ()  # lfm2: the layers that are short-convolution blocks (head_count_kv 0)
    conv_taps: int = 0  # lfm2: shortconv.l_cache, the convolution's taps
    attn_softcap: float = 0.0  # gemma2's attn_logit_softcapping (0: none)
    final_softcap: float = 0.0  # gemma2's final_logit_softcapping (0: none)

    # ------------------------------------------------------------------ derived (§1, §3)
    @property
    def rules(self) -> ArchRules:
        """The architecture's row of `dense_archs.ARCHITECTURES`."""
        return ARCHITECTURES[self.arch]

    @property
    def head_rows(self) -> int:
        """Rows of the head (logits per position): the vocabulary."""
        return self.vocab

    @property
    def max_seq_len(self) -> int:
        """The longest context a session may ask for (the file's context_length)."""
        return self.context_length

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.key_dim

    @property
    def k_dim(self) -> int:
        return self.num_kv_heads * self.key_dim

    @property
    def v_dim(self) -> int:
        return self.num_kv_heads * self.value_dim

    @property
    def attn_out(self) -> int:
        return self.num_heads * self.value_dim

    @property
    def kv_repeat(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.rules.moe

    @property
    def qk_norm(self) -> str:
        """'head' (one [key_dim] weight shared by every head), 'full' (olmoe) or '' (none)."""
        return self.rules.qk_norm or ""

    @property
    def rope_neox(self) -> bool:
        """NeoX pairing (x_j, x_{j+n/2}); llama GGUFs use adjacent pairs (§3)."""
        return self.rules.rope_style == "neox"

    @property
    def head_tensor(self) -> str:
        return "token_embd.weight" if self.tied_head else "output.weight"

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier:
            return self.attention_multiplier
        if self.rules.d_query_scale_layers and self.num_layers == self.rules.d_query_scale_layers:
            return 1.0 / math.sqrt(max(self.d_model // self.num_heads, 1))
        return 1.0 / math.sqrt(self.key_dim)

    def is_global(self, layer: int) -> bool:
        """Whether a layer attends to the whole causal past (all but gemma3's sliding layers)."""
        every = self.rules.sliding_every
        return every == 0 or layer % every == every - 1

    def is_conv(self, layer: int) -> bool:
        """Whether a layer is a gated short-convolution block (lfm2) rather than attention."""
        return layer in self.conv_layers

    def has_rope(self, layer: int) -> bool:
        """Whether a layer rotates q and k (smollm3's NoPE layers do not)."""
        every = self.rules.nope_every
        return every == 0 or (layer + 1) % every != 0

    def local_rope(self, layer: int) -> bool:
        """Whether a layer takes the sliding layers' own RoPE (gemma3's; gemma2's is the global one)."""
        return not self.is_global(layer) and self.rules.local_rope_base > 0

    def rope(self, layer: int) -> tuple:
        """(freq_base, freq_scale) of one layer's RoPE."""
        if not self.local_rope(layer):
            return self.rope_base, self.rope_freq_scale
        return self.rules.local_rope_base, 1.0

    @property
    def yarn_orig_context(self) -> int:
        """llama.cpp's n_ctx_orig_yarn: rope.scaling.original_context_length, else context_length."""
        return self.rope_orig_context or self.context_length

    def frequency_factors(self, context: int):
        """The divisors of the RoPE frequencies for a session of ``context`` positions, or None:
        rope_freqs (Llama 3), else LongRoPE's long factors when the context exceeds the original
        one and its short ones otherwise (llama.cpp's get_rope_factors; it compares its context
        rounded up to 256, which is the same for original contexts that are multiples of 256)."""
        values = dict(self.rope_factors)
        if "rope_freqs" in values:
            return values["rope_freqs"]
        if not values:
            return None
        return values["rope_factors_long" if context > self.yarn_orig_context else "rope_factors_short"]

    def rope_variant(self, layer: int, context: int) -> tuple:
        """(f32 frequency table, or None for the plain base/scale one; cos/sin magnitude) of one
        layer in a session of ``context`` positions: llama.cpp's ggml_rope_ext arguments folded
        into one frequency per pair (``rope.scaled_frequencies``, ``rope.rope_magnitude``)."""
        if self.local_rope(layer):
            return None, 1.0  # gemma3's sliding layers: the local base, unscaled
        factors = self.frequency_factors(context)
        ext_factor = 1.0 if self.rope_scaling == "yarn" else 0.0
        magnitude = rope_magnitude(self.rope_freq_scale, ext_factor, self.rope_attn_factor, self.yarn_log_mul)
        if factors is None and not ext_factor:
            return None, magnitude
        table = scaled_frequencies(self.rope_dims, self.rope_base, freq_scale=self.rope_freq_scale, factors=factors,
                                   ext_factor=ext_factor, orig_context=self.yarn_orig_context)
        return table, magnitude

    # ------------------------------------------------------------------ tensors (§2)
    def layer_tensors(self, layer: int) -> list:
        """(name, ne) of every tensor of one layer, ne in ggml order (ne[0] = input width)."""
        d = self.d_model
        if self.rules.fused_qkv:
            projections = [("attn_qkv", (d, self.q_dim + self.k_dim + self.v_dim))]
        else:
            projections = [("attn_q", (d, self.q_dim)), ("attn_k", (d, self.k_dim)), ("attn_v", (d, self.v_dim))]
        if self.is_conv(layer):  # lfm2: the block's three tensors instead of attention's
            out = [("attn_norm", (d,)), ("shortconv.conv", (self.conv_taps, d)), ("shortconv.in_proj", (d, 3 * d)),
                   ("shortconv.out_proj", (d, d)), ("ffn_norm", (d,))]
            return [(f"blk.{layer}.{name}.weight", ne) for name, ne in out + self._ffn_tensors()]
        out = [("attn_norm", (d,)), *projections, ("attn_output", (self.attn_out, d)), ("ffn_norm", (d,))]
        if not self.rules.pre_norms:  # olmo2
            out = [entry for entry in out if entry[0] not in ("attn_norm", "ffn_norm")]
        if self.qkv_bias:
            out += [("attn_q.bias", (self.q_dim,)), ("attn_k.bias", (self.k_dim,)),
                    ("attn_v.bias", (self.v_dim,))]
        if self.qk_norm == "head":
            out += [("attn_q_norm", (self.key_dim,)), ("attn_k_norm", (self.key_dim,))]
        elif self.qk_norm == "full":
            out += [("attn_q_norm", (self.q_dim,)), ("attn_k_norm", (self.k_dim,))]
        if self.rules.post_norms:
            out += [("post_attention_norm", (d,)), ("post_ffw_norm", (d,))]
        out += self._ffn_tensors()
        return [(f"blk.{layer}.{name}" + ("" if name.endswith(".bias") else ".weight"), ne)
                for name, ne in out]

    def _ffn_tensors(self) -> list:
        d, ff, n_exp = self.d_model, self.ff_dim, self.num_experts
        if self.is_moe:
            return [("ffn_gate_inp", (d, n_exp)), ("ffn_gate_exps", (d, ff, n_exp)),
                    ("ffn_up_exps", (d, ff, n_exp)), ("ffn_down_exps", (ff, d, n_exp))]
        if self.rules.fused_gate_up:
            return [("ffn_up", (d, 2 * ff)), ("ffn_down", (ff, d))]
        return [("ffn_gate", (d, ff)), ("ffn_up", (d, ff)), ("ffn_down", (ff, d))]

    def vector_tensors(self) -> list:
        """The F32 tensors the graph reads from one buffer: norms, biases, frequency factors and
        lfm2's [d][taps] convolution weights."""
        return [name for name, ne in self.tensors() if _is_vector(name, ne)]

    def tensors(self) -> list:
        """(name, ne) of every tensor the graph reads, in a fixed order."""
        return [spec for group in self._tensor_groups() for spec in group]

    def _tensor_groups(self):
        """The model-wide tensors, then one list per layer (checked a layer at a time, so a file
        claiming 1024 layers fails at its first missing tensor without listing them all)."""
        out = [("token_embd.weight", (self.d_model, self.vocab)), (f"{self.rules.output_norm}.weight", (self.d_model,))]
        if not self.tied_head:
            out.append(("output.weight", (self.d_model, self.vocab)))
        if self.output_bias:
            out.append(("output.bias", (self.vocab,)))
        out += [(f"{stem}.weight", (self.rope_dims // 2,)) for stem, _ in self.rope_factors]
        yield out
        for layer in range(self.num_layers):
            yield self.layer_tensors(layer)

    # ------------------------------------------------------------------ reading (§1)
    @classmethod
    def from_gguf(cls, f: GgufFile) -> "DenseGeometry":
        arch = f.get_str("general.architecture")
        rules = ARCHITECTURES.get(arch)
        if rules is None:
            raise UnsupportedModelError(
                f"metadata key 'general.architecture': architecture {arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})")

        def key(suffix):
            return f"{arch}.{suffix}"

        d = count(f, key("embedding_length"))
        num_heads = count(f, key("attention.head_count"))
        if d % num_heads and key("attention.key_length") not in f.fields:
            bad(f"metadata key {key('attention.key_length')!r}",
                 f"missing, and embedding_length {d} is not a multiple of head_count {num_heads}")
        key_dim = count(f, key("attention.key_length"), default=d // num_heads)
        ff_dim = count(f, key("feed_forward_length"))
        rope_dims = count(f, key("rope.dimension_count"), default=key_dim)
        experts = used = 0
        if rules.moe:
            experts = count(f, key("expert_count"), hi=MAX_EXPERTS)
            used = count(f, key("expert_used_count"), hi=MAX_EXPERTS)
            if rules.expert_width_key:
                ff_dim = count(f, key(rules.expert_width_key), default=max(ff_dim // used, 1))
            if f.get_int(key("expert_gating_func"), 1) != 1:
                raise UnsupportedModelError(f"metadata key {key('expert_gating_func')!r}: only softmax "
                                            "routing (1) is supported")
        if "token_embd.weight" not in f:
            bad("tensor 'token_embd.weight'", "missing")
        embd = f["token_embd.weight"]
        if len(embd.ne) != 2 or embd.ne[0] != d:
            bad("tensor 'token_embd.weight'", f"ne {list(embd.ne)} disagrees with embedding_length {d}")
        vocab = count(f, key("vocab_size"), hi=MAX_VOCAB) if key("vocab_size") in f.fields else embd.ne[1]
        if not 1 <= vocab <= MAX_VOCAB:
            bad("tensor 'token_embd.weight'", f"{vocab} rows (the vocabulary) is out of range (1..{MAX_VOCAB})")
        tokens = f.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:  # llama.cpp sizes the embedding by it
            if tokens.item_type != STRING:
                bad("metadata key 'tokenizer.ggml.tokens'", "is not an array of strings")
            if len(tokens.value) != vocab:
                bad("metadata key 'tokenizer.ggml.tokens'", f"{len(tokens.value)} tokens for a vocabulary of {vocab}")
        num_layers = count(f, key("block_count"), hi=MAX_LAYERS)
        num_kv_heads, conv_layers, conv_taps = kv_heads(f, key, num_heads, num_layers, rules.short_conv)
        if rules.output_required and "output.weight" not in f:
            bad("tensor 'output.weight'", f"missing ({arch} has no tied head)")
        geometry = cls(
            arch=arch, num_layers=num_layers, d_model=d,
            ff_dim=ff_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
            conv_layers=conv_layers, conv_taps=conv_taps,
            key_dim=key_dim, value_dim=count(f, key("attention.value_length"), default=key_dim),
            rope_dims=rope_dims,
            rope_base=real(f, key("rope.freq_base"), 10000.0, 1.0, 1e12),
            rope_freq_scale=rope_freq_scale(f, arch, rules.rope_scalings),
            rms_eps=real(f, key("attention.layer_norm_rms_epsilon"), 1e-6, 1e-12, 1.0),
            vocab=vocab, context_length=count(f, key("context_length"), hi=MAX_CONTEXT),
            tied_head="output.weight" not in f,
            # required: always read (missing ones are then named); optional: when blk.0 has them.
            qkv_bias=rules.qkv_bias == "required" or rules.qkv_bias == "optional" and "blk.0.attn_q.bias" in f,
            output_bias=rules.output_bias and "output.bias" in f,
            num_experts=experts, num_experts_used=used,
            sliding_window=count(f, key("attention.sliding_window"), hi=MAX_CONTEXT)
            if rules.sliding_every else 0,
            declared_window=0 if rules.sliding_every else count(f, key("attention.sliding_window"), lo=0,
                                                                   hi=MAX_CONTEXT, default=0),
            rope_scaling=f.get_str(key("rope.scaling.type"), "linear"),
            rope_orig_context=count(f, key("rope.scaling.original_context_length"), hi=MAX_CONTEXT, default=0)
            if key("rope.scaling.original_context_length") in f.fields else 0,
            rope_attn_factor=real(f, key("rope.scaling.attn_factor"), 1.0, 1e-3, 1e3),
            yarn_log_mul=real(f, key("rope.scaling.yarn_log_multiplier"), 0.0, 0.0, 1e3),
            rope_factors=tuple((stem, factors(f, f"{stem}.weight", rope_dims)) for stem in rules.rope_factor_tensors
                               if f"{stem}.weight" in f),
            **(multipliers(f, key) if rules.multipliers else {}),
            **({"attn_softcap": real(f, key("attn_logit_softcapping"), rules.softcaps[0], 1e-3, 1e6),
                "final_softcap": real(f, key("final_logit_softcapping"), rules.softcaps[1], 1e-3, 1e6)}
               if rules.softcaps else {}),
        )
        geometry._validate(key)
        geometry._check_tensors(f)
        return geometry

    def _validate(self, key) -> None:
        if self.num_heads % self.num_kv_heads:
            bad(f"metadata key {key('attention.head_count_kv')!r}",
                 f"{self.num_kv_heads} does not divide head_count {self.num_heads}")
        if self.rope_dims % 2 or self.rope_dims > self.key_dim:
            bad(f"metadata key {key('rope.dimension_count')!r}",
                 f"{self.rope_dims} is odd or wider than the head ({self.key_dim})")
        if self.rules.fused_qkv and self.q_dim != self.d_model:
            bad(f"metadata key {key('attention.head_count')!r}",
                 f"a fused attn_qkv needs head_count · key_length = embedding_length ({self.q_dim} != {self.d_model})")
        stems = {stem for stem, _ in self.rope_factors}
        if self.rope_scaling == "longrope" and not stems >= {"rope_factors_long", "rope_factors_short"}:
            raise UnsupportedModelError(f"metadata key {key('rope.scaling.type')!r}: 'longrope' without the "
                                        "rope_factors_long / rope_factors_short tensors")
        if stems and {"rope_factors_long", "rope_factors_short"} & stems and \
                stems != {"rope_factors_long", "rope_factors_short"}:
            bad("tensor 'rope_factors_long.weight'", "LongRoPE needs both the long and the short factors")
        window = key("attention.sliding_window")
        if self.rules.declared_window == "refused" and self.declared_window:
            raise UnsupportedModelError(f"metadata key {window!r}: {self.arch} files with sliding-window layers "
                                        f"({self.declared_window}) are not supported")
        if self.num_experts_used > self.num_experts:
            bad(f"metadata key {key('expert_used_count')!r}",
                 f"{self.num_experts_used} > expert_count {self.num_experts}")

    def _check_tensors(self, f: GgufFile) -> None:
        for group in self._tensor_groups():
            for name, ne in group:
                if name not in f:
                    bad(f"tensor {name!r}", "missing")
                tensor = f[name]
                if tensor.ne != ne:
                    bad(f"tensor {name!r}", f"ne {list(tensor.ne)} disagrees with the metadata (expected {list(ne)})")
                require_supported(tensor.type, f"tensor {name!r}")
                if _is_vector(name, ne) and tensor.type.name != "F32":
                    raise UnsupportedModelError(f"tensor {name!r}: a {tensor.type.name} vector (norms, biases and "
                                                "convolution weights must be F32)")
        used = {name for name, _ in self.tensors()}  # each one is in the file now: bounded by it
        for name in f.tensors:
            if name not in used:
                raise UnsupportedModelError(f"tensor {name!r}: not part of the {self.arch} graph this engine "
                                            "implements")


def _is_vector(name: str, ne: tuple) -> bool:
    """A tensor read as F32 values (``DenseGeometry.vector_tensors``)."""
    return len(ne) == 1 or name.endswith(".shortconv.conv.weight")
