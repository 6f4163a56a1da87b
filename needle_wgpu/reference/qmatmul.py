"""GGUF dequant-matmul and row gather in NumPy (dense-gguf spec §4.1, §3 step 1).

The oracle of ``kernels/qmatmul.py``. Dequantisation is ``gguf.quants.dequantize`` (PyPI
``gguf``), the reference for every block type; products are taken in float64 so that the GPU's
f32 sums are compared with something more exact than themselves.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


def dequantize(raw, qtype: str, rows: int, cols: int) -> np.ndarray:
    """W [rows x cols] float32 from a tensor's raw GGUF bytes (row-major blocks, §2)."""
    data = np.frombuffer(bytes(raw), dtype=np.uint8).reshape(rows, -1)
    w = gguf_dequantize(data, GGMLQuantizationType[qtype])
    return np.asarray(w, dtype=np.float32).reshape(rows, cols)


def matmul(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y[t][o] = sum_i W[o, i] x[t][i] (ggml's ne[0] is the input axis, §2)."""
    return (np.asarray(x, np.float64) @ np.asarray(w, np.float64).T).astype(np.float32)


def get_rows(w: np.ndarray, tokens, scale: float = 1.0) -> np.ndarray:
    """out[t] = scale * W[min(token_t, rows - 1)] in f32 (the lookup clamps out-of-range ids)."""
    ids = np.minimum(np.asarray(tokens, dtype=np.int64), w.shape[0] - 1)
    return (w[ids] * np.float32(scale)).astype(np.float32)
