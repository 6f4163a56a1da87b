"""Cactus-Quants (CQ) weights in NumPy float32 (spec §5).

A CQ record stores, per output row and per group of G inputs, one FP16 norm and G codebook
indices of the Hadamard-rotated, normalised weights (§5.1-§5.3). `CQMatrix` unpacks the indices
once into a uint8 matrix (cached) and the norms into f32; nothing here ever needs the
dequantised matrix, because a matrix-vector product can run in the rotated domain (§5.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ... import constants
from ...formats import cact
from ..ops import F32, dot_rows, fwht

TERNARY_LEVEL = constants.TERNARY_LEVEL  # §5.2, before the 1/sqrt(G) scale


def level_table(bits: int, group: int, codebook_levels) -> np.ndarray:
    """Value of every code a row can hold, indexed by the raw packed field (§5.2, §5.3).

    For 2/3/4 bits this is the header codebook slice (already divided by sqrt(G)). Ternary
    records (bits = 5) hold 2-bit crumbs: 3 → −c, 0 → 0, 1 → +c, and the invalid crumb 2 reads
    as 0 as in Rust; c = 1.2240064 / sqrt(G). 1-bit records: 0 → −c, 1 → +c, c = sqrt(2/π)/sqrt(G)
    (§U b).
    """
    if bits == cact.TERNARY:
        c = F32(constants.ternary_level(group))
        return np.array([0.0, c, 0.0, -c], dtype=F32)
    if bits == cact.BINARY:
        c = F32(constants.binary_level(group))
        return np.array([-c, c], dtype=F32)
    levels = np.asarray(codebook_levels, dtype=F32)
    if levels.shape != (1 << bits,):
        raise ValueError(f"{bits}-bit CQ needs {1 << bits} levels, got {levels.shape}")
    return levels


def unpack_codes(packed: np.ndarray, bits: int, width: int) -> np.ndarray:
    """Unpack LSB-first bit fields (§5.2): rows of packed bytes [R, row_bytes] → uint8 [R, width].

    Index k occupies bits [k·b, (k+1)·b) of the row read as one little-endian bit string; a
    3-bit field may straddle two bytes (every 8 indices take 3 bytes).
    """
    field_bits = 2 if bits == cact.TERNARY else bits
    rows = packed.shape[0]
    if field_bits in (1, 2, 4):
        shifts = np.arange(0, 8, field_bits, dtype=np.uint8)
        fields = (packed[:, :, None] >> shifts) & np.uint8((1 << field_bits) - 1)
        return fields.reshape(rows, width)
    if field_bits == 3:
        triples = packed.reshape(rows, -1, 3).astype(np.uint32)
        words = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
        shifts = np.arange(0, 24, 3, dtype=np.uint32)
        return ((words[..., None] >> shifts) & 7).astype(np.uint8).reshape(rows, width)
    raise ValueError(f"unsupported CQ bit width {bits}")


@dataclass(eq=False)
class CQMatrix:
    """A CQ weight of logical shape [rows, cols], ready for §5.4 and §5.5 products.

    `packed` is the raw [rows, row_bytes] byte matrix; `codes` (uint8 [rows, in_pad]) is
    unpacked on first use and kept; `norms` is f32 [rows, num_groups]; `levels` maps a code to
    its level value.
    """

    rows: int
    cols: int
    group: int
    bits: int
    packed: np.ndarray = field(repr=False)
    norms: np.ndarray = field(repr=False)
    levels: np.ndarray = field(repr=False)
    _codes: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def from_tensor(cls, tensor: cact.Tensor, codebook_levels) -> "CQMatrix":
        """Wrap a CQ record; `codebook_levels` is `CactFile.levels(tensor.bits)` (§5.3)."""
        if tensor.dtype != cact.CQ:
            raise ValueError(f"{tensor.name} is not a CQ tensor")
        packed = np.frombuffer(tensor.codes, dtype=np.uint8).reshape(tensor.rows, tensor.row_bytes)
        norms = np.frombuffer(tensor.norms, dtype="<f2").astype(F32).reshape(tensor.rows, tensor.num_groups)
        levels = level_table(tensor.bits, tensor.group, codebook_levels)
        return cls(tensor.rows, tensor.cols, tensor.group, tensor.bits, packed, norms, levels)

    @property
    def in_pad(self) -> int:
        return self.num_groups * self.group

    @property
    def num_groups(self) -> int:
        return self.norms.shape[1]

    @property
    def codes(self) -> np.ndarray:
        """All code indices, uint8 [rows, in_pad], unpacked once."""
        if self._codes is None:
            self._codes = unpack_codes(self.packed, self.bits, self.in_pad)
        return self._codes

    def row_codes(self, row_indices: np.ndarray) -> np.ndarray:
        """Code indices of a few rows, without unpacking (or caching) the whole matrix."""
        if self._codes is not None:
            return self._codes[row_indices]
        return unpack_codes(self.packed[row_indices], self.bits, self.in_pad)


def dequantize_rows(weight: CQMatrix, row_indices, padded: bool = False) -> np.ndarray:
    """Reconstruct the given rows (§5.4): per group, u = level[code]·norm, then w = Hn·u.

    Returns f32 [len(row_indices), cols], or [.., in_pad] with `padded` (the Engram fetch keeps
    the padded width before it cuts a row to sub_dim, §0 item 4).
    """
    row_indices = np.asarray(row_indices, dtype=np.int64).reshape(-1)
    g = weight.group
    u = weight.levels[weight.row_codes(row_indices)].reshape(len(row_indices), weight.num_groups, g)
    u = u * weight.norms[row_indices][:, :, None]  # Rust scales the level by the norm first
    rows = fwht(u.reshape(len(row_indices), weight.in_pad), g)
    return rows if padded else rows[:, : weight.cols]


def dequantize(weight: CQMatrix, row_start: int = 0, rows: int | None = None) -> np.ndarray:
    """The dense f32 matrix W[row_start : row_start+rows, :cols] (§5.4). Small tensors only."""
    rows = weight.rows - row_start if rows is None else rows
    return dequantize_rows(weight, np.arange(row_start, row_start + rows))


def prepare_input(x: np.ndarray, group: int) -> np.ndarray:
    """prepare_input (§5.5.1): zero-pad each row of x [T, in] to in_pad, then the normalised
    FWHT of every G-chunk. One prepared activation serves every weight with the same input."""
    x = np.asarray(x, dtype=F32)
    in_pad = -(-x.shape[-1] // group) * group
    padded = np.zeros((*x.shape[:-1], in_pad), F32)
    padded[..., : x.shape[-1]] = x
    return fwht(padded, group)


def matmul_prepared(weight: CQMatrix, xh: np.ndarray, row_start: int = 0,
                    rows: int | None = None) -> np.ndarray:
    """y[t, o] = Σ_g norm[o, g] · Σ_m level[code(o, gG+m)] · xh[t, gG+m] (§5.5.2-4).

    xh is a prepared activation [T, in_pad]; the result is [T, rows] for output rows
    row_start … row_start+rows−1 (the band form of §5.5.3). Groups are accumulated in
    ascending order, each group decoded once for the whole batch as in §5.5.4.
    """
    rows = weight.rows - row_start if rows is None else rows
    if xh.shape[-1] != weight.in_pad:
        raise ValueError(f"prepared input has width {xh.shape[-1]}, the weight needs {weight.in_pad}")
    if not (0 <= row_start and rows >= 0 and row_start + rows <= weight.rows):
        raise ValueError(f"rows [{row_start}, {row_start + rows}) out of range for {weight.rows} rows")
    g = weight.group
    codes = weight.codes[row_start : row_start + rows]
    norms = weight.norms[row_start : row_start + rows]
    y = np.zeros((xh.shape[0], rows), F32)
    for k in range(weight.num_groups):
        unit_rows = weight.levels[codes[:, k * g : (k + 1) * g]]  # [rows, G] level values
        y += dot_rows(xh[:, k * g : (k + 1) * g], unit_rows) * norms[:, k]
    return y


def matmul(weight: CQMatrix, x: np.ndarray, row_start: int = 0, rows: int | None = None) -> np.ndarray:
    """W·x for a batch x [T, cols] (§5.5): prepare, then the prepared product."""
    return matmul_prepared(weight, prepare_input(x, weight.group), row_start, rows)
