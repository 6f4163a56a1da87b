"""The mHC lane stream in NumPy float32 (spec §4.3, §4.4, §4.7).

Every position carries `n` lanes of width d. Before a block, a sigmoid-weighted sum of the
lanes ("mix_down") is the block input; after it, a Sinkhorn-normalised lane mix plus a weighted
copy of the block delta ("scatter_up") is the new lane state. All weights come from three CQ
products (φ_pre, φ_post, φ_res) of the same normalised, flattened lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import cq
from ..ops import F32, rms_unit, sigmoid, sinkhorn

ACTIVE_PRE_OFFSET = F32(4)
INACTIVE_OFFSET = F32(-4)


@dataclass(frozen=True)
class MhcLayer:
    """The mHC scalars of one layer (§8 records 541-546, sliced at layer l)."""

    active_lane: int  # l mod n (§4.4); after ladder slicing, the block's new index mod n (§10)
    a_pre: float
    a_post: float
    a_res: float
    b_pre: np.ndarray  # [n]
    b_post: np.ndarray  # [n]
    b_res: np.ndarray  # [n, n]


def broadcast_lanes(x0: np.ndarray, lanes: int) -> np.ndarray:
    """Every lane starts as the scaled embedding (§4.3): [T, d] → [T, n, d]."""
    return np.repeat(x0[:, None, :], lanes, axis=1).astype(F32)


def lane_norm(lanes: np.ndarray) -> np.ndarray:
    """nx = rms_unit(flatten(X_t)), lane-major (element lane·d + c) (§4.4): [T, n·d]."""
    count, n, d = lanes.shape
    return rms_unit(lanes.reshape(count, n * d))


def lane_products(phi_pre: cq.CQMatrix, phi_post: cq.CQMatrix, phi_res: cq.CQMatrix,
                  layer: int, nx: np.ndarray, n: int) -> tuple:
    """The three φ bands of layer l (n lanes) against one prepared nx (§4.4, §4.7, §5.5.3).

    Returns pre [T, n], post [T, n] and res [T, n, n] from rows l·n … l·n+n−1 of φ_pre/φ_post
    and l·n² … l·n²+n²−1 of φ_res.
    """
    prepared = cq.prepare_input(nx, phi_pre.group)
    pre = cq.matmul_prepared(phi_pre, prepared, layer * n, n)
    post = cq.matmul_prepared(phi_post, prepared, layer * n, n)
    res = cq.matmul_prepared(phi_res, prepared, layer * n * n, n * n)
    return pre, post, res.reshape(-1, n, n)


def lane_offsets(lanes: int, active: int, active_offset: F32) -> np.ndarray:
    """`active_offset` on the active lane, −4 on every other lane (§4.4, §4.7)."""
    offsets = np.full(lanes, INACTIVE_OFFSET, F32)
    offsets[active] = active_offset
    return offsets


def pre_weights(pre: np.ndarray, p: MhcLayer) -> np.ndarray:
    """hpre_j = σ(a_pre·pre_j + b_pre_j + off_j), off = +4 on the active lane, else −4 (§4.4)."""
    offsets = lane_offsets(pre.shape[-1], p.active_lane, ACTIVE_PRE_OFFSET)
    return sigmoid(F32(p.a_pre) * pre + p.b_pre + offsets)


def post_weights(post: np.ndarray, p: MhcLayer) -> np.ndarray:
    """hpost_j = 2·σ(a_post·post_j + b_post_j + off_j), off = 0 on the active lane, else −4 (§4.7)."""
    offsets = lane_offsets(post.shape[-1], p.active_lane, F32(0))
    return F32(2) * sigmoid(F32(p.a_post) * post + p.b_post + offsets)


def residual_mix(res: np.ndarray, p: MhcLayer) -> np.ndarray:
    """Hres = Sinkhorn20(a_res·res + b_res), a doubly stochastic n×n per position (§4.7)."""
    return sinkhorn(F32(p.a_res) * res + p.b_res)


def mix_down(lanes: np.ndarray, hpre: np.ndarray) -> np.ndarray:
    """u = Σ_j hpre_j · X[j], the block input (§4.4): [T, n, d], [T, n] → [T, d]; j ascending."""
    u = hpre[:, 0:1] * lanes[:, 0]
    for j in range(1, lanes.shape[1]):
        u = u + hpre[:, j : j + 1] * lanes[:, j]
    return u


def scatter_up(lanes: np.ndarray, hres: np.ndarray, hpost: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """X'[i] = Σ_j Hres[i, j]·X[j] + hpost_i·y, with the old X on the right (§4.7); j ascending."""
    mixed = hres[:, :, 0:1] * lanes[:, 0:1]
    for j in range(1, lanes.shape[1]):
        mixed = mixed + hres[:, :, j : j + 1] * lanes[:, j : j + 1]
    return mixed + hpost[:, :, None] * delta[:, None, :]


def lane_mean(lanes: np.ndarray) -> np.ndarray:
    """x̄ = (1/n)·Σ_j X[j]: lanes summed in order, then divided by n (§4.8)."""
    total = lanes[:, 0].copy()
    for j in range(1, lanes.shape[1]):
        total += lanes[:, j]
    return total / F32(lanes.shape[1])
