"""GGUF metadata and dequantised tensors for the NumPy dense reference (spec dense-gguf.md §1, §2, §4.1).

Read with PyPI `gguf` (`GGUFReader`, `gguf.quants.dequantize`), deliberately independent of the
project's own pure-Python reader (`formats/gguf.py`), so the two check each other.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize


class QuickArrayReader(GGUFReader):
    """`GGUFReader` that reads a metadata array in one step instead of one item at a time.

    The stock reader builds a few NumPy views per array item: Gemma 3's three 262,144-item
    tokenizer arrays take it 10-30 s. Here a scalar array is one view (`contents()` flattens
    the parts, so it returns the same list) and a string array one view per string, found by
    scanning the lengths with `struct`. Same fields and values; nested arrays, empty arrays and
    byte-swapped files take the stock path.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count, offs, item = int(alen[0]), orig_offs + 12, int(raw_itype[0])
        if count == 0 or item not in {t.value for t in self.gguf_scalar_to_np} | {GGUFValueType.STRING.value}:
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY, GGUFValueType(item)]
        nptype = self.gguf_scalar_to_np.get(GGUFValueType(item))
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
        view, parts = memoryview(self.data), [raw_itype, alen]
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", view, offs)
            parts.append(self.data[offs + 8: offs + 8 + length])
            offs += 8 + length
        return offs - orig_offs, parts, list(range(2, len(parts))), types


class GgufWeights:
    """One GGUF file: metadata values, tensor shapes and dequantised f32 tensors.

    Matrices come back row-major [out][in] (§2: ggml's ne[0] is the input axis), so
    y = W @ x. Full tensors are dequantised once and cached; `rows` dequantises only the rows
    it is asked for (an embedding lookup needs a few rows of a large table).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = QuickArrayReader(str(self.path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._cache: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ metadata (§1)
    def value(self, key: str, default=None):
        """A metadata value as a Python scalar, string or list; `default` when absent."""
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """NumPy shape, slowest axis first: a matrix is (out, in)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def qtype(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    # ------------------------------------------------------------------ tensors (§4.1)
    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor dequantised to f32, in `shape(name)`."""
        if name not in self._cache:
            t = self.tensors[name]
            data = dequantize(t.data, t.tensor_type)
            self._cache[name] = np.ascontiguousarray(data, dtype=np.float32).reshape(self.shape(name))
        return self._cache[name]

    def optional(self, name: str) -> np.ndarray | None:
        return self.tensor(name) if self.has(name) else None

    def rows(self, name: str, ids) -> np.ndarray:
        """Rows `ids` of a 2-D tensor, dequantised to f32 without touching the others."""
        if name in self._cache:
            return self._cache[name][np.asarray(ids, dtype=np.int64)]
        t = self.tensors[name]
        raw = t.data[np.asarray(ids, dtype=np.int64)]  # one row of blocks per tensor row
        data = dequantize(raw, t.tensor_type)
        return np.ascontiguousarray(data, dtype=np.float32).reshape(len(ids), self.shape(name)[1])
