"""Engram memory in NumPy float32 (spec §4.2, §4.5 item 1, §6 item 3).

Hashed n-gram lookups: each table hashes the last `order` token ids into a slot, the fetched
rows are projected to keys and values, the values are smoothed by a dilated causal
convolution, and a block mixes the value in with a sigmoid gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import cq
from ..ops import F32, dilated_causal_conv, rms_unit, sigmoid

U32 = 0xFFFFFFFF
SEED_STEP = 0x9E3779B9
HASH_PRIME = 0x01000193


@dataclass(frozen=True, eq=False)
class EngramSite:
    """One site's own weights (§8 records 552 + 4s …)."""

    tables: cq.CQMatrix  # [tables·slots, sub_dim]; row tb·slots + idx
    key_proj: cq.CQMatrix  # [d, tables·sub_dim]
    value_proj: cq.CQMatrix  # [d, tables·sub_dim]
    taps: np.ndarray  # [conv_taps, d], indexed [j, channel]


def table_seed(order_index: int, head: int, seed_heads: int, heads: int) -> int:
    """seed = 0x9E3779B9 · (oi·S + h + 1) mod 2^32, S = seed_heads or the heads per order (§4.2)."""
    stride = seed_heads if seed_heads else heads
    return (SEED_STEP * (order_index * stride + head + 1)) & U32


def hash_indices(ids: np.ndarray, history: np.ndarray, orders: tuple, heads: int, seed_heads: int,
                 slots: int) -> np.ndarray:
    """Slot index of every (position, table) (§4.2): int64 [T, len(orders)·heads].

    `ids` are the raw u32 token ids (§0 item 1) of the positions being computed, `history` the
    max(orders)−1 ids just before them (most recent last; 0 before the sequence start, which is
    the §4.2 rule τ_{<0} = 0). Table tb = oi·heads + h. For each: acc = seed, then for j = 0
    (current token) … order−1: acc = (acc XOR τ_{p−j}) · 0x01000193 mod 2^32; finally
    acc ^= acc >> 15 and idx = acc mod slots. All arithmetic is uint32 with wrap-around.
    """
    ids = np.asarray(ids, dtype=np.uint64)
    back = max(orders) - 1
    history = np.asarray(history, dtype=np.uint64)
    if history.shape != (back,):
        raise ValueError(f"hash history must hold {back} ids, got {history.shape}")
    context = np.concatenate((history, ids))  # context[back + t] = τ_t
    t = np.arange(len(ids))
    columns = []
    for oi, order in enumerate(orders):
        for h in range(heads):
            acc = np.full(len(ids), table_seed(oi, h, seed_heads, heads), dtype=np.uint64)
            for j in range(order):
                acc = ((acc ^ context[back + t - j]) * HASH_PRIME) & U32
            acc ^= acc >> 15
            columns.append(acc % slots)
    return np.stack(columns, axis=1).astype(np.int64).reshape(len(ids), len(columns))


def hash_validity(positions: np.ndarray, orders: tuple, heads: int) -> np.ndarray:
    """valid(p, tb) = p ≥ order(tb) − 1 (§4.2): a table sees only complete n-grams. bool [T, tables]."""
    positions = np.asarray(positions)[:, None]
    table_orders = np.repeat(np.asarray(orders), heads)[None, :]
    return positions >= table_orders - 1


def fetch(tables: cq.CQMatrix, idx: np.ndarray, valid: np.ndarray, slots: int, sub_dim: int) -> np.ndarray:
    """e_p = concat_tb(valid ? Tab[tb·slots + idx[p, tb]] : 0) (§4.2), f32 [T, tables·sub_dim].

    A table row is sub_dim wide, zero-padded to the CQ group (§0 item 4): it is dequantised at
    its padded width (§5.4) and cut to its first sub_dim values.
    """
    count, num_tables = idx.shape
    rows = np.arange(num_tables)[None, :] * slots + idx
    values = cq.dequantize_rows(tables, rows.reshape(-1), padded=True)[:, :sub_dim]
    values = values.reshape(count, num_tables, sub_dim) * valid[:, :, None]
    return values.reshape(count, num_tables * sub_dim).astype(F32)


def project(key_proj: cq.CQMatrix, value_proj: cq.CQMatrix, fetched: np.ndarray) -> tuple:
    """K = KeyProj·e and Vraw = ValueProj·e (§4.2), sharing one prepared input (§5.5.1)."""
    prepared = cq.prepare_input(fetched, key_proj.group)
    return cq.matmul_prepared(key_proj, prepared), cq.matmul_prepared(value_proj, prepared)


def value_conv(raw_values: np.ndarray, taps: np.ndarray, dilation: int, max_order: int,
               positions: np.ndarray, tail: np.ndarray | None = None,
               tap_keep: np.ndarray | None = None) -> np.ndarray:
    """V_p = Σ_j taps[j] ⊙ Vraw_{p − j·dilation}, both skip conditions of §4.2 applied (and
    ``tap_keep``, the pad mask of §U a)."""
    return dilated_causal_conv(raw_values, taps, dilation, positions, max_order, tail, tap_keep)


def gate(u: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """bx = u + α·V with α = σ(⟨rms_unit(u), rms_unit(K)⟩ / sqrt(d)) per position (§4.5 item 1)."""
    d = u.shape[-1]
    score = np.sum(rms_unit(u) * rms_unit(keys), axis=-1, keepdims=True, dtype=F32)
    alpha = sigmoid(score / F32(np.sqrt(d)))
    return u + alpha * values
