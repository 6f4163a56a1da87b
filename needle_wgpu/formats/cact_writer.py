"""Writer for the ``.cact`` v3 container of Needle 3 (spec §8, "Writer checklist").

A container is a header, the codebook, a nameless positional directory and the blobs. This
module builds it from a list of ``Record`` s in canon order:

* ``write_cact(geometry, records, codebook)`` checks the records against the canon the reader
  expects (names, dtypes, shapes and blob sizes) and lays them out;
* ``rewrite_cact(cact_file)`` re-serialises a loaded container, copying every blob verbatim, so
  reading and writing again reproduces a well-formed file byte for byte;
* ``pack_container`` is the unchecked layout step underneath both; tests use it to build files
  a checked writer would refuse.

Layout (§8): header ``<48If`` at 0, codebook f32 at 196, directory (44 bytes a record) at
``196 + 4 * codebook_len``; every blob at the next 64-byte aligned offset, gaps zero-filled, and
the file ends exactly where the last blob ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import cact
from .cact import (BLOB_ALIGN, CQ, DTYPE_NAMES, FP16, FP32, HEAD_CODES, HEADER, RAW, RECORD, CactFile,
                   align, cq_blob_bytes, head_canon, model_canon)
from .cq_codec import LLOYD_MAX_CODEBOOK, cq_encode, levels_for
from .needle3_geometry import Needle3Geometry


@dataclass(frozen=True)
class Record:
    """One directory record and its blob, before layout. ``group``/``bits`` are CQ only."""

    name: str
    dtype: int
    shape: tuple
    blob: bytes
    group: int = 0
    bits: int = 0

    @classmethod
    def fp16(cls, name: str, values) -> "Record":
        """FP16 array, row-major, rounded to nearest even (numpy's f32 -> f16 cast)."""
        array = np.asarray(values, dtype=np.float32)
        return cls(name, FP16, array.shape, array.astype("<f2").tobytes())

    @classmethod
    def fp32(cls, name: str, values) -> "Record":
        array = np.asarray(values, dtype=np.float32)
        return cls(name, FP32, array.shape, array.astype("<f4").tobytes())

    @classmethod
    def cq(cls, name: str, matrix, bits: int, group: int = 128, codebook=LLOYD_MAX_CODEBOOK) -> "Record":
        """CQ-encode a float matrix [out, in] (§5.4) with the container's codebook."""
        matrix = np.asarray(matrix, dtype=np.float32)
        blob = cq_encode(matrix, bits, group, levels_for(bits, codebook, group))
        return cls(name, CQ, matrix.shape, blob, group, bits)

    @classmethod
    def raw(cls, name: str, blob: bytes) -> "Record":
        """The tokenizer record: opaque bytes, ndim 0 (§8)."""
        return cls(name, RAW, (), bytes(blob))

    @property
    def expected_nbytes(self) -> int:
        """Blob size the reader will demand for this dtype and shape."""
        if self.dtype == CQ:
            rows, cols = self.shape
            return cq_blob_bytes(rows, cols, self.group, self.bits)
        if self.dtype == RAW:
            return len(self.blob)
        return int(np.prod(self.shape, dtype=np.int64)) * (2 if self.dtype == FP16 else 4)


# ----------------------------------------------------------------------------------- layout


def blob_offsets(codebook_len: int, blob_sizes) -> tuple:
    """Checklist step 3: absolute offset of every blob and the total file size."""
    pos = HEADER.size + 4 * codebook_len + RECORD.size * len(blob_sizes)
    offsets = []
    for size in blob_sizes:
        pos = align(pos, BLOB_ALIGN)
        offsets.append(pos)
        pos += size
    return offsets, pos


def pack_container(header_words, codebook, records) -> bytes:
    """Lay out header, codebook, directory and blobs exactly as given, with no checks (§8)."""
    offsets, total = blob_offsets(len(codebook), [len(r.blob) for r in records])
    out = bytearray(total)  # zero-filled, so every gap is zero
    HEADER.pack_into(out, 0, *header_words)
    np_codebook = np.asarray(codebook, dtype="<f4")
    out[HEADER.size : HEADER.size + np_codebook.nbytes] = np_codebook.tobytes()
    directory_at = HEADER.size + np_codebook.nbytes
    for i, (record, offset) in enumerate(zip(records, offsets)):
        dims = tuple(record.shape) + (0,) * (4 - len(record.shape))
        RECORD.pack_into(out, directory_at + RECORD.size * i, record.dtype, len(record.shape), 0, *dims,
                         offset, len(record.blob), record.group, record.bits)
        out[offset : offset + len(record.blob)] = record.blob
    return bytes(out)


# ----------------------------------------------------------------------------------- checked writer


def canon_slots(geometry: Needle3Geometry, head_codes=()) -> list:
    """(name, dtype, shape) of every non-RAW record, in order: model canon, manifest, heads (§8, §7)."""
    slots = model_canon(geometry)
    if head_codes:
        slots.append(("heads.manifest", FP16, (len(head_codes),)))
        for h, code in enumerate(head_codes):
            slots += head_canon(geometry, code, h)
    return slots


def _check_records(geometry: Needle3Geometry, records) -> None:
    """Refuse what the reader would refuse: order, dtypes, shapes, blob sizes (checklist step 1)."""
    body = [r for r in records if r.dtype != RAW]
    raw_count = len(records) - len(body)
    if raw_count > 1 or (raw_count == 1 and records[-1].dtype != RAW):
        raise ValueError("at most one RAW record (the tokenizer), and it must come last")
    head_codes = ()
    manifest = next((r for r in body if r.name == "heads.manifest"), None)
    if manifest is not None:
        head_codes = tuple(int(c) for c in np.frombuffer(manifest.blob, dtype="<f2"))
        unknown = [c for c in head_codes if c not in HEAD_CODES]
        if unknown:
            raise ValueError(f"heads.manifest: unknown head codes {unknown}")
    slots = canon_slots(geometry, head_codes)
    if [r.name for r in body] != [name for name, _, _ in slots]:
        missing = [name for name, _, _ in slots if name not in {r.name for r in body}]
        raise ValueError(f"records are not the canon of this geometry (missing or misplaced: {missing[:5]})")
    for record, (name, dtype, shape) in zip(body, slots):
        if record.dtype != dtype:
            raise ValueError(f"{name}: dtype {DTYPE_NAMES.get(record.dtype)}, canon says {DTYPE_NAMES[dtype]}")
        if len(record.shape) != len(shape) or any(w is not None and w != g for w, g in zip(shape, record.shape)):
            raise ValueError(f"{name}: shape {list(record.shape)} disagrees with the geometry {shape}")
    for record in records:
        if len(record.blob) != record.expected_nbytes:
            raise ValueError(f"{record.name}: blob is {len(record.blob)} bytes, expected {record.expected_nbytes}")


def write_cact(geometry: Needle3Geometry, records, codebook=LLOYD_MAX_CODEBOOK) -> bytes:
    """Serialise records (canon order, optional heads, optional tokenizer last) as .cact v3 (§8).

    The result is read back with ``cact.load`` before it is returned, so a file this function
    hands out is one the reader accepts.
    """
    geometry.validate()
    records = list(records)
    _check_records(geometry, records)
    data = pack_container(geometry.header_words(len(records), len(codebook)), codebook, records)
    cact.load(data)
    return data


def records_of(cact_file: CactFile) -> list:
    """The records of a loaded container, blobs copied verbatim (§5.4 NOTE: never requantise)."""
    records = [
        Record(t.name, t.dtype, t.shape, bytes(t.data), t.group, t.bits)
        for t in sorted(cact_file.tensors.values(), key=lambda t: t.index)
    ]
    if cact_file.tokenizer is not None:
        records.append(Record.raw("tokenizer", bytes(cact_file.tokenizer)))
    return records


def rewrite_cact(cact_file: CactFile) -> bytes:
    """Re-serialise a loaded container. For a file laid out per §8 the bytes are identical."""
    return write_cact(cact_file.geometry, records_of(cact_file), cact_file.codebook)
