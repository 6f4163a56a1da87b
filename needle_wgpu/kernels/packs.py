"""Row-split weight packs, shared by the CQ and the GGUF kernels.

A weight matrix larger than the device's maxStorageBufferBindingSize cannot be bound whole
(128 MiB on lavapipe and by default in browsers), so it is uploaded as several buffers of whole
rows ("parts"). A matmul dispatches once per part that holds some of the requested rows; a row
gather dispatches once per part and skips the positions whose row another part holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DeviceLimitError

# Bytes kept free under the binding limit for a part's padding (buffer sizes round up to 16).
PART_SLACK = 64


@dataclass
class RowPart:
    """One GPU buffer holding the pack rows [first, first + rows)."""

    buffer: object
    first: int
    rows: int


def split_rows(name: str, total_rows: int, row_bytes: int, limit: int, multiple: int = 1) -> list:
    """(first, rows) ranges of at most ``limit`` bytes each, every part but the last a multiple
    of ``multiple`` rows (CQ keeps parts even so that a part's FP16 norms start on a word).
    A pack that fits one binding is one part, whatever its row count (a 1-row table)."""
    if total_rows * row_bytes <= limit - PART_SLACK:
        return [(0, total_rows)]
    fit = (limit - PART_SLACK) // row_bytes // multiple * multiple
    if fit < multiple:
        raise DeviceLimitError(f"{name}: {multiple} row(s) of {row_bytes} bytes exceed the binding limit {limit}")
    per_part = min(total_rows, fit)
    return [(first, min(per_part, total_rows - first)) for first in range(0, total_rows, per_part)]


def pieces(parts: list, start: int, end: int):
    """(part, lo, hi) for every part overlapping pack rows [start, end), lo/hi clipped to it."""
    for part in parts:
        lo, hi = max(start, part.first), min(end, part.first + part.rows)
        if lo < hi:
            yield part, lo, hi

