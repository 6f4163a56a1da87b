"""Primitive operations of Needle 3 in NumPy float32 (spec §3, plus the RoPE of §4.5 item 7,
the causal convolutions of §4.2/§4.5 item 4 and the per-head norm of §0 item 2).

Every function is pure: arrays in, a new array out, nothing cached. They act on the last axis
and broadcast over any leading axes (positions, heads), so the same function serves a whole
prefill chunk and a single decode step.
"""

from __future__ import annotations

import numpy as np

from .. import constants

F32 = np.float32
EPS = F32(1e-6)  # §3: one epsilon everywhere, always inside the square root
SINKHORN_ITERATIONS = 20


def dot_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y[m, n] = Σ_k x[m, k] · w[n, k] for x [M, K] and w [N, K], in f32.

    Every product of the reference goes through here. Each output element is one f32 dot
    product whose summation order does not depend on M, so a position gets bit-identical
    results whether it is computed alone (decode) or in a batch (prefill). BLAS f32 matmul
    does not promise that, and int8 K/V rounding would amplify its last-bit differences
    (§6 item 1: prefill must attend through exactly what stepped decode stores). NumPy's
    einsum without `optimize` runs its own loops, never BLAS; a test guards the invariance.
    """
    return np.einsum("mk,nk->mn", np.ascontiguousarray(x, F32), np.ascontiguousarray(w, F32))


def _inv_rms(x: np.ndarray) -> np.ndarray:
    """1 / sqrt(mean(x²) + ε) over the last axis, kept as a trailing axis of length 1 (§3)."""
    mean_square = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    return F32(1) / np.sqrt(mean_square + EPS)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of the dense family (dense §3): x · (1/sqrt(mean(x²) + eps)) · w, as ggml orders it."""
    mean_square = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    return (x * (F32(1) / np.sqrt(mean_square + F32(eps)))) * weight


def rms_unit(x: np.ndarray) -> np.ndarray:
    """rms_unit(x) = x · 1/sqrt(mean(x²) + ε), no learned scale (§3)."""
    return x * _inv_rms(x)


