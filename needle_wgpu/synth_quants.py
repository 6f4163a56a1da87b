"""Quantisers for the GGUF types `gguf.quants.quantize` cannot write (gguf 0.19.0): Q2_K, Q3_K,
IQ4_NL, IQ4_XS (spec dense-gguf.md §4.1). Test-time only (NumPy), for `synth_gguf`.

Plain round-to-nearest with one scale search-free pass per block: valid bits in ggml's block
layouts, not llama.cpp's error-minimising quantisers. Every reader (gguf.quants.dequantize,
llama.cpp, the GPU kernels) decodes the same bits, so parity tests need only valid blocks with
a realistic spread; `tests/test_synth_quants.py` checks the round trip through
`gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
# ggml's kvalues_iq4nl: the non-linear grid of IQ4_NL and IQ4_XS.
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype("<f2")


def _safe(d: np.ndarray) -> np.ndarray:
    return np.where(d == 0, np.float32(1), d)


def _grid_codes(v: np.ndarray) -> np.ndarray:
    """The index of the nearest IQ4 grid value of each element."""
    return np.argmin(np.abs(v[..., None] - IQ4_GRID), axis=-1).astype(np.uint8)


def _pack_nibbles16(codes: np.ndarray) -> np.ndarray:
    """32-weight groups [..., 32] -> 16 bytes: element l < 16 the low nibble of byte l, l + 16 its high."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> [rows, cols / 32 * 18] uint8: d (f16), qs[16]."""
    x = w.reshape(-1, 32).astype(np.float32)
    d = _f16(np.max(np.abs(x), axis=1) / 127.0)
    codes = _grid_codes(x / _safe(d.astype(np.float32))[:, None])
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), _pack_nibbles16(codes)], axis=1)
    return out.reshape(w.shape[0], -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> [rows, cols / 256 * 136] uint8: d (f16), scales_h (u16), scales_l[4],
    qs[128]; sub-block s of 32 weights has the scale d · (6-bit code − 32)."""
    x = w.reshape(-1, 8, 32).astype(np.float32)
    sub = np.max(np.abs(x), axis=2) / 127.0
    d = _f16(np.max(sub, axis=1) / 31.0)
    df = _safe(d.astype(np.float32))
    sc = np.clip(np.round(sub / df[:, None]), 0, 31).astype(np.int32)
    codes6 = (sc + 32).astype(np.uint32)
    step = df[:, None] * np.where(sc == 0, 1, sc)
    codes = _grid_codes(x / step[..., None])
    scales_h = np.zeros(len(x), np.uint32)
    for s in range(8):
        scales_h |= (codes6[:, s] >> 4) << (2 * s)
    low = (codes6 & 15).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), scales_h.astype("<u2").view(np.uint8).reshape(-1, 2),
                          scales_l, _pack_nibbles16(codes).reshape(len(x), 128)], axis=1)
    return out.reshape(w.shape[0], -1)


def _element_order(x: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 2, 4, 32]: element 128h + 32c + l at [h, c, l] (Q2_K / Q3_K bit planes)."""
    return x.reshape(-1, 2, 4, 32)


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """q [n, 256] in 0..3 -> qs[64]: bits 2c, 2c+1 of qs[32h + l] hold element 128h + 32c + l."""
    planes = _element_order(q).astype(np.uint8)
    qs = np.zeros((len(q), 2, 32), np.uint8)
    for c in range(4):
        qs |= planes[:, :, c, :] << (2 * c)
    return qs.reshape(len(q), 64)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> [rows, cols / 256 * 84] uint8: scales[16] (scale | min << 4), qs[64],
    d, dmin (f16); weight = d · sc · q − dmin · m over sub-blocks of 16."""
    x = w.reshape(-1, 16, 16).astype(np.float32)
    lo = np.maximum(-np.min(x, axis=2), 0.0)
    span = (np.max(x, axis=2) + lo) / 3.0
    d = _f16(np.max(span, axis=1) / 15.0)
    dmin = _f16(np.max(lo, axis=1) / 15.0)
    df, dminf = _safe(d.astype(np.float32)), dmin.astype(np.float32)
    sc = np.clip(np.round(span / df[:, None]), 1, 15)
    m = np.clip(np.round(lo / _safe(dminf)[:, None]), 0, 15)
    q = np.clip(np.round((x + (dminf[:, None] * m)[..., None]) / (df[:, None] * sc)[..., None]), 0, 3)
    scales = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4))
    out = np.concatenate([scales, _pack_2bit(q.reshape(-1, QK_K)), d.view(np.uint8).reshape(-1, 2),
                          dmin.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(w.shape[0], -1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> [rows, cols / 256 * 110] uint8: hmask[32], qs[64], scales[12], d (f16);
    weight = d · (6-bit code − 32) · q with q in −4..3 over sub-blocks of 16."""
    x = w.reshape(-1, 16, 16).astype(np.float32)
    sub = np.max(np.abs(x), axis=2) / 4.0
    d = _f16(np.max(sub, axis=1) / 31.0)
    df = _safe(d.astype(np.float32))
    sc = np.clip(np.round(sub / df[:, None]), 1, 31)
    q = np.clip(np.round(x / (df[:, None] * sc)[..., None]), -4, 3).reshape(-1, QK_K) + 4  # 0..7
    qs = _pack_2bit(q.astype(np.uint8) & 3)
    high = _element_order((q.astype(np.uint8) >> 2) & 1)          # [n, h, c, l]
    hmask = np.zeros((len(q), 32), np.uint8)
    for h in range(2):
        for c in range(4):
            hmask |= high[:, h, c, :] << (4 * h + c)
    codes = (sc.astype(np.int32) + 32).astype(np.uint8)            # [n, 16], 6 bits
    scales = np.zeros((len(q), 12), np.uint8)
    for s in range(16):
        scales[:, s & 7] |= (codes[:, s] & 15) << (4 * (s >> 3))
        scales[:, 8 + (s & 3)] |= (codes[:, s] >> 4) << (2 * (s >> 2))
    out = np.concatenate([hmask, qs, scales, d.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(w.shape[0], -1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "IQ4_NL": quantize_iq4_nl, "IQ4_XS": quantize_iq4_xs}
