"""Reader for GGUF v2/v3 model files (llama.cpp's container). Pure Python: no numpy.

Layout (little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 metadata count; the
metadata entries (string key, u32 value type, value); the tensor infos (string name, u32 n_dims,
n_dims x u64 ne, u32 type, u64 offset); padding to ``general.alignment`` (default 32); the data
section, where each offset counts from (spec §2). Strings are a u64 byte length and UTF-8 bytes;
an array is a u32 element type, a u64 count and the elements (arrays may nest).

Everything is validated before anything is handed out, as for ``.cact``: every count and length
is checked against the bytes that remain before anything is allocated for it, so parsing takes
time and memory linear in the file size whatever the file claims. Tensors and numeric metadata
arrays are zero-copy views of the file. Problems raise ``ContainerError`` naming the key or the
tensor (``UnsupportedModelError`` for a well-formed file this reader does not handle: GGUF v1,
big-endian files).
"""

from __future__ import annotations

import codecs
import struct
import sys
from dataclasses import dataclass, field

from ..errors import ContainerError, UnsupportedModelError
from .gguf_types import GgmlType, ggml_type
from .source import read_source

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # nested arrays deeper than this are refused (no file needs more than 2)
MAX_DIM = (1 << 63) - 1  # ne is int64 in ggml
FIRST_READ = 1 << 20  # the first read of a file: its header and usually all its metadata

# Metadata value types (GGUF spec) and the struct code of each fixed-size one.
(UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64,
 FLOAT64) = range(13)
VALUE_TYPE_NAMES = ("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array",
                    "u64", "i64", "f64")
_CODES = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f",
          BOOL: "B", UINT64: "Q", INT64: "q", FLOAT64: "d"}
_SCALARS = {vtype: struct.Struct("<" + code) for vtype, code in _CODES.items()}
INT_TYPES = frozenset((UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64))
FLOAT_TYPES = frozenset((FLOAT32, FLOAT64))
# The fewest bytes one array element of each type takes: bounds a count before anything is read.
_MIN_ITEM_BYTES = {**{vtype: s.size for vtype, s in _SCALARS.items()}, STRING: 8, ARRAY: 12}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_LITTLE_HOST = sys.byteorder == "little"
REQUIRED = object()  # the default of the typed getters: the key must be present


def type_name(vtype: int) -> str:
    return VALUE_TYPE_NAMES[vtype] if 0 <= vtype < len(VALUE_TYPE_NAMES) else f"type {vtype}"


def _fail(what: str, problem: str):
    raise ContainerError(f"{what}: {problem}")


