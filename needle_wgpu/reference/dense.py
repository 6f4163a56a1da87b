"""NumPy reference of the dense GGUF family: llama, qwen2, qwen3, gemma3, the MoE pair qwen3moe,
olmoe, and gemma2, phi3, smollm3, granite, olmo2 and lfm2 (spec dense-gguf.md §1-§3; each row of
`ARCHITECTURES` cites the llama.cpp graph it follows).

The oracle the GPU engine's dense kernels are tested against, itself checked against llama.cpp
(tests/test_dense_reference.py). Float32 by default; `dtype=np.float64` runs the same graph on
the same dequantised weights in double precision, which is "exact" to ~1e-12 and settles who is
right when llama.cpp and the f32 reference disagree (llama.cpp's CPU backend quantises
activations to 8 bits; the f32 reference rounds each op once).

Every position's result depends only on its own inputs and the keys before it, never on how
many positions were computed together: products go through `matmul` (einsum, no BLAS, whose
blocking depends on the batch) and attention runs per query over exactly its visible keys. So a
prefill followed by decode steps equals one all-positions forward bit for bit.

Per-architecture differences live in one table, `ARCHITECTURES`, and a few small functions
(`DenseConfig.attention_scale`, `is_sliding`, `layer_rope`): Gemma 3's embedding scale,
post-norms, GELU FFN and sliding layers are rules there, not a second graph, and the MoE
variants (qwen3moe, olmoe) are the "moe" kind of `FFNS`.

That table is the reference's own. The engine keeps its rules in `formats/dense_archs.py`
(`ArchRules`, `ARCHITECTURES`), and this module does not import them on purpose: an oracle that
read the engine's rows would agree with a wrong one. The two tables are written apart and
tests/test_dense_archs.py checks that they agree on every fact both hold; the llama.cpp tests
(tests/test_dense_reference.py) check the reference's against llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import constants, rope
from ..errors import ContainerError, InputError, UnsupportedModelError
from .gguf_weights import GgufWeights
from .ops import gelu_gated, short_conv
from .boundary import raises_container_errors


@dataclass(frozen=True)
class ArchRules:
    """What one architecture changes in the §3 graph."""

    rope_style: str                  # rope.ADJACENT (llama) or rope.NEOX (§3 RoPE)
    qk_norm: str | None = None       # "head": per-head RMSNorm over head_dim (qwen3, qwen3moe);
                                     # "full": over the whole q / k row before the head split (olmoe)
    qkv_bias: bool = False           # attn_{q,k,v}.bias required (qwen2); elsewhere used if present
    ffn: str = "dense"               # a key of FFNS ("dense", "gelu" or "moe")
    renormalise: bool = False        # MoE: top-k weights divided by their sum (qwen3moe, not olmoe)
    embedding_scale: bool = False    # x = embedding row · sqrt(d) (gemma3)
    post_norms: bool = False         # RMSNorm of the attention and FFN outputs before each residual add
    pre_norms: bool = True           # False: no attn_norm / ffn_norm, the sublayers read x itself (olmo2)
    expert_width_key: str | None = None  # MoE: one expert's width key when not feed_forward_length
    sliding_every: int = 0           # n > 0: layer il is global when il % n == n − 1, else sliding
    local_rope_base: float = 0.0     # the sliding layers' RoPE base (not in the file; §1); 0: the global
                                     # RoPE on the sliding layers too (gemma2)
    d_query_scale_layers: int = 0    # n > 0: a model of n layers scales queries by 1/sqrt(d / n_head)
    rope_factor_tensors: tuple = ()  # frequency-factor tensors read when present: rope_freqs (Llama 3,
                                     # llama.cpp's llama.cpp graph) or LongRoPE's long / short pair (phi3)
    fused: bool = False              # phi3: attn_qkv rows [q | k | v], ffn_up rows [gate | up]
    nope_every: int = 0              # n > 0: layers with (il + 1) % n == 0 take no RoPE (smollm3: 4,
                                     # hard-coded in llama.cpp's loader, not a key of the file)
    softcaps: tuple = ()             # gemma2: (attention, final) logit soft-capping defaults, read from
                                     # attn_logit_softcapping / final_logit_softcapping
    short_conv: bool = False         # lfm2: layers with head_count_kv 0 are gated short convolutions
    output_norm: str = "output_norm" # the final norm's tensor stem (lfm2: token_embd_norm)
    multipliers: bool = False        # granite: embedding_scale, residual_scale, attention.scale and
                                     # logit_scale from the file (llama.cpp's granite.cpp)


ARCHITECTURES = {
    "llama": ArchRules(rope.ADJACENT, rope_factor_tensors=("rope_freqs",)),
    "qwen2": ArchRules(rope.NEOX, qkv_bias=True),
    "qwen3": ArchRules(rope.NEOX, qk_norm="head"),
    "qwen3moe": ArchRules(rope.NEOX, qk_norm="head", ffn="moe", renormalise=True,
                          expert_width_key="expert_feed_forward_length"),
    "olmoe": ArchRules(rope.NEOX, qk_norm="full", ffn="moe"),
    # §3 "Gemma 3": llama.cpp's src/models/gemma3.cpp; the local base is hard-coded there, and
    # its 27B (62 layers) is the one Gemma 3 whose query scale is 1/sqrt(d / n_head).
    "gemma3": ArchRules(rope.NEOX, qk_norm="head", ffn="gelu", embedding_scale=True, post_norms=True,
                        sliding_every=6, local_rope_base=10000.0, d_query_scale_layers=62),
    # llama.cpp's src/models/gemma2-iswa.cpp: embedding · sqrt(d), post-norms, GELU, layers 0, 2, 4
    # ... sliding with the global RoPE, scores and logits capped by tanh(x / cap) · cap.
    "gemma2": ArchRules(rope.NEOX, ffn="gelu", embedding_scale=True, post_norms=True, sliding_every=2,
                        d_query_scale_layers=46, softcaps=(50.0, 30.0)),
    # llama.cpp's src/models/phi3.cpp: q | k | v in attn_qkv, gate | up in ffn_up; LongRoPE's long
    # factors when the session's context exceeds the original one, else the short ones.
    "phi3": ArchRules(rope.NEOX, rope_factor_tensors=("rope_factors_long", "rope_factors_short"), fused=True),
    # llama.cpp's src/models/smollm3.cpp: llama's graph; q and k of every 4th layer are not rotated.
    "smollm3": ArchRules(rope.ADJACENT, nope_every=4),
    # llama.cpp's src/models/granite.cpp: x = row · embedding_scale; each sublayer's output times
    # residual_scale before its add; scores scaled by attention.scale; logits · 1/logit_scale.
    "granite": ArchRules(rope.ADJACENT, rope_factor_tensors=("rope_freqs",), multipliers=True),
    # llama.cpp's src/models/olmo2.cpp: attention and FFN read the stream un-normed, their outputs
    # are RMS-normed before each add; q and k normed over their whole rows, as olmoe's.
    "olmo2": ArchRules(rope.NEOX, qk_norm="full", post_norms=True, pre_norms=False),
    # llama.cpp's src/models/lfm2.cpp: where head_count_kv[il] is 0 the layer is
    # out_proj(c ⊙ conv(b ⊙ x)) over in_proj's [b | c | x], the conv causal with shortconv.l_cache
    # taps; elsewhere attention with per-head q/k norms. Final norm: token_embd_norm.
    "lfm2": ArchRules(rope.NEOX, qk_norm="head", short_conv=True, output_norm="token_embd_norm"),
}


# ---------------------------------------------------------------------------------- §1 config


@dataclass(frozen=True)
class DenseConfig:
    """Geometry of one file (§1). Projection widths come from the tensor shapes, checked
    against the metadata keys where the file has them."""

    arch: str
    n_layers: int
    d: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int      # attention.key_length: q/k width per head
    value_dim: int     # attention.value_length: v width per head
    eps: float
    rope_base: float
    rope_dims: int     # rope.dimension_count; dims >= rope_dims are not rotated
    vocab: int
    context: int
    tied: bool         # no output.weight: the embedding is the head (§2)
    n_expert: int = 0       # MoE (§1): expert_count; n_ff is then one expert's width
    n_expert_used: int = 0  # expert_used_count (top-k)
    rope_scale: float = 1.0     # linear RoPE scaling, 1 / rope.scaling.factor (gemma3: global layers only)
    sliding_window: int = 0     # attention.sliding_window of the sliding layers (gemma3)
    rope_kind: str = "linear"   # rope.scaling.type
    rope_orig_context: int = 0  # rope.scaling.original_context_length, else the context length
    rope_attn_factor: float = 1.0
    yarn_log_mul: float = 0.0
    embedding_multiplier: float = 0.0  # granite (0: none; the four are absent elsewhere)
    residual_multiplier: float = 0.0
    attention_multiplier: float = 0.0
    logit_scale: float = 0.0
    conv_layers: tuple = ()     # lfm2: the short-convolution layers
    conv_taps: int = 0
    attn_softcap: float = 0.0   # gemma2 (0: none)
    final_softcap: float = 0.0

    @property
    def rules(self) -> ArchRules:
        return ARCHITECTURES[self.arch]

    @property
    def attention_scale(self) -> float:
        """The query scale: 1/sqrt(key_length); the Gemma 3 27B uses 1/sqrt(d / n_head) (§3);
        granite's attention.scale when the file sets it."""
        if self.attention_multiplier:
            return self.attention_multiplier
        if self.rules.d_query_scale_layers and self.n_layers == self.rules.d_query_scale_layers:
            return 1.0 / np.sqrt(self.d // self.n_head)
        return 1.0 / np.sqrt(self.head_dim)

    def is_sliding(self, layer: int) -> bool:
        """Whether a layer sees only the last `sliding_window` positions (§3 Gemma 3)."""
        every = self.rules.sliding_every
        return every > 0 and layer % every != every - 1

    def has_rope(self, layer: int) -> bool:
        """Whether a layer rotates q and k: not smollm3's NoPE layers, (il + 1) % 4 == 0."""
        every = self.rules.nope_every
        return not every or (layer + 1) % every != 0

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(freq_base, linear scale) of one layer: gemma3's sliding layers use the local base,
        unscaled (gemma2's the global RoPE)."""
        if self.is_sliding(layer) and self.rules.local_rope_base:
            return self.rules.local_rope_base, 1.0
        return self.rope_base, self.rope_scale

    @classmethod
    def from_weights(cls, w: GgufWeights) -> "DenseConfig":
        arch = w.value("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

        def key(suffix, default=None):
            return w.value(f"{arch}.{suffix}", default)

        def bad(message):
            raise ContainerError(f"{w.path.name}: {message}")

        rules = ARCHITECTURES[arch]
        fused = rules.fused
        n_layers = int(key("block_count"))
        n_head = int(key("attention.head_count"))
        kv_entry = key("attention.head_count_kv", n_head)
        per_layer = list(kv_entry) if isinstance(kv_entry, (list, tuple)) else [kv_entry] * n_layers
        conv_layers = tuple(i for i, n in enumerate(per_layer) if int(n) == 0) if rules.short_conv else ()
        if len(per_layer) != n_layers or len({int(n) for n in per_layer if int(n)}) > 1 \
                or (conv_layers and key("shortconv.l_cache") is None) or (not rules.short_conv and 0 in per_layer):
            bad(f"head_count_kv {kv_entry} does not fit {n_layers} layers of {arch}")
        n_head_kv = next((int(n) for n in per_layer if int(n)), n_head)
        first = next(i for i in range(n_layers) if i not in conv_layers)  # the first attention layer
        for name in ("token_embd.weight", f"{rules.output_norm}.weight",
                     f"blk.{first}.attn_qkv.weight" if fused else f"blk.{first}.attn_q.weight"):
            if not w.has(name):
                bad(f"tensor {name} is missing")
        vocab_rows, d = w.shape("token_embd.weight")
        if int(key("embedding_length", d)) != d:
            bad(f"embedding_length {key('embedding_length')} != embedding width {d}")
        if fused:  # phi3: q is d wide, k and v share the rest
            q_rows = d
            k_rows = v_rows = (w.shape("blk.0.attn_qkv.weight")[0] - d) // 2
        else:
            q_rows = w.shape(f"blk.{first}.attn_q.weight")[0]
            k_rows = w.shape(f"blk.{first}.attn_k.weight")[0]
            v_rows = w.shape(f"blk.{first}.attn_v.weight")[0]
        head_dim = int(key("attention.key_length", q_rows // n_head))
        value_dim = int(key("attention.value_length", v_rows // n_head_kv))
        if n_head % n_head_kv or q_rows != n_head * head_dim or k_rows != n_head_kv * head_dim \
                or v_rows != n_head_kv * value_dim:
            bad(f"q/k/v widths {q_rows}/{k_rows}/{v_rows} do not fit {n_head}/{n_head_kv} heads of "
                f"{head_dim}/{value_dim}")
        experts = _moe_experts(w, arch, key, bad) if ARCHITECTURES[arch].ffn == "moe" else (0, 0, 0)
        n_ff = experts[2] if experts[0] else w.shape("blk.0.ffn_up.weight")[0] // 2 if fused \
            else w.shape("blk.0.ffn_gate.weight")[0]
        if not experts[0] and int(key("feed_forward_length", n_ff)) != n_ff:
            bad(f"feed_forward_length {key('feed_forward_length')} != ffn_gate rows {n_ff}")
        rope_dims = int(key("rope.dimension_count", head_dim))
        if rope_dims % 2 or not 0 < rope_dims <= head_dim:
            bad(f"rope.dimension_count {rope_dims} does not fit head_dim {head_dim}")
        vocab = int(key("vocab_size", vocab_rows))
        if vocab > vocab_rows:
            bad(f"vocab_size {vocab} exceeds the embedding's {vocab_rows} rows")
        return cls(arch=arch, n_layers=n_layers, d=d, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                   head_dim=head_dim, value_dim=value_dim,
                   eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
                   rope_base=float(key("rope.freq_base", 10000.0)), rope_dims=rope_dims,
                   vocab=vocab, context=int(key("context_length", 2048)),
                   tied=not w.has("output.weight"), n_expert=experts[0], n_expert_used=experts[1],
                   rope_scale=_rope_scale(w, arch),
                   sliding_window=int(key("attention.sliding_window", 0)) if ARCHITECTURES[arch].sliding_every
                   else 0,
                   rope_kind=str(key("rope.scaling.type", "linear")),
                   rope_orig_context=int(key("rope.scaling.original_context_length", 0)),
                   rope_attn_factor=float(key("rope.scaling.attn_factor", 1.0)),
                   yarn_log_mul=float(key("rope.scaling.yarn_log_multiplier", 0.0)),
                   **(_multipliers(key, bad) if ARCHITECTURES[arch].multipliers else {}),
                   conv_layers=conv_layers, conv_taps=int(key("shortconv.l_cache", 0)) if conv_layers else 0,
                   **_softcaps(key, ARCHITECTURES[arch].softcaps))


def _softcaps(key, defaults: tuple) -> dict:
    """gemma2's attention and final logit caps, llama.cpp's defaults (50, 30) where absent."""
    if not defaults:
        return {}
    return {"attn_softcap": float(key("attn_logit_softcapping", defaults[0])),
            "final_softcap": float(key("final_logit_softcapping", defaults[1]))}


def _multipliers(key, bad) -> dict:
    """Granite's four multipliers (llama.cpp requires logit_scale; 0 or absent: none)."""
    if key("logit_scale") is None:
        bad("granite needs logit_scale")
    return {"embedding_multiplier": float(key("embedding_scale", 0.0)),
            "residual_multiplier": float(key("residual_scale", 0.0)),
            "attention_multiplier": float(key("attention.scale", 0.0)), "logit_scale": float(key("logit_scale"))}


def _moe_experts(w: GgufWeights, arch: str, key, bad) -> tuple[int, int, int]:
    """(expert_count, expert_used_count, expert width) of a MoE file (§1, §2), the width taken
    from ffn_gate_exps [n_expert, n_ff, d] and checked against the keys."""
    if not w.has("blk.0.ffn_gate_exps.weight"):
        bad("tensor blk.0.ffn_gate_exps.weight is missing")
    n_expert, n_ff = w.shape("blk.0.ffn_gate_exps.weight")[:2]
    used = int(key("expert_used_count", 0))
    if int(key("expert_count", n_expert)) != n_expert or not 0 < used <= n_expert:
        bad(f"expert_count {key('expert_count')} / expert_used_count {used} do not fit {n_expert} experts")
    width_key = ARCHITECTURES[arch].expert_width_key or "feed_forward_length"
    if key(width_key) is not None and int(key(width_key)) != n_ff:
        bad(f"{width_key} {key(width_key)} != expert width {n_ff}")
    return n_expert, used, n_ff


def _rope_scale(w: GgufWeights, arch: str) -> float:
    """1 / factor of linear RoPE scaling, as llama.cpp reads it: rope.scale_linear, else
    rope.scaling.factor (absent or 0: none). Other scaling types are not part of this graph."""
    kind = w.value(f"{arch}.rope.scaling.type", "linear")
    if kind not in ("none", "linear", "yarn", "longrope"):
        raise UnsupportedModelError(f"{w.path.name}: {kind!r} RoPE scaling is not supported")
    factor = w.value(f"{arch}.rope.scale_linear", w.value(f"{arch}.rope.scaling.factor", 0.0))
    return 1.0 if not factor else 1.0 / float(factor)


# ---------------------------------------------------------------------------------- primitives


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y[t, o] = Σ_i w[o, i] x[t, i] for x [T, in], w [out, in] (§2: row-major [out][in]).

    einsum without `optimize` runs NumPy's own loops, never BLAS, so each output element is
    summed in the same order whatever T is (prefill and decode agree bit for bit)."""
    return np.einsum("ti,oi->to", x, w)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """out_i = x_i · w_i / sqrt(mean(x²) + eps) over the last axis (§3.2)."""
    one = x.dtype.type
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (one(1) / np.sqrt(mean_square + one(eps))) * weight


def silu(g: np.ndarray) -> np.ndarray:
    """silu(g) = g / (1 + e^(−g)) (§3.2); e^(−g) may overflow to inf, giving −0 as it should."""
    with np.errstate(over="ignore"):
        return g / (g.dtype.type(1) + np.exp(-g))


def softmax(x: np.ndarray) -> np.ndarray:
    """Max-subtracted softmax over the last axis (§3.2)."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate the pairs of x [T, heads, head_dim] by angles with cos/sin [T, n_dims/2] (§3.2):
    (a, b) -> (a cos − b sin, a sin + b cos). ADJACENT pairs (x_2j, x_2j+1), NEOX pairs
    (x_j, x_{j+n_dims/2}); dims >= n_dims are untouched."""
    n_dims = 2 * cos.shape[-1]
    if style == rope.ADJACENT:
        first, second = slice(0, n_dims, 2), slice(1, n_dims, 2)
    else:
        first, second = slice(0, n_dims // 2), slice(n_dims // 2, n_dims)
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    a, b = x[..., first], x[..., second]
    out = x.copy()
    out[..., first] = a * c - b * s
    out[..., second] = a * s + b * c
    return out


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """tanh(x · (1/cap)) · cap with llama.cpp's f32 constants (gemma2's score and logit caps)."""
    one = x.dtype.type
    cap32 = np.float32(cap)
    return np.tanh(x * one(np.float32(1) / cap32)) * one(cap32)


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray,
                     scale: float, window: int = 0, cap: float = 0.0) -> np.ndarray:
    """Causal GQA attention (§3.2). q [T, H, hd] at absolute `positions`; keys [S, KV, hd] and
    values [S, KV, vd] hold positions 0..S−1. Query head h reads kv head h // (H / KV); the
    query at pos sees keys s <= pos (with a `window` > 0 only pos − window < s <= pos, §3
    Gemma 3): softmax(scale · <q, k_s>) weights the v_s."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    group = heads // kv_heads
    out = np.empty((q.shape[0], heads, values.shape[2]), dtype=q.dtype)
    for t, pos in enumerate(positions):
        for g in range(kv_heads):
            hs = slice(g * group, (g + 1) * group)
            first = max(0, pos - window + 1) if window > 0 else 0
            k = np.ascontiguousarray(keys[first: pos + 1, g])
            v = np.ascontiguousarray(values[first: pos + 1, g])
            scores = np.einsum("hd,sd->hs", q[t, hs], k) * q.dtype.type(scale)
            if cap:                                                                   # gemma2
                scores = softcap(scores, cap)
            out[t, hs] = np.einsum("hs,sd->hd", softmax(scores), v)
    return out


# ---------------------------------------------------------------------------------- weights (§2)


@dataclass
class LayerWeights:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    wo: np.ndarray
    bo: np.ndarray | None
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    ffn_norm: np.ndarray
    gate: np.ndarray | None    # the dense FFN (None in MoE layers)
    up: np.ndarray | None
    down: np.ndarray | None
    moe: "MoeWeights | None" = None
    post_attention_norm: np.ndarray | None = None  # gemma3
    post_ffw_norm: np.ndarray | None = None
    conv_in: np.ndarray | None = None  # lfm2's short-convolution blocks: in_proj [3d, d]
    conv: np.ndarray | None = None     # and the conv weights [d, taps]


@dataclass
class MoeWeights:
    """A MoE layer's router and experts (§2): gate_inp [n_expert, d]; gate/up [n_expert, n_ff, d]
    and down [n_expert, d, n_ff], the expert axis slowest."""

    gate_inp: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    used: int              # top-k
    renormalise: bool      # qwen3moe: w_j = p_j / max(sum, RENORM_FLOOR); olmoe: w_j = p_j


def dense_ffn(z: np.ndarray, p: LayerWeights) -> np.ndarray:
    """Wdown (silu(Wgate z) ⊙ Wup z) (§3.2)."""
    return matmul(silu(matmul(z, p.gate)) * matmul(z, p.up), p.down)


RENORM_FLOOR = 6.103515625e-5  # 2^-14: llama.cpp clamps the top-k sum from below by it (§3.2 MoE)


def moe_route(z: np.ndarray, m: MoeWeights) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [T, k], weights [T, k]) of each position (§3.2 MoE): router logits
    gate_inp z, softmax over all experts, the k most probable (ties to the lower index), in
    order of probability; qwen3moe renormalises the k weights, olmoe keeps the probabilities."""
    probs = softmax(matmul(z, m.gate_inp))
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, : m.used]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if m.renormalise:
        total = np.sum(weights, axis=-1, keepdims=True)
        weights = weights / np.maximum(total, weights.dtype.type(RENORM_FLOOR))
    return ids, weights


def moe_ffn(z: np.ndarray, p: LayerWeights) -> np.ndarray:
    """Σ_j w_j Wdown_e(silu(Wgate_e z) ⊙ Wup_e z) over each position's selected experts e_j,
    summed in order of selection (§3.2 MoE)."""
    m = p.moe
    ids, weights = moe_route(z, m)
    out = np.zeros_like(z)
    for t in range(z.shape[0]):
        zt = z[t: t + 1]
        for e, w in zip(ids[t], weights[t]):
            act = silu(matmul(zt, m.gate[e])) * matmul(zt, m.up[e])
            out[t] += w * matmul(act, m.down[e])[0]
    return out


def gelu_ffn(z: np.ndarray, p: LayerWeights) -> np.ndarray:
    """Wdown (gelu_tanh(Wgate z) ⊙ Wup z) (§3 Gemma 3). The tanh-GELU constants are the f32
    ones the shader uses (`ops.gelu_tanh`); in a float64 run that is a ~1e-8 relative change of
    the function, far below what the float64 run is there to settle."""
    return matmul(gelu_gated(matmul(z, p.gate), matmul(z, p.up)), p.down)


FFNS = {"dense": dense_ffn, "gelu": gelu_ffn, "moe": moe_ffn}


class DenseKvCache:
    """Roped keys [n, KV, hd] and values [n, KV, vd] of positions 0..length−1, per layer."""

    def __init__(self, n_layers: int):
        self.keys: list[np.ndarray | None] = [None] * n_layers
        self.values: list[np.ndarray | None] = [None] * n_layers
        self.conv_tails: dict[int, np.ndarray] = {}  # lfm2: each convolution block's last taps − 1 b·x rows
        self.length = 0

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = np.concatenate((self.keys[layer], k))
            self.values[layer] = np.concatenate((self.values[layer], v))
        return self.keys[layer], self.values[layer]


# ---------------------------------------------------------------------------------- §3 forward


@raises_container_errors
class DenseReference:
    """The §3 forward of one GGUF file, batch 1, with a KV cache.

    `forward(ids, cache)` runs ids at positions cache.length.. (a prefill, or one decode step
    with one id) and returns the logits of the last position, of every position, or none.
    """

    def __init__(self, source: str | Path | GgufWeights, dtype=np.float32, context: int | None = None):
        self.weights = source if isinstance(source, GgufWeights) else GgufWeights(source)
        self.config = DenseConfig.from_weights(self.weights)
        # the session length LongRoPE's long/short choice compares (None: the file's context_length)
        self.context = self.config.context if context is None else int(context)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        exact = self.dtype == np.float64
        self._round = not exact  # f32: RoPE tables rounded once to f32, as the GPU uses them
        self._rope: dict[tuple, tuple[list, list]] = {}  # (rope key, pos)
        self._layers: dict[int, LayerWeights] = {}
        if self.config.rules.qkv_bias and not self.weights.has("blk.0.attn_q.bias"):
            raise ContainerError(f"{self.weights.path.name}: {self.config.arch} needs attn_q/k/v biases")

    # ------------------------------------------------------------------ weights
    def _cast(self, a: np.ndarray | None) -> np.ndarray | None:
        # f32 keeps the cached arrays; f64 casts on use (a second cached copy would double memory).
        return None if a is None else a.astype(self.dtype, copy=False)

    def layer(self, i: int) -> LayerWeights:
        if self.dtype == np.float32 and i in self._layers:
            return self._layers[i]
        w = self.weights

        def t(name):
            return self._cast(w.tensor(f"blk.{i}.{name}"))

        def opt(name):
            return self._cast(w.optional(f"blk.{i}.{name}"))

        cfg = self.config
        if i in cfg.conv_layers:  # lfm2: a short-convolution block, then the usual FFN
            p = LayerWeights(attn_norm=t("attn_norm.weight"), wq=None, wk=None, wv=None, bq=None, bk=None, bv=None,
                             wo=t("shortconv.out_proj.weight"), bo=None, q_norm=None, k_norm=None,
                             ffn_norm=t("ffn_norm.weight"), gate=t("ffn_gate.weight"), up=t("ffn_up.weight"),
                             down=t("ffn_down.weight"), conv_in=t("shortconv.in_proj.weight"),
                             conv=t("shortconv.conv.weight"))
            if self.dtype == np.float32:
                self._layers[i] = p
            return p
        if cfg.rules.fused:  # phi3: one q | k | v matrix, one gate | up matrix
            qkv, kv = t("attn_qkv.weight"), cfg.n_head_kv * cfg.head_dim
            wq, wk, wv = qkv[:cfg.d], qkv[cfg.d:cfg.d + kv], qkv[cfg.d + kv:]
            gate_up = t("ffn_up.weight")
            gate, up = gate_up[:cfg.n_ff], gate_up[cfg.n_ff:]
        else:
            wq, wk, wv = t("attn_q.weight"), t("attn_k.weight"), t("attn_v.weight")
            gate, up = opt("ffn_gate.weight"), opt("ffn_up.weight")
        p = LayerWeights(attn_norm=t("attn_norm.weight") if cfg.rules.pre_norms else None, wq=wq, wk=wk,
                         wv=wv, bq=opt("attn_q.bias"), bk=opt("attn_k.bias"),
                         bv=opt("attn_v.bias"), wo=t("attn_output.weight"), bo=opt("attn_output.bias"),
                         q_norm=opt("attn_q_norm.weight"), k_norm=opt("attn_k_norm.weight"),
                         ffn_norm=t("ffn_norm.weight") if cfg.rules.pre_norms else None, gate=gate, up=up,
                         down=opt("ffn_down.weight"), post_attention_norm=opt("post_attention_norm.weight"),
                         post_ffw_norm=opt("post_ffw_norm.weight"))
        if self.config.rules.ffn == "moe":
            p.moe = MoeWeights(gate_inp=t("ffn_gate_inp.weight"), gate=t("ffn_gate_exps.weight"),
                               up=t("ffn_up_exps.weight"), down=t("ffn_down_exps.weight"),
                               used=self.config.n_expert_used, renormalise=self.config.rules.renormalise)
        elif p.gate is None or p.up is None or p.down is None:
            raise ContainerError(f"{w.path.name}: layer {i} lacks ffn_gate/ffn_up/ffn_down")
        if self.config.rules.qk_norm and (p.q_norm is None or p.k_norm is None):
            raise ContainerError(f"{w.path.name}: layer {i} lacks attn_q_norm/attn_k_norm")
        if self.config.rules.post_norms and (p.post_attention_norm is None or p.post_ffw_norm is None):
            raise ContainerError(f"{w.path.name}: layer {i} lacks post_attention_norm/post_ffw_norm")
        if self.dtype == np.float32:
            self._layers[i] = p
        return p

    def head(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The head matrix [vocab, d] (tied: the embedding, §2) and the optional output.bias."""
        name = "token_embd.weight" if self.config.tied else "output.weight"
        return self._cast(self.weights.tensor(name)), self._cast(self.weights.optional("output.bias"))

    def _frequencies(self, base: float, scale: float) -> list[float]:
        """The RoPE table of one (base, linear scale): in f32 the GPU's own table
        (`constants.rope_frequencies` folds the scale in as f32(f_j · scale))."""
        if self._round:
            return list(constants.rope_frequencies(self.config.rope_dims, float(base), scale))
        return [f * scale for f in rope.rope_frequencies(self.config.rope_dims, base, round_to_f32=False)]

    def rope_key(self, layer: int) -> tuple:
        """(base, linear scale, frequency-factor tensor or None, YaRN, magnitude) of one layer.

        As llama.cpp's rope_yarn: theta_j = p · f_j / ff_j, interpolated to s · theta (s = the
        linear scale), YaRN mixing the extrapolated theta back in along its ramp; cos and sin
        times the magnitude: rope.scaling.attn_factor, with YaRN times its mscale
        0.1·ln(1/s) + 1 (or mscale(1) / mscale(yarn_log_multiplier))."""
        cfg = self.config
        base, scale = cfg.layer_rope(layer)
        if cfg.is_sliding(layer) and cfg.rules.local_rope_base:
            return base, scale, None, False, 1.0
        present = [n for n in cfg.rules.rope_factor_tensors if self.weights.has(f"{n}.weight")]
        factors = None
        if "rope_freqs" in present:
            factors = "rope_freqs"
        elif present:
            orig = cfg.rope_orig_context or cfg.context
            factors = "rope_factors_long" if self.context > orig else "rope_factors_short"
        yarn = cfg.rope_kind == "yarn"
        magnitude = cfg.rope_attn_factor
        if yarn:
            def mscale(mul):
                return 1.0 if scale >= 1.0 else 0.1 * mul * np.log(1.0 / scale) + 1.0
            magnitude *= mscale(1.0) / mscale(cfg.yarn_log_mul) if cfg.yarn_log_mul else mscale(1.0)
        return base, scale, factors, yarn, float(magnitude)

    def _scaled_frequencies(self, base, scale, factors, yarn) -> np.ndarray:
        """The frequencies of a Llama 3 / YaRN / LongRoPE layer in float64 (rounded to f32 once
        in an f32 run): f_j / ff_j · (s·(1 − r_j) + r_j), r_j YaRN's ramp over the pairs
        between its beta_fast (32) and beta_slow (1) correction dims (llama.cpp's defaults)."""
        n = self.config.rope_dims
        j = np.arange(n // 2, dtype=np.float64)
        f = np.power(float(base), -2.0 * j / n)
        if factors is not None:
            f = f / self.weights.tensor(f"{factors}.weight").astype(np.float64)
        mix = 0.0
        if yarn:
            orig = self.config.rope_orig_context or self.config.context

            def corr_dim(rotations):
                return n * np.log(orig / (rotations * 2 * np.pi)) / (2 * np.log(float(base)))
            low, high = max(0.0, np.floor(corr_dim(32.0))), min(n - 1.0, np.ceil(corr_dim(1.0)))
            mix = 1.0 - np.clip((j - low) / max(0.001, high - low), 0.0, 1.0)
        f = f * (scale * (1.0 - mix) + mix)
        return f.astype(np.float32).astype(np.float64) if self._round else f

    def _cos_sin(self, positions, base: float, scale: float, factors=None, yarn=False,
                 magnitude=1.0) -> tuple[np.ndarray, np.ndarray]:
        key = (base, scale, factors, yarn, magnitude)
        missing = [p for p in positions if (key, p) not in self._rope]
        if missing:
            if factors is None and not yarn:
                freqs = self._frequencies(base, scale)
            else:
                freqs = [float(v) for v in self._scaled_frequencies(base, scale, factors, yarn)]
            for p in missing:
                self._rope[key, p] = rope.rope_cos_sin(p, freqs, round_to_f32=self._round)
        cos = np.array([self._rope[key, p][0] for p in positions], dtype=self.dtype)
        sin = np.array([self._rope[key, p][1] for p in positions], dtype=self.dtype)
        if magnitude != 1.0:
            m = self.dtype.type(magnitude)
            cos, sin = cos * m, sin * m
        return cos, sin

    # ------------------------------------------------------------------ the graph
    def new_cache(self) -> DenseKvCache:
        return DenseKvCache(self.config.n_layers)

    def forward(self, ids, cache: DenseKvCache | None = None, *, logits: str = "last"):
        """Run `ids` at positions cache.length.. and extend the cache (a fresh one if None).

        logits: "last" -> [vocab] of the last position; "all" -> [T, vocab]; "none" -> None
        (§3.3: the head is computed only for the rows asked for).
        """
        cfg, rules = self.config, self.config.rules
        ids = [int(i) for i in ids]
        if not ids:
            raise InputError("forward needs at least one token id")
        if any(not 0 <= i < cfg.vocab for i in ids):
            raise InputError(f"token ids must lie in [0, {cfg.vocab})")
        cache = cache if cache is not None else self.new_cache()
        T = len(ids)
        positions = list(range(cache.length, cache.length + T))
        tables = {rope_key: self._cos_sin(positions, *rope_key)
                  for rope_key in {self.rope_key(i) for i in range(cfg.n_layers)}}
        scale = cfg.attention_scale
        ffn = FFNS[rules.ffn]

        x = self._cast(self.weights.rows("token_embd.weight", ids))                  # §3.1
        if rules.embedding_scale:  # gemma3: sqrt(d) rounded to f32, as llama.cpp and the GPU take it
            x = x * x.dtype.type(constants.sqrt(cfg.d))
        if cfg.embedding_multiplier:                                                  # granite
            x = x * x.dtype.type(np.float32(cfg.embedding_multiplier))
        residual = x.dtype.type(np.float32(cfg.residual_multiplier)) if cfg.residual_multiplier else None
        for i in range(cfg.n_layers):                                                 # §3.2
            p = self.layer(i)
            if i in cfg.conv_layers:                                                  # lfm2
                h = rms_norm(x, p.attn_norm, cfg.eps)
                y, cache.conv_tails[i] = short_conv(matmul(h, p.conv_in), p.conv, cache.conv_tails.get(i))
                x1 = x + matmul(y, p.wo)
                x = x1 + FFNS[rules.ffn](rms_norm(x1, p.ffn_norm, cfg.eps), p)
                continue
            cos, sin = tables[self.rope_key(i)]
            window = cfg.sliding_window if cfg.is_sliding(i) else 0
            h = rms_norm(x, p.attn_norm, cfg.eps) if rules.pre_norms else x          # olmo2: x itself
            q, k, v = matmul(h, p.wq), matmul(h, p.wk), matmul(h, p.wv)
            if p.bq is not None:                                                      # qwen2
                q, k, v = q + p.bq, k + p.bk, v + p.bv
            if rules.qk_norm == "full":                                               # olmoe
                q, k = rms_norm(q, p.q_norm, cfg.eps), rms_norm(k, p.k_norm, cfg.eps)
            q = q.reshape(T, cfg.n_head, cfg.head_dim)
            k = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
            v = v.reshape(T, cfg.n_head_kv, cfg.value_dim)
            if rules.qk_norm == "head":                                               # qwen3
                q, k = rms_norm(q, p.q_norm, cfg.eps), rms_norm(k, p.k_norm, cfg.eps)
            if cfg.has_rope(i):                                                       # smollm3: NoPE layers
                q = apply_rope(q, cos, sin, rules.rope_style)
                k = apply_rope(k, cos, sin, rules.rope_style)
            keys, values = cache.extend(i, k, v)
            attn = causal_attention(q, keys, values, positions, scale, window, cfg.attn_softcap)
            o = matmul(attn.reshape(T, cfg.n_head * cfg.value_dim), p.wo)
            o = o if p.bo is None else o + p.bo
            if rules.post_norms:                                                      # gemma3
                o = rms_norm(o, p.post_attention_norm, cfg.eps)
            if residual is not None:                                                  # granite
                o = o * residual
            x1 = x + o
            z = rms_norm(x1, p.ffn_norm, cfg.eps) if rules.pre_norms else x1
            f = ffn(z, p)
            if rules.post_norms:
                f = rms_norm(f, p.post_ffw_norm, cfg.eps)
            if residual is not None:
                f = f * residual
            x = x1 + f
        cache.length += T

        if logits == "none":
            return None
        rows = x if logits == "all" else x[-1:]
        head, bias = self.head()                                                      # §3.3
        out = matmul(rms_norm(rows, self._cast(self.weights.tensor(f"{rules.output_norm}.weight")), cfg.eps), head)
        if bias is not None:
            out = out + bias
        if cfg.logit_scale:  # granite: ggml_scale by the f32 of 1 / logit_scale
            out = out * out.dtype.type(np.float32(1.0) / np.float32(cfg.logit_scale))
        if cfg.final_softcap:  # gemma2
            out = softcap(out, cfg.final_softcap)
        return out if logits == "all" else out[0]

    # ------------------------------------------------------------------ conveniences
    def logits(self, ids) -> np.ndarray:
        """Logits of every position of `ids` from an empty cache, [T, vocab]."""
        return self.forward(ids, logits="all")

    def next_logits(self, ids) -> np.ndarray:
        """Logits of the token after `ids`, [vocab]."""
        return self.forward(ids)

    def greedy(self, ids, steps: int, stop_ids=()) -> list[int]:
        """Greedy continuation (§3.4: ties to the lowest id): a prefill, then one decode step per
        new token. Stops early after emitting an id in `stop_ids`."""
        cache = self.new_cache()
        logits = self.forward(ids, cache)
        out: list[int] = []
        for step in range(steps):
            token = int(np.argmax(logits))
            out.append(token)
            if token in stop_ids or step == steps - 1:
                break
            logits = self.forward([token], cache)
        return out
