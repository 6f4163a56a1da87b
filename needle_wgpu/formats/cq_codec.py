"""Cactus-Quants (CQ) encoding and decoding with NumPy (spec §3, §5).

The reader (``cact.py``) never dequantises; this module is the writer's side (encode a float
matrix into a CQ blob) and the reference side (decode a blob back to floats). Both work on whole
matrices at once: every row and every group is processed by the same vectorised array operations,
which is what makes synthesising the shipped geometry (about 120 M weights) take seconds.

Blob layout (§5.1): ``rows x row_bytes`` packed codes, LSB-first per row (§5.2), followed by
``rows x num_groups`` FP16 norms. Group values are stored rotated: ``w_g = Hn · (level · norm)``
(§5.4), with ``Hn`` the normalised Walsh-Hadamard matrix of §3.
"""

from __future__ import annotations

import numpy as np

from ..constants import binary_level
from .cact import BINARY, CODEBOOK_LEN, CODEBOOK_SLICES, TERNARY, Tensor, align

# §14.1: Lloyd-Max quantisers of a unit Gaussian, before the 1/sqrt(128) scale. Writers only:
# readers take the 28 levels from the file's header (§5.3).
LLOYD_MAX_UNSCALED = {
    2: (-1.5066708, -0.4514406, 0.4529475, 1.5099326),
    3: (-2.1412479, -1.3337165, -0.7483983, -0.2377402, 0.2500446, 0.7555868, 1.3379826, 2.1476363),
    4: (-2.70999, -2.0444556, -1.594757, -1.2333362, -0.922214, -0.6395374, -0.3726639, -0.1144507,
        0.1438063, 0.403989, 0.6726934, 0.9614053, 1.2755258, 1.6370588, 2.0844264, 2.7410141),
}
CODEBOOK_GROUP = 128

# Ternary levels (§5.2) before the 1/sqrt(G) scale, and the crumb that stores each level index:
# level 0 (-c) is crumb 3, level 1 (0) is crumb 0, level 2 (+c) is crumb 1.
TERNARY_UNSCALED = 1.2240064
TERNARY_CRUMB_OF_LEVEL = np.array([3, 0, 1], dtype=np.uint8)


def _scaled_codebook() -> tuple:
    """The header codebook cb2 | cb3 | cb4: each level times the f32 value of 1/sqrt(128)."""
    inv_sqrt_group = np.float32(1.0 / np.sqrt(CODEBOOK_GROUP))
    flat = np.array([x for bits in (2, 3, 4) for x in LLOYD_MAX_UNSCALED[bits]], dtype=np.float32)
    return tuple(float(x) for x in flat * inv_sqrt_group)


LLOYD_MAX_CODEBOOK = _scaled_codebook()
assert len(LLOYD_MAX_CODEBOOK) == CODEBOOK_LEN


def code_width(bits: int) -> int:
    """Bits per stored index: ternary (record bits = 5) uses 2-bit crumbs (§5.2)."""
    return 2 if bits == TERNARY else bits


def levels_for(bits: int, codebook=LLOYD_MAX_CODEBOOK, group: int = CODEBOOK_GROUP) -> np.ndarray:
    """The sorted f32 levels of one bit width (§5.3), already divided by sqrt(group).

    2/3/4-bit levels are slices of the header codebook; ternary levels are fixed (§5.2) and
    scaled by the tensor's own group.
    """
    if bits == TERNARY:
        c = np.float32(TERNARY_UNSCALED) / np.float32(np.sqrt(group))
        return np.array([-c, 0.0, c], dtype=np.float32)
    if bits == BINARY:
        c = np.float32(binary_level(group))
        return np.array([-c, c], dtype=np.float32)
    if bits not in CODEBOOK_SLICES:
        raise ValueError(f"unsupported CQ bit width {bits}")
    lo, hi = CODEBOOK_SLICES[bits]
    return np.asarray(codebook[lo:hi], dtype=np.float32)


# ----------------------------------------------------------------------------------- FWHT


