"""The GGML tensor types a GGUF file may name: one table (spec §4.1). Pure Python.

Each type stores ``block_size`` weights in ``type_size`` bytes; a tensor of n weights in a row
holds n / block_size blocks per row. The ids are ggml's ``enum ggml_type``. The fifteen types the
engine serves are marked ``supported``; the others are known so that a file using one is read
correctly and refused by name, and an id outside the table is a corrupt file.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ContainerError, UnsupportedModelError


@dataclass(frozen=True)
class GgmlType:
    id: int
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block
    supported: bool = False
    retired: bool = False  # removed from ggml; old files may still carry it

    def row_bytes(self, width: int) -> int:
        """Bytes of one row of ``width`` weights (a multiple of block_size)."""
        return width // self.block_size * self.type_size


def _t(id, name, block_size, type_size, supported=False, retired=False):
    return GgmlType(id, name, block_size, type_size, supported, retired)


# (block size, bytes) as in ggml's type traits. Ids 4 and 5 (Q4_2, Q4_3) were retired before GGUF
# existed, so no GGUF file can carry them: they stay unknown.
GGML_TYPES = {t.id: t for t in (
    _t(0, "F32", 1, 4, True),
    _t(1, "F16", 1, 2, True),
    _t(2, "Q4_0", 32, 18, True),
    _t(3, "Q4_1", 32, 20, True),
    _t(6, "Q5_0", 32, 22, True),
    _t(7, "Q5_1", 32, 24, True),
    _t(8, "Q8_0", 32, 34, True),
    _t(9, "Q8_1", 32, 40),
    _t(10, "Q2_K", 256, 84, True),
    _t(11, "Q3_K", 256, 110, True),
    _t(12, "Q4_K", 256, 144, True),
    _t(13, "Q5_K", 256, 176, True),
    _t(14, "Q6_K", 256, 210, True),
    _t(15, "Q8_K", 256, 292),
    _t(16, "IQ2_XXS", 256, 66),
    _t(17, "IQ2_XS", 256, 74),
    _t(18, "IQ3_XXS", 256, 98),
    _t(19, "IQ1_S", 256, 50),
    _t(20, "IQ4_NL", 32, 18, True),
    _t(21, "IQ3_S", 256, 110),
    _t(22, "IQ2_S", 256, 82),
    _t(23, "IQ4_XS", 256, 136, True),
    _t(24, "I8", 1, 1),
    _t(25, "I16", 1, 2),
    _t(26, "I32", 1, 4),
    _t(27, "I64", 1, 8),
    _t(28, "F64", 1, 8),
    _t(29, "IQ1_M", 256, 56),
    _t(30, "BF16", 1, 2, True),
    _t(31, "Q4_0_4_4", 32, 18, retired=True),
    _t(32, "Q4_0_4_8", 32, 18, retired=True),
    _t(33, "Q4_0_8_8", 32, 18, retired=True),
    _t(34, "TQ1_0", 256, 54),
    _t(35, "TQ2_0", 256, 66),
    _t(36, "IQ4_NL_4_4", 32, 18, retired=True),
    _t(37, "IQ4_NL_4_8", 32, 18, retired=True),
    _t(38, "IQ4_NL_8_8", 32, 18, retired=True),
    _t(39, "MXFP4", 32, 17),
    _t(40, "NVFP4", 64, 36),
    _t(41, "Q1_0", 128, 18),
)}

BY_NAME = {t.name: t for t in GGML_TYPES.values()}
SUPPORTED = tuple(t.name for t in GGML_TYPES.values() if t.supported)


def ggml_type(type_id: int, what: str) -> GgmlType:
    """The table entry of a type id read from a file; ``what`` names the tensor for the error."""
    try:
        return GGML_TYPES[type_id]
    except KeyError:
        raise ContainerError(f"{what}: unknown tensor type id {type_id}") from None


def require_supported(t: GgmlType, what: str) -> GgmlType:
    """``t`` itself if the engine serves it, else ``UnsupportedModelError`` naming it."""
    if not t.supported:
        note = " (retired from ggml; convert the model again)" if t.retired else ""
        raise UnsupportedModelError(
            f"{what}: tensor type {t.name}{note} is not supported (supported: {', '.join(SUPPORTED)})")
    return t