def zc_rms_norm(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """ZCRMSNorm(x; s) = (1 + s) · x · 1/sqrt(mean(x²) + ε); no mean is subtracted (§3)."""
    return (F32(1) + scale) * x * _inv_rms(x)


def head_norm(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-head q/k norm (§4.5 item 6) in the division form of §0 item 2:
    (1 + s) · x / sqrt(mean(x²) + ε). x is [..., heads, head_dim]; s is shared by all heads."""
    mean_square = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    return (F32(1) + scale) * x / np.sqrt(mean_square + EPS)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """σ(x) = 1 / (1 + e^(−x)) (conventions)."""
    return F32(1) / (F32(1) + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    """silu(x) = x · σ(x) (§0 item 9)."""
    return x * sigmoid(x)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(g) · u with silu(g) = g / (1 + e^(−g)) (dense §3, the dense FFN)."""
    with np.errstate(over="ignore"):  # e^(−g) → inf for g < −88: silu → −0, as on the GPU
        return (gate / (F32(1) + np.exp(-gate))) * up


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """gelu(g) = 0.5·g·(1 + tanh(sqrt(2/π)·(g + 0.044715·g³))) (dense §3, Gemma 3)."""
    with np.errstate(over="ignore", invalid="ignore"):
        inner = F32(constants.GELU_TANH_SCALE) * (x + F32(constants.GELU_TANH_CUBIC) * (x * x * x))
        return F32(0.5) * x * (F32(1) + np.tanh(inner))


def gelu_gated(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu(g) · u, Gemma 3's FFN activation (dense §3)."""
    return gelu_tanh(gate) * up


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """tanh(x · f32(1/cap)) · cap, llama.cpp's soft-capping of scores or logits (dense §3:
    gemma2's attention logits, 50, and final logits, 30): ggml_scale, ggml_tanh, ggml_scale."""
    cap32 = F32(cap)
    return np.tanh(np.asarray(x, F32) * F32(F32(1) / cap32)) * cap32


def scale_softcap(x: np.ndarray, scale: float | None = None, cap: float | None = None) -> np.ndarray:
    """x · scale (when given), then ``softcap`` (when given): granite's logits / logit_scale
    (scale = the f32 of 1 / logit_scale), gemma2's final logits. The reference of
    ``kernels.norm.scale_softcap``."""
    x = np.asarray(x, F32)
    if scale is not None:
        x = x * F32(scale)
    return x if cap is None else softcap(x, cap)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Max-subtracted softmax, divided by the sum (§3; §0 item 2 for the HadaMLP cond)."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def logsumexp(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """max + ln Σ exp(x − max) over one axis, the axis kept with length 1 (§3)."""
    top = np.max(x, axis=axis, keepdims=True)
    return top + np.log(np.sum(np.exp(x - top), axis=axis, keepdims=True))


def sinkhorn(logits: np.ndarray, iterations: int = SINKHORN_ITERATIONS) -> np.ndarray:
    """Log-domain Sinkhorn over the last two axes (§3): every iteration normalises the rows,
    then the columns; the result exp(M) is (nearly) doubly stochastic."""
    m = np.array(logits, dtype=F32)
    for _ in range(iterations):
        m = m - logsumexp(m, axis=-1)  # each row i: M[i, :] −= lse(M[i, :])
        m = m - logsumexp(m, axis=-2)  # each column j: M[:, j] −= lse(M[:, j])
    return np.exp(m)


# ---------------------------------------------------------------------------- quantisation


def quantize_rows(x: np.ndarray, bits: int = 8) -> tuple:
    """Symmetric per-vector quantisation over the last axis (§3 fake_quant, §6 quantize_rows).

    Returns (integers, scale): scale = absmax / qmax (1 when the vector is all zeros) with
    qmax = 2^(bits−1) − 1, integers = clip(round(x / scale), −qmax − 1, qmax). As §3 recommends
    for faithfulness to upstream, x is divided by the scale and ties round half to even; using
    the same rule for the int8 cache makes fake_quant(x) == integers · scale exactly (§6).
    The integers are int8 for bits ≤ 8, int32 otherwise; scale keeps a trailing axis of 1.
    """
    qmax = F32(2 ** (bits - 1) - 1)
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = np.where(absmax > 0, absmax / qmax, F32(1)).astype(F32)
    integers = np.clip(np.round(x / scale), -qmax - 1, qmax)  # np.round: half to even
    return integers.astype(np.int8 if bits <= 8 else np.int32), scale


def fake_quant(x: np.ndarray, bits: int = 8) -> np.ndarray:
    """fake_quant(x, bits) over the whole last axis (§3): quantise, then dequantise to f32."""
    integers, scale = quantize_rows(x, bits)
    return integers.astype(F32) * scale


def cq_fake_quant(x: np.ndarray, levels: np.ndarray, group: int = constants.KV_CQ_GROUP) -> np.ndarray:
    """The CQ round trip of every vector of the last axis (§4.9 point 5, upstream ``cq_quantize``
    at one group): the K/V quantisation of kv_bits 2/3/4.

    Zero-pad to ``group``, rot = Hn·x (normalised FWHT), norm = ‖rot‖₂ (f32), unit = rot /
    max(norm, 1e-12), the nearest of ``levels`` (sorted ascending; ties go to the lower index),
    times the norm rounded to FP16 (to nearest, ties to even), then Hn again and cut back to the
    input width. The vector width must be at most ``group``.
    """
    width = x.shape[-1]
    if width > group:
        raise ValueError(f"cq_fake_quant: width {width} exceeds the group {group}")
    padded = np.zeros((*x.shape[:-1], group), F32)
    padded[..., :width] = x
    rot = fwht(padded, group)
    norm = np.sqrt(np.sum(np.square(rot, dtype=F32), axis=-1, keepdims=True, dtype=F32))
    unit = rot / np.maximum(norm, F32(1e-12))
    book = np.asarray(levels, F32)
    # searchsorted (left) then the closer neighbour, left when equally close (upstream _cq_nearest).
    pos = np.clip(np.searchsorted(book, unit), 1, len(book) - 1)
    left, right = book[pos - 1], book[pos]
    nearest = np.where(np.abs(unit - left) <= np.abs(unit - right), left, right)
    rounded_norm = norm.astype(np.float16).astype(F32)
    return fwht((nearest * rounded_norm).astype(F32), group)[..., :width]


# ---------------------------------------------------------------------------- Hadamard


def fwht(x: np.ndarray, group: int) -> np.ndarray:
    """Normalised Walsh–Hadamard transform of every `group`-long chunk of the last axis (§3).

    Sylvester (natural) order, butterflies h = 1, 2, … group/2, then one multiply by the f32
    value of 1/sqrt(group). The last axis must be a multiple of `group`.
    """
    if group & (group - 1) or x.shape[-1] % group:
        raise ValueError(f"fwht: width {x.shape[-1]} is not a multiple of the power of two {group}")
    lead = x.shape[:-1]
    v = np.array(x, dtype=F32).reshape(-1, group)
    h = 1
    while h < group:
        # Split each chunk into blocks of 2h: a = first half, b = second half (v[j], v[j+h]).
        blocks = v.reshape(v.shape[0], group // (2 * h), 2, h)
        a, b = blocks[:, :, 0, :], blocks[:, :, 1, :]
        v = np.stack((a + b, a - b), axis=2).reshape(-1, group)
        h *= 2
    return (v * F32(constants.inv_sqrt(group))).reshape(*lead, x.shape[-1])


# ---------------------------------------------------------------------------- RoPE


def rope_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """f_i = 1 / theta^(2i / head_dim) for i < head_dim/2, each step in f32 (§4.5 item 7).

    The table of ``needle_wgpu.constants`` (the one the GPU ops upload): NumPy's f32 power is
    one ulp off on some CPUs, and RoPE at far positions would turn that into a parity failure.
    """
    return np.array(constants.rope_frequencies(head_dim, theta), dtype=F32)


def cos_sin(angles: np.ndarray) -> tuple:
    """cos and sin of f32 angles, evaluated in float64 and rounded to f32 once.

    NumPy's f32 sin/cos differ by an ulp between SIMD paths; the float64 values rounded once
    are the correctly rounded f32 results on every CPU (up to double-rounding ties).
    """
    wide = np.asarray(angles, dtype=np.float64)
    return np.cos(wide).astype(F32), np.sin(wide).astype(F32)


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Half-split ("NeoX") rotary embedding (§4.5 item 7).

    x is [T, heads, head_dim] and positions [T] the absolute positions (BOS is 0). Element i
    pairs with i + head_dim/2: (x_i, x_j) ← (x_i·c − x_j·s, x_j·c + x_i·s), angle = f32(t)·f_i.
    """
    return rope_pairs(x, positions, theta, x.shape[-1], "neox")


def rope_pairs(x: np.ndarray, positions: np.ndarray, base: float, dims: int, style: str,
               scale: float = 1.0) -> np.ndarray:
    """RoPE of the first ``dims`` elements of each head (dense §3); the rest pass through.

    style "neox" pairs (x_j, x_{j+dims/2}), "adjacent" pairs (x_{2j}, x_{2j+1}) (llama GGUFs);
    (a, b) ← (a·c − b·s, a·s + b·c), angle = f32(p)·f_j, f = constants.rope_frequencies(dims, base,
    scale) (``scale``: linear RoPE scaling folded into the table). x is [T, heads, head_dim].
    """
    if dims == 0:
        return x.copy()
    half = dims // 2
    table = np.array(constants.rope_frequencies(dims, base, scale), dtype=F32)
    angles = np.asarray(positions, dtype=F32)[:, None] * table
    cos, sin = cos_sin(angles)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = np.array(x, dtype=F32)
    if style == "neox":
        a, b = x[..., :half], x[..., half:dims]
        out[..., :half], out[..., half:dims] = a * cos - b * sin, a * sin + b * cos
    elif style == "adjacent":
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * cos - b * sin, a * sin + b * cos
    else:
        raise ValueError(f"rope style {style!r}")
    return out


# ---------------------------------------------------------------------------- convolutions


def causal_conv(x: np.ndarray, taps: np.ndarray, tail: np.ndarray | None = None,
                tap_keep: np.ndarray | None = None) -> np.ndarray:
    """Per-channel causal convolution over positions (§4.5 item 4, §6 item 2).

    out_t = Σ_j taps[j] ⊙ x_{t−j}; tap 0 multiplies the current position. x is [T, C], taps
    [K, C]. `tail` holds the K−1 inputs just before x (most recent last), as a decode cache keeps
    them; without it the inputs before the sequence are zero. ``tap_keep`` [K, T] (bool) drops
    tap j at position t where it is False (the pad mask, §U a).
    """
    k = taps.shape[0]
    if tail is None:
        tail = np.zeros((k - 1, x.shape[1]), F32)
    padded = np.concatenate((tail, x), axis=0)  # padded[k−1+t] = x_t
    out = np.zeros_like(x, dtype=F32)
    for j in range(k):
        term = taps[j] * padded[k - 1 - j : k - 1 - j + x.shape[0]]
        out += term if tap_keep is None else np.where(tap_keep[j][:, None], term, F32(0))
    return out


def short_conv(bcx: np.ndarray, weights: np.ndarray, tail: np.ndarray | None = None) -> tuple:
    """LFM2's gated short convolution (dense §3, llama.cpp's shortconv): in_proj's rows
    bcx [T, 3·C] = [b | c | x], conv weights [C, K]; bx = b ⊙ x, y_t = c_t ⊙ Σ_{j<K} w[:, j] ⊙
    bx_{t−(K−1)+j}, summed j = 0 .. K−1 from 0 as ggml_ssm_conv. ``tail`` holds the K−1 bx rows
    before the chunk (the conv state; zeros at the start). Returns (y [T, C], the new tail)."""
    bcx = np.asarray(bcx)
    width, k = weights.shape
    b, c, x = bcx[:, :width], bcx[:, width:2 * width], bcx[:, 2 * width:]
    if tail is None:
        tail = np.zeros((k - 1, width), bcx.dtype)
    padded = np.concatenate((tail, b * x), axis=0)  # padded[k−1+t] = bx_t
    acc = np.zeros_like(c)
    for j in range(k):
        acc = acc + weights[:, j] * padded[j: j + len(bcx)]
    return c * acc, padded[len(padded) - (k - 1):]


def dilated_causal_conv(x: np.ndarray, taps: np.ndarray, dilation: int, positions: np.ndarray,
                        min_history: int, tail: np.ndarray | None = None,
                        tap_keep: np.ndarray | None = None) -> np.ndarray:
    """The Engram value convolution (§4.2, §6 item 3): out_p = Σ_j taps[j] ⊙ x_{p − j·dilation}.

    Tap j is skipped at absolute position p when j·dilation > p or p < j·min_history, both
    conditions of §4.2 (upstream gates tap j by mask validity at offset j·max(orders)).
    x is [T, C] at `positions`; `tail` holds the (K−1)·dilation inputs before x, most recent last.
    """
    k = taps.shape[0]
    span = (k - 1) * dilation
    if tail is None:
        tail = np.zeros((span, x.shape[1]), F32)
    padded = np.concatenate((tail, x), axis=0)  # padded[span+t] = x_t
    positions = np.asarray(positions)
    out = np.zeros_like(x, dtype=F32)
    for j in range(k):
        shift = j * dilation
        used = ((shift <= positions) & (positions >= j * min_history))[:, None]
        if tap_keep is not None:
            used = used & tap_keep[j][:, None]
        out += np.where(used, taps[j] * padded[span - shift : span - shift + x.shape[0]], F32(0))
    return out


def conv_tail(tail: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The next tail of a causal convolution: the last len(tail) inputs of tail ++ x (§6 item 2)."""
    keep = tail.shape[0]
    if keep == 0:
        return tail
    return np.concatenate((tail, x), axis=0)[-keep:].copy()
