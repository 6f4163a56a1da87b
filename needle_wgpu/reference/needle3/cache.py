"""Incremental decode state of Needle 3 in NumPy (spec §6): what a session carries between calls.

Per layer a K/V ring buffer and the q/k/v convolution tails; for the Engram the recent token ids
and per-site value tails. The mHC lanes are per position and are not cached (§6 item 4).
Buffers are preallocated at their final capacity, so position p always sits at slot
p mod capacity and the ring never reorders data.
"""

from __future__ import annotations

import enum

import numpy as np

from ...errors import ContextFullError, InputError
from ...formats.needle3_geometry import Needle3Geometry
from ..ops import F32, conv_tail


class KvPrecision(enum.Enum):
    """How K and V are stored (§6 item 1): f32 vectors, or int8 + one f32 scale per (slot, kv head)."""

    F32 = "f32"
    INT8 = "int8"


class KvRing:
    """One layer's keys and values at positions [length − capacity, length), slot = p mod capacity.

    A position's entry is a fixed tuple of arrays: (k, v) in f32 mode and
    (k_i8, k_scale, v_i8, v_scale) in int8 mode (§6 item 1).
    """

    def __init__(self, capacity: int, entry_shapes: tuple, entry_dtypes: tuple):
        self.capacity = capacity
        self.buffers = tuple(np.zeros((capacity, *shape), dtype)
                             for shape, dtype in zip(entry_shapes, entry_dtypes))

    def read(self, length: int) -> tuple:
        """Entries of the last min(length, capacity) positions, oldest first, and their positions."""
        positions = np.arange(max(0, length - self.capacity), length)
        slots = positions % self.capacity
        return tuple(buffer[slots] for buffer in self.buffers), positions

    def write(self, positions: np.ndarray, entries: tuple) -> None:
        """Store the entries of consecutive new positions; only the newest `capacity` survive."""
        keep = slice(max(0, len(positions) - self.capacity), None)
        slots = positions[keep] % self.capacity
        for buffer, values in zip(self.buffers, entries):
            buffer[slots] = values[keep]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers)


class LayerState:
    """One layer's K/V ring and the last taps−1 pre-conv q, k and v rows (§6 items 1-2)."""

    def __init__(self, g: Needle3Geometry, layer: int, precision: KvPrecision):
        kv, qk, vd = g.num_kv_heads, g.qk_head_dim, g.v_head_dim
        if precision is KvPrecision.INT8:
            shapes, dtypes = ((kv, qk), (kv,), (kv, vd), (kv,)), (np.int8, F32, np.int8, F32)
        else:
            shapes, dtypes = ((kv, qk), (kv, vd)), (F32, F32)
        self.kv = KvRing(g.attention_span(layer), shapes, dtypes)
        tail = max(g.qkv_conv_taps - 1, 0)
        self.q_tail = np.zeros((tail, g.q_dim), F32)
        self.k_tail = np.zeros((tail, g.k_dim), F32)
        self.v_tail = np.zeros((tail, g.v_dim), F32)

    def roll_tails(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """After a chunk, keep its last taps−1 raw rows (zero-padded in front when short)."""
        self.q_tail, self.k_tail, self.v_tail = (
            conv_tail(self.q_tail, q), conv_tail(self.k_tail, k), conv_tail(self.v_tail, v))


class KVCache:
    """The whole decode state of one session (§6). `length` is the number of positions consumed.

    Local layers keep min(sliding_window, max_seq_len) positions, global layers max_seq_len.
    Global layers never wrap (§0 item 8): at max_seq_len the cache is full and refuses more.
    """

    def __init__(self, geometry: Needle3Geometry, precision: KvPrecision | str = KvPrecision.F32):
        try:
            self.precision = KvPrecision(precision)
        except ValueError:
            raise InputError(f"unknown KV precision {precision!r} (expected 'f32' or 'int8')") from None
        g = self.geometry = geometry
        self.length = 0
        self.layers = [LayerState(g, layer, self.precision) for layer in range(g.num_layers)]
        # §6 item 3: the ids before the next position (0 before the sequence start) and, per site,
        # the last (taps−1)·dilation pre-conv Engram values.
        self.token_history = np.zeros(g.engram_max_order - 1, np.uint32)
        value_tail = (g.engram_conv_taps - 1) * g.engram_conv_dilation
        self.engram_tails = [np.zeros((value_tail, g.d_model), F32) for _ in g.engram_sites]

    @property
    def capacity(self) -> int:
        return self.geometry.max_seq_len

    @property
    def remaining(self) -> int:
        return self.capacity - self.length

    @property
    def full(self) -> bool:
        return self.length >= self.capacity

    def reserve(self, count: int) -> None:
        """Refuse (before touching any state) a chunk that would run past max_seq_len (§0 item 8)."""
        if count > self.remaining:
            raise ContextFullError(
                f"context full: {self.length} of {self.capacity} positions used, {count} more requested")

    def remember_tokens(self, ids: np.ndarray) -> None:
        keep = len(self.token_history)
        if keep:
            self.token_history = np.concatenate((self.token_history, ids))[-keep:].astype(np.uint32)

    @property
    def nbytes(self) -> int:
        return sum(state.kv.nbytes for state in self.layers)