@dataclass(frozen=True, slots=True)
class GgufField:
    """One metadata entry. ``value``: int, float, bool or str for scalars; for arrays a tuple
    (strings, nested arrays, numbers inside a nested array) or, for a top-level array of numbers
    or bools, a read-only memoryview of the file already cast to the element type (index it,
    iterate it or call ``.tolist()``). ``item_type`` is the element type of an array, else None."""

    key: str
    type: int
    value: object = field(repr=False)
    item_type: int | None = None


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor info with its bytes. ``ne`` is in ggml order: ne[0] is the fastest (input) axis,
    so a matrix is ``ne[1]`` rows of ``ne[0]`` weights (spec §2)."""

    name: str
    ne: tuple
    type: GgmlType
    offset: int  # from the start of the data section, as stored
    nbytes: int
    data: memoryview = field(repr=False, compare=False)

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.ne:
            count *= dim
        return count

    @property
    def row_width(self) -> int:
        return self.ne[0] if self.ne else 1

    @property
    def rows(self) -> int:
        return self.n_elements // self.row_width if self.row_width else 0


class _NeedMore(Exception):
    """The bytes read so far end before what is being parsed (the file itself has them)."""


class _Cursor:
    """A read position in the file; every read is bounds-checked and names what it reads.

    ``data`` may be the first part of a file of ``size`` bytes (``read_source`` reads a file
    in rounds): a read past the file's end is a ContainerError, a read past ``data`` alone
    raises ``_NeedMore``.
    """

    __slots__ = ("data", "at", "size")

    def __init__(self, data: memoryview, at: int = 0, size: int | None = None):
        self.data, self.at = data, at
        self.size = len(data) if size is None else size

    def take(self, size: int, what: str) -> int:
        start = self.at
        if size > self.size - start:
            _fail(what, f"truncated: {size} bytes needed at offset {start}, the file has {self.size}")
        if size > len(self.data) - start:
            raise _NeedMore
        self.at = start + size
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.data, self.take(8, what))[0]

    def string(self, what: str) -> str:
        size = self.u64(what)
        start = self.take(size, f"{what} (string of {size} bytes)")
        return _decode(self.data[start : start + size], what)

    def remaining(self) -> int:
        return self.size - self.at


def _decode(raw: memoryview, what: str) -> str:
    try:
        return codecs.utf_8_decode(raw, None, True)[0]
    except UnicodeDecodeError as exc:
        raise ContainerError(f"{what}: invalid UTF-8 at byte {exc.start}") from None


# ----------------------------------------------------------------------------------- values


def _read_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> tuple:
    """(value, item_type) of one metadata value of type ``vtype``."""
    scalar = _SCALARS.get(vtype)
    if scalar is not None:
        (value,) = scalar.unpack_from(cur.data, cur.take(scalar.size, what))
        if vtype == BOOL:
            if value > 1:
                _fail(what, f"bool byte is {value} (must be 0 or 1)")
            value = bool(value)
        return value, None
    if vtype == STRING:
        return cur.string(what), None
    if vtype != ARRAY:
        _fail(what, f"unknown value type {vtype}")
    if depth >= MAX_ARRAY_DEPTH:
        _fail(what, f"arrays nested deeper than {MAX_ARRAY_DEPTH}")
    item_type = cur.u32(what)
    count = cur.u64(what)
    if item_type not in _MIN_ITEM_BYTES:
        _fail(what, f"array of unknown value type {item_type}")
    if count > cur.remaining() // _MIN_ITEM_BYTES[item_type]:
        _fail(what, f"array of {count} {type_name(item_type)} cannot fit in the {cur.remaining()} bytes left")
    if item_type == STRING:
        return _read_strings(cur, count, what), item_type
    if item_type == ARRAY:
        items = [None] * count  # count <= remaining / 12: bounded by the file
        for i in range(count):
            items[i] = _read_value(cur, ARRAY, f"{what}[{i}]", depth + 1)[0]
        return tuple(items), item_type
    return _read_numbers(cur, item_type, count, what, depth == 0), item_type


def _read_numbers(cur: _Cursor, item_type: int, count: int, what: str, as_view: bool):
    """A view of a top-level array (a tokenizer's 262k scores cost nothing); a tuple inside a
    nested array, where a view object per tiny array would cost ~200 bytes each."""
    size = _SCALARS[item_type].size * count
    start = cur.take(size, what)
    raw = cur.data[start : start + size]
    if item_type == BOOL and raw.tobytes().translate(None, b"\x00\x01"):
        _fail(what, "bool array holds a byte other than 0 or 1")
    code = "?" if item_type == BOOL else _CODES[item_type]
    if as_view and _LITTLE_HOST:  # a cast view reads unaligned items safely (memcpy), in host order
        return raw.toreadonly().cast(code)
    values = struct.unpack(f"<{count}{code}", raw)
    return memoryview(struct.pack(f"={count}{code}", *values)).cast(code) if as_view else values


def _read_strings(cur: _Cursor, count: int, what: str) -> tuple:
    """A string array: the one hot loop of the reader (a tokenizer holds 49k-262k of them)."""
    data, at, end, total = cur.data, cur.at, len(cur.data), cur.size
    items = [None] * count  # count <= remaining / 8: bounded by the file
    unpack, decode = _U64.unpack_from, codecs.utf_8_decode
    i = 0
    try:
        for i in range(count):
            (size,) = unpack(data, at)
            at += 8
            if size > end - at:
                if size > total - at:
                    _fail(f"{what}[{i}]", f"string of {size} bytes runs past the end of the file ({total} bytes)")
                raise _NeedMore
            items[i] = decode(data[at : at + size], None, True)[0]
            at += size
    except struct.error:
        if at + 8 <= total:
            raise _NeedMore from None
        _fail(f"{what}[{i}]", f"truncated: the string length at offset {at} runs past the end ({total} bytes)")
    except UnicodeDecodeError as exc:
        _fail(f"{what}[{i}]", f"invalid UTF-8 at byte {exc.start}")
    cur.at = at
    return tuple(items)


# ----------------------------------------------------------------------------------- the file


@dataclass(frozen=True)
class GgufFile:
    """A validated GGUF file: metadata fields and tensors in file order."""

    version: int
    alignment: int
    data_start: int  # absolute offset of the data section
    fields: dict  # key -> GgufField
    tensors: dict  # name -> GgufTensor
    file_size: int

    def __getitem__(self, name: str) -> GgufTensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def metadata(self) -> dict:
        """Every metadata key with a plain Python value (number arrays as lists)."""
        return {key: entry.value.tolist() if isinstance(entry.value, memoryview) else entry.value
                for key, entry in self.fields.items()}

    def get(self, key: str, default=None):
        entry = self.fields.get(key)
        return default if entry is None else entry.value

    def get_int(self, key: str, default=REQUIRED) -> int:
        return self._typed(key, INT_TYPES, "an integer", default)

    def get_float(self, key: str, default=REQUIRED) -> float:
        value = self._typed(key, FLOAT_TYPES | INT_TYPES, "a number", default)
        return value if value is default else float(value)

    def get_str(self, key: str, default=REQUIRED) -> str:
        return self._typed(key, (STRING,), "a string", default)

    def get_bool(self, key: str, default=REQUIRED) -> bool:
        return self._typed(key, (BOOL,), "a bool", default)

    def _typed(self, key, types, wanted, default):
        """The value of a scalar key of one of ``types``; ContainerError naming the key if it is
        missing (and required) or of another type."""
        entry = self.fields.get(key)
        if entry is None:
            if default is REQUIRED:
                _fail(f"metadata key {key!r}", "missing")
            return default
        if entry.type not in types:
            shown = type_name(entry.type) if entry.item_type is None else f"array of {type_name(entry.item_type)}"
            _fail(f"metadata key {key!r}", f"is {shown}, expected {wanted}")
        return entry.value

    @classmethod
    def parse(cls, data: memoryview) -> "GgufFile":
        version, fields, infos, alignment, data_start = _read_layout(data, len(data))
        tensors = _make_tensors(data, infos, alignment, data_start)
        return cls(version, alignment, data_start, fields, tensors, len(data))


def _read_layout(data: memoryview, size: int) -> tuple:
    """Header, metadata and tensor infos from the first bytes of a file of ``size`` bytes;
    ``_NeedMore`` when they run past ``data``."""
    cur = _Cursor(data, size=size)
    version = _read_header(cur)
    tensor_count, kv_count = cur.u64("header: tensor count"), cur.u64("header: metadata count")
    # The smallest entry is 13 bytes (empty key, type, u8), the smallest tensor info 24.
    if kv_count > cur.remaining() // 13:
        _fail("header", f"metadata count {kv_count} cannot fit in the {cur.remaining()} bytes left")
    if tensor_count > (cur.remaining() - 13 * kv_count) // 24:
        _fail("header", f"tensor count {tensor_count} cannot fit in the file ({size} bytes)")
    fields = _read_fields(cur, kv_count)
    infos = _read_tensor_infos(cur, tensor_count)
    alignment = _alignment(fields)
    data_start = (cur.at + alignment - 1) // alignment * alignment
    return version, fields, infos, alignment, data_start


def _read_header(cur: _Cursor) -> int:
    data = cur.data
    if len(data) < 8:
        _fail("header", f"file is {len(data)} bytes, too short for a GGUF header")
    if data[:4] != MAGIC:
        _fail("header", f"wrong magic {bytes(data[:4])!r} (expected b'GGUF')")
    cur.at = 4
    version = cur.u32("header: version")
    if version == 1:
        raise UnsupportedModelError("header: GGUF v1 is not supported (only v2 and v3); convert the model again")
    if version not in VERSIONS:
        if struct.unpack(">I", _U32.pack(version))[0] in VERSIONS:
            raise UnsupportedModelError("header: a big-endian GGUF file; only little-endian files are supported")
        _fail("header", f"unknown GGUF version {version} (this reader knows 2 and 3)")
    return version


def _read_fields(cur: _Cursor, count: int) -> dict:
    fields = {}
    for i in range(count):
        key = cur.string(f"metadata entry {i}: key")
        what = f"metadata key {key!r}"
        if key in fields:
            _fail(what, "appears twice")
        vtype = cur.u32(what)
        value, item_type = _read_value(cur, vtype, what)
        fields[key] = GgufField(key, vtype, value, item_type)
    return fields


def _read_tensor_infos(cur: _Cursor, count: int) -> list:
    infos, names = [], set()
    for i in range(count):
        name = cur.string(f"tensor info {i}: name")
        what = f"tensor {name!r}"
        if name in names:
            _fail(what, "appears twice")
        names.add(name)
        n_dims = cur.u32(what)
        if n_dims > MAX_DIMS:
            _fail(what, f"n_dims {n_dims} > {MAX_DIMS}")
        ne = struct.unpack_from(f"<{n_dims}Q", cur.data, cur.take(8 * n_dims, what))
        if any(dim > MAX_DIM for dim in ne):
            _fail(what, f"absurd dimension in ne {list(ne)}")
        gtype = ggml_type(cur.u32(what), what)
        offset = cur.u64(what)
        infos.append((name, ne, gtype, offset))
    return infos


def _alignment(fields: dict) -> int:
    entry = fields.get("general.alignment")
    if entry is None:
        return DEFAULT_ALIGNMENT
    what = "metadata key 'general.alignment'"
    if entry.type != UINT32:
        _fail(what, f"is {type_name(entry.type)}, expected u32")
    if entry.value == 0 or entry.value & (entry.value - 1):
        _fail(what, f"{entry.value} is not a power of two")
    return entry.value


def _make_tensors(data: memoryview, infos: list, alignment: int, data_start: int) -> dict:
    tensors, size = {}, len(data)
    for name, ne, gtype, offset in infos:
        what = f"tensor {name!r}"
        width = ne[0] if ne else 1
        if width % gtype.block_size:
            _fail(what, f"row width {width} is not a multiple of the {gtype.name} block size {gtype.block_size}")
        count = 1
        for dim in ne:
            count *= dim
        nbytes = count // gtype.block_size * gtype.type_size
        if offset % alignment:
            _fail(what, f"offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start > size or nbytes > size - start:
            _fail(what, f"bytes [{start}, {start + nbytes}) run past the end of the file ({size} bytes)")
        view = data[start : start + nbytes]
        tensors[name] = GgufTensor(name, tuple(ne), gtype, offset, nbytes, view)
    # Sorted by offset, then file order: of two tensors at one offset the later one is named.
    spans = sorted((t.offset, i, t.offset + t.nbytes, t.name) for i, t in enumerate(tensors.values()) if t.nbytes)
    for (a0, _, a1, a), (b0, _, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            _fail(f"tensor {b!r}", f"bytes [{b0}, {b1}) of the data section overlap tensor {a!r} [{a0}, {a1})")
    return tensors


def open_gguf(source) -> GgufFile:
    """Validate and open a GGUF file from a path, bytes, bytearray or memoryview.

    A file is read only as far as its own header says it extends (``formats.source``): a FIFO
    or device is refused, a huge file costs its metadata plus its tensors.
    """
    return GgufFile.parse(read_source(source, _bytes_needed, first=FIRST_READ))


def _bytes_needed(view: memoryview, size: int) -> int:
    """How many bytes the file takes: the end of its last tensor (read_source's ``needed``)."""
    try:
        _, _, infos, _, data_start = _read_layout(view, size)
    except _NeedMore:
        return min(size, 2 * len(view))
    end = data_start
    for _, ne, gtype, offset in infos:
        count = 1
        for dim in ne:
            count *= dim
        end = max(end, data_start + offset + count // gtype.block_size * gtype.type_size)
    return end
