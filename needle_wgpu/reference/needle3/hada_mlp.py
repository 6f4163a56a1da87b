"""The v3 HadamardMLP in NumPy float32 (spec §4.6).

Three learned Kronecker-product stages (A ⊗ B of two small FP16 factors), separated by fixed
permutations, diagonal scales and one SiLU, with a low-rank input-conditioned scale in the
middle. Despite the name, no fast Walsh–Hadamard transform applies: the factors are trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops import F32, dot_rows, silu, softmax


@dataclass(frozen=True, eq=False)
class HadaParams:
    """One layer's HadaMLP parameters (§8 layer records +14 … +26) and the global permutations."""

    pre_hada: np.ndarray  # [d], the block's ZCRMSNorm before the MLP (§4.5 item 12)
    d1: np.ndarray  # [n] each of d1 … d4 and b2
    d2: np.ndarray
    b2: np.ndarray
    d3: np.ndarray
    d4: np.ndarray
    w1a: np.ndarray  # [ba, ba]
    w1b: np.ndarray  # [bb, bb]
    w2a: np.ndarray
    w2b: np.ndarray
    w3a: np.ndarray
    w3b: np.ndarray
    cond_v: np.ndarray  # [d, r]; the rank r comes from this shape (§0 item 3)
    cond_u: np.ndarray  # [r, n]
    p1: np.ndarray  # int64 [n], gather order after stage 1
    p2: np.ndarray  # int64 [n], gather order after stage 2


def cond_scale(x: np.ndarray, cond_v: np.ndarray, cond_u: np.ndarray) -> np.ndarray:
    """cond = 1 + softmax(x·cond_v)·cond_u (§4.6 step 1); the softmax divides by its sum (§0 item 2)."""
    return F32(1) + dot_rows(softmax(dot_rows(x, cond_v.T)), cond_u.T)


def kron_stage(z: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Kron(z; A, B) (§4.6): view each row of z as Z [ba, bb] row-major, return flatten(Aᵀ·Z·B).

    Equivalently z ← z·(A ⊗ B). Aᵀ·Z is formed first, then ·B, as in Rust.
    """
    count, ba, bb = z.shape[0], a.shape[0], b.shape[0]
    grid = z.reshape(count, ba, bb)
    # (AᵀZ)[t, k, j] = Σ_i A[i, k]·Z[t, i, j]: lay i out last, one row per (t, j).
    by_column = grid.transpose(0, 2, 1).reshape(count * bb, ba)
    left = dot_rows(by_column, a.T).reshape(count, bb, ba).transpose(0, 2, 1)
    # (AᵀZB)[t, k, l] = Σ_j (AᵀZ)[t, k, j]·B[j, l]: one row per (t, k).
    return dot_rows(left.reshape(count * ba, bb), b.T).reshape(count, ba * bb)


def permute(z: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Gather: z_new[i] = z_old[order[i]] (§4.6 steps 3 and 5)."""
    return z[:, order]


def hada_mlp(x: np.ndarray, p: HadaParams) -> np.ndarray:
    """HadaMLP(x) for pre_hada-normed x [T, d] → [T, d] (§4.6 steps 1-7)."""
    d, n = x.shape[1], p.d1.shape[0]
    cond = cond_scale(x, p.cond_v, p.cond_u)
    z = np.zeros((x.shape[0], n), F32)
    z[:, :d] = x  # step 2: zero padding to hada_n
    z = z * p.d1
    z = permute(kron_stage(z, p.w1a, p.w1b), p.p1)  # step 3
    z = silu((p.d2 * cond) * z + p.b2)  # step 4
    z = permute(kron_stage(z, p.w2a, p.w2b), p.p2)  # step 5
    z = kron_stage(z * p.d3, p.w3a, p.w3b)  # step 6
    return (z * p.d4)[:, :d]  # step 7
