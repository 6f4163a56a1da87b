"""The dense family's attention inputs in NumPy float32 (dense spec §3): biases, q/k norms, RoPE.

``position_heads`` is the reference of ``kernels.attention.qk_rope``; the attention itself is
``reference.needle3.attention.attend`` (GQA, window, ``scale``), as for Needle 3 without the gate.
The layer is described by the same ``AttentionShape`` the GPU op takes. An f16 K/V cache is
``attend`` over ``kv_f16`` of the keys and values.
"""

from __future__ import annotations

import numpy as np

from .ops import F32, rms_norm, rope_pairs

HALF_MAX = 65504.0  # the largest finite IEEE half


def kv_f16(x: np.ndarray) -> np.ndarray:
    """K or V as an f16 cache holds it, widened back to f32: saturated to ±65504 and rounded to
    the nearest half, ties to even (np.float16 would give inf beyond 65520; the cache saturates,
    as every out-of-range number does under the no-panic contract)."""
    return np.clip(np.asarray(x, F32), -HALF_MAX, HALF_MAX).astype(np.float16).astype(F32)


def position_heads(shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, *,
                   q_norm=None, k_norm=None, q_bias=None, k_bias=None, v_bias=None) -> tuple:
    """q, k, v projections [T, width] → heads after bias, norm and RoPE (dense §3).

    Returns q [T, H, qk], k [T, KV, qk] (both normed and rotated) and v [T, KV, vd] (only
    biased). ``shape.norm`` "head": RMSNorm of each (position, head) slice with the [qk]
    weights; "full": RMSNorm of the whole q (k) row with [H·qk] ([KV·qk]) weights, before the
    split into heads. RoPE: ``shape.rope`` pairing on the first ``shape.rope_dims`` dims.
    """
    sh = shape
    q, k, v = (np.asarray(a, F32) for a in (q, k, v))
    if sh.bias:
        q, k, v = q + q_bias, k + k_bias, v + v_bias
    T = q.shape[0]
    if sh.norm == "full":
        q, k = rms_norm(q, q_norm, sh.eps), rms_norm(k, k_norm, sh.eps)
    qh, kh = q.reshape(T, sh.heads, sh.qk_dim), k.reshape(T, sh.kv_heads, sh.qk_dim)
    if sh.norm == "head":
        qh, kh = rms_norm(qh, q_norm, sh.eps), rms_norm(kh, k_norm, sh.eps)
    if sh.rope != "none":
        qh = rope_pairs(qh, positions, sh.rope_base, sh.rope_dims, sh.rope, sh.rope_scale)
        kh = rope_pairs(kh, positions, sh.rope_base, sh.rope_dims, sh.rope, sh.rope_scale)
    return qh, kh, v.reshape(T, sh.kv_heads, sh.v_dim)