def fwht(x: np.ndarray) -> np.ndarray:
    """Normalised Walsh-Hadamard transform over the last axis (§3), in f32.

    Sylvester order, butterflies for h = 1, 2, 4, ... then one multiply by f32(1/sqrt(G)), like
    the fast form of §3. Every leading axis (rows, groups) is transformed at once.
    """
    v = np.array(x, dtype=np.float32, copy=True)
    size = v.shape[-1]
    if size & (size - 1):
        raise ValueError(f"FWHT length {size} is not a power of two")
    lead = v.shape[:-1]
    h = 1
    while h < size:
        # View the vector as blocks of 2h: the first half of each block pairs with the second.
        blocks = v.reshape(*lead, size // (2 * h), 2, h)
        a, b = blocks[..., 0, :], blocks[..., 1, :]
        v = np.stack((a + b, a - b), axis=-2).reshape(*lead, size)
        h *= 2
    return v * np.float32(1.0 / np.sqrt(size))


# ----------------------------------------------------------------------------------- packing


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack level indices [rows, in_pad] into rows of bytes, LSB-first (§5.2).

    Every 8 indices of ``width`` bits form one little-endian integer of ``width`` bytes, which
    is the same bitstream as writing index k at bits [k*width, (k+1)*width).
    """
    width = code_width(bits)
    rows, in_pad = codes.shape
    eights = codes.astype(np.uint32).reshape(rows, in_pad // 8, 8)
    word = np.bitwise_or.reduce(eights << (width * np.arange(8, dtype=np.uint32)), axis=-1)
    byte_shifts = 8 * np.arange(width, dtype=np.uint32)
    packed = (word[..., None] >> byte_shifts) & 0xFF
    return packed.astype(np.uint8).reshape(rows, in_pad * width // 8)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_codes``: rows of bytes -> level indices [rows, in_pad] (uint8)."""
    width = code_width(bits)
    rows, row_bytes = packed.shape
    chunks = packed.astype(np.uint32).reshape(rows, row_bytes // width, width)
    word = np.bitwise_or.reduce(chunks << (8 * np.arange(width, dtype=np.uint32)), axis=-1)
    fields = (word[..., None] >> (width * np.arange(8, dtype=np.uint32))) & ((1 << width) - 1)
    return fields.astype(np.uint8).reshape(rows, row_bytes * 8 // width)


# ----------------------------------------------------------------------------------- encode


def nearest_level(unit: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index of the nearest level; a tie goes to the lower index (§5.4).

    Between neighbours k and k+1 the encoder moves right only when |x - l_k| > |l_(k+1) - x|.
    That test is monotone in x (f32 subtraction is), so the chosen index is simply how many
    neighbour pairs vote "right": one cheap comparison per pair instead of a search.
    """
    index = np.zeros(unit.shape, dtype=np.uint8)
    for left, right in zip(levels[:-1], levels[1:]):
        index += np.abs(unit - left) > np.abs(right - unit)
    return index


def hadamard_matrix(size: int) -> np.ndarray:
    """Hn of §3 as an f32 matrix: (-1)^popcount(m & k) / sqrt(size)."""
    return fwht(np.eye(size, dtype=np.float32))


# Rows encoded per step: bounds the temporaries to a few MB and keeps them in cache.
_ENCODE_CHUNK_ELEMENTS = 1 << 16


def cq_encode(w: np.ndarray, bits: int, group: int, levels) -> bytes:
    """Encode a float matrix [out, in] as a CQ blob (§5.4 encoder, §5.1 layout).

    Per group: ``rot = w_g @ Hn``, ``norm = ||rot||``, ``unit = rot / max(norm, 1e-12)``, the
    nearest level per element, and the norm stored as FP16 rounded to nearest even. ``levels``
    are the sorted levels of this bit width (``levels_for``). Columns past ``in`` are zero.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"CQ encodes 2-D matrices, got shape {w.shape}")
    if group <= 0 or group & (group - 1):
        raise ValueError(f"CQ group {group} is not a power of two")
    levels = np.asarray(levels, dtype=np.float32)
    if len(levels) != (3 if bits == TERNARY else 1 << bits):
        raise ValueError(f"{len(levels)} levels for a {bits}-bit CQ tensor")
    rows, cols = w.shape
    in_pad = align(cols, group)
    groups = in_pad // group
    hn = hadamard_matrix(group)
    codes = np.empty((rows, in_pad), dtype=np.uint8)
    norms = np.empty((rows, groups), dtype=np.float32)
    step = max(1, _ENCODE_CHUNK_ELEMENTS // in_pad)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        padded = np.zeros((r1 - r0, in_pad), dtype=np.float32)
        padded[:, :cols] = w[r0:r1]
        rot = padded.reshape(r1 - r0, groups, group) @ hn
        norm = np.sqrt(np.einsum("rgk,rgk->rg", rot, rot))
        unit = rot / np.maximum(norm, np.float32(1e-12))[..., None]
        codes[r0:r1] = nearest_level(unit, levels).reshape(r1 - r0, in_pad)
        norms[r0:r1] = norm
    if bits == TERNARY:
        codes = TERNARY_CRUMB_OF_LEVEL[codes]
    norms16 = norms.astype("<f2")
    if not np.isfinite(norms16).all():
        raise ValueError("a CQ group norm is not finite in FP16 (NaN, infinity or above 65504)")
    return pack_codes(codes, bits).tobytes() + norms16.tobytes()


# ----------------------------------------------------------------------------------- decode


def code_values(bits: int, levels) -> np.ndarray:
    """Value of each stored code. Ternary crumb 2 is invalid and reads as 0, as in Rust (§5.2)."""
    levels = np.asarray(levels, dtype=np.float32)
    if bits == TERNARY:
        return np.array([levels[1], levels[2], 0.0, levels[0]], dtype=np.float32)
    return levels


def cq_decode(blob, rows: int, cols: int, bits: int, group: int, levels) -> np.ndarray:
    """Dequantise a CQ blob to f32 [rows, cols] (§5.4): ``u = level * norm``, FWHT, truncate."""
    width = code_width(bits)
    in_pad = align(cols, group)
    groups = in_pad // group
    row_bytes = in_pad * width // 8
    raw = np.frombuffer(blob, dtype=np.uint8)
    want = rows * (row_bytes + 2 * groups)
    if raw.size != want:
        raise ValueError(f"CQ blob is {raw.size} bytes, [{rows}, {cols}] at {bits} bits needs {want}")
    codes = unpack_codes(raw[: rows * row_bytes].reshape(rows, row_bytes), bits)
    norms = raw[rows * row_bytes :].view("<f2").astype(np.float32).reshape(rows, groups, 1)
    u = code_values(bits, levels)[codes].reshape(rows, groups, group) * norms
    return fwht(u).reshape(rows, in_pad)[:, :cols]


def cq_decode_tensor(tensor: Tensor, codebook=LLOYD_MAX_CODEBOOK) -> np.ndarray:
    """Dequantise a CQ record of a loaded container with the file's codebook (§5.3)."""
    levels = levels_for(tensor.bits, codebook, tensor.group)
    return cq_decode(tensor.data, tensor.rows, tensor.cols, tensor.bits, tensor.group, levels)
