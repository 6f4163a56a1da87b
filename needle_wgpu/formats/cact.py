"""Reader for the ``.cact`` v3 container of Needle 3 (spec §8). Pure Python: no numpy.

The reader validates everything before handing out data and never dequantises: blobs are
zero-copy ``memoryview`` slices of the file bytes. Every problem raises ``ContainerError`` (or
``UnsupportedModelError``) naming the record and the problem; nothing is allocated in
proportion to a number read from the file, only to the file's own size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ..errors import ContainerError, UnsupportedModelError
from ..inputs import checked
from .needle3_geometry import Needle3Geometry
from .source import read_source

TAG_V3 = 0x05E12A84
TAG_V2 = 0x05E12A83
HEADER = struct.Struct("<48If")
RECORD = struct.Struct("<BBHIIIIQQII")
CODEBOOK_LEN = 28
BLOB_ALIGN = 64

FP16, FP32, CQ, RAW = 1, 2, 3, 4
DTYPE_NAMES = {FP16: "FP16", FP32: "FP32", CQ: "CQ", RAW: "RAW"}
BINARY, TERNARY = 1, 5
CQ_BITS = (BINARY, 2, 3, 4, TERNARY)  # every record has its own width (§U b)
CODEBOOK_SLICES = {2: (0, 4), 3: (4, 12), 4: (12, 28)}

# Head manifest codes (§7) and how many tensors follow each.
HEAD_CODES = {1: "embedding", 2: "confidence", 3: "router"}
HEAD_TENSORS = ("probes", "gain", "query", "row_bias", "proj", "bias")
EMBEDDING_HEAD, CONFIDENCE_HEAD, ROUTER_HEAD = 1, 2, 3
# Output rows of each head's proj (§U a): the embedding head's is embedding_dim, any width.
HEAD_OUT = {CONFIDENCE_HEAD: 1, ROUTER_HEAD: 3}

# Sanity ceilings: generous for any model this engine targets, small enough that arithmetic on
# them stays cheap and no claim in a header can ask for billions of anything.
MAX_DIM = 1 << 24
MAX_LAYERS = 64
MAX_TENSORS = 1 << 16


def align(value: int, to: int = BLOB_ALIGN) -> int:
    return (value + to - 1) // to * to


def cq_row_bytes(in_features: int, group: int, bits: int) -> int:
    """Bytes of packed codes per row (§5.1); ternary codes are 2-bit crumbs."""
    in_pad = align(in_features, group)
    return in_pad * (2 if bits == TERNARY else bits) // 8


def cq_blob_bytes(out_features: int, in_features: int, group: int, bits: int) -> int:
    """Packed codes followed by one FP16 norm per (row, group) (§5.1)."""
    groups = align(in_features, group) // group
    return out_features * (cq_row_bytes(in_features, group, bits) + 2 * groups)


@dataclass(frozen=True)
class Tensor:
    """One directory record with its blob (a zero-copy view of the file)."""

    index: int
    name: str
    dtype: int
    shape: tuple
    offset: int
    nbytes: int
    group: int
    bits: int
    data: memoryview = field(repr=False, compare=False)

    @property
    def is_cq(self) -> bool:
        return self.dtype == CQ

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def in_pad(self) -> int:
        return align(self.cols, self.group)

    @property
    def num_groups(self) -> int:
        return self.in_pad // self.group

    @property
    def row_bytes(self) -> int:
        return cq_row_bytes(self.cols, self.group, self.bits)

    @property
    def codes(self) -> memoryview:
        """CQ packed codes, rows x row_bytes (§5.2)."""
        return self.data[: self.rows * self.row_bytes]

    @property
    def norms(self) -> memoryview:
        """CQ per-(row, group) FP16 norms, little-endian (§5.1)."""
        return self.data[self.rows * self.row_bytes :]

    @property
    def size(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class CactFile:
    """A validated Needle 3 container: geometry, codebook and named tensors."""

    geometry: Needle3Geometry
    codebook: tuple
    tensors: dict
    head_codes: tuple
    tokenizer: memoryview | None
    file_size: int
    # (tensor name, how many of its FP16 values are NaN or ±inf): FP16 tensors and CQ norms.
    nonfinite: tuple = ()

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def levels(self, bits: int) -> tuple:
        """The codebook levels of one bit width (§5.3), already divided by sqrt(G).

        Ternary and 1-bit records have no header levels: theirs are ±1.2240064/sqrt(G) (§5.2)
        and ±sqrt(2/π)/sqrt(G) (§U b), derived from the group by the code that decodes them, so
        this returns ().
        """
        if bits in (TERNARY, BINARY):
            return ()
        lo, hi = CODEBOOK_SLICES[bits]
        return self.codebook[lo:hi]

    def layer(self, i: int, name: str) -> Tensor:
        return self.tensors[f"layers.{i}.{name}"]

    @property
    def warnings(self) -> list:
        """What is wrong with a file that still loads: non-finite weights (empty when none)."""
        if not self.nonfinite:
            return []
        total = sum(count for _, count in self.nonfinite)
        named = ", ".join(f"{name} ({count})" for name, count in self.nonfinite[:8])
        more = f" and {len(self.nonfinite) - 8} more tensors" if len(self.nonfinite) > 8 else ""
        return [f"weights: {total} NaN or infinite FP16 values in {named}{more}"]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.dtype != RAW)


# ----------------------------------------------------------------------------------- canon


def layer_canon(g: Needle3Geometry) -> list:
    """(name, dtype, shape) of one layer's records in canon order (§8); None = not checked."""
    d, taps = g.d_model, g.qkv_conv_taps
    ba, bb = g.kron_a, g.kron_b
    out = [
        ("norm_in", FP16, (d,)),
        ("q_proj", CQ, (g.q_dim, d)),
        ("k_proj", CQ, (g.k_dim, d)),
        ("v_proj", CQ, (g.v_dim, d)),
    ]
    if taps:
        out += [
            ("q_taps", FP16, (taps, g.q_dim)),
            ("k_taps", FP16, (taps, g.k_dim)),
            ("v_taps", FP16, (taps, g.v_dim)),
        ]
    out += [
        ("q_norm", FP16, (g.qk_head_dim,)),
        ("k_norm", FP16, (g.qk_head_dim,)),
        ("gate_proj", CQ, (g.attn_out, d)),
        ("out_proj", CQ, (d, g.attn_out)),
        ("post_norm", FP16, (d,)),
        ("attn_gate", FP16, (1,)),
        ("pre_hada", FP16, (d,)),
    ]
    out += [(name, FP16, (g.hada_n,)) for name in ("d1", "d2", "b2", "d3", "d4")]
    for stage in (1, 2, 3):
        out += [(f"w{stage}a", FP16, (ba, ba)), (f"w{stage}b", FP16, (bb, bb))]
    # The cond rank is read from cond_v's shape (§0 item 3): only d is fixed here.
    out += [("cond_v", FP16, (d, None)), ("cond_u", FP16, (None, g.hada_n))]
    return out


def model_canon(g: Needle3Geometry) -> list:
    """(name, dtype, shape) of every record through final_norm, in canon order (§8)."""
    L, n, d = g.num_layers, g.mhc_lanes, g.d_model
    out = [("embedding", CQ, (g.vocab, d))]
    for i in range(L):
        out += [(f"layers.{i}.{name}", dt, shape) for name, dt, shape in layer_canon(g)]
    out += [
        ("mhc.a_pre", FP16, (L,)),
        ("mhc.a_post", FP16, (L,)),
        ("mhc.a_res", FP16, (L,)),
        ("mhc.b_pre", FP16, (L, n)),
        ("mhc.b_post", FP16, (L, n)),
        ("mhc.b_res", FP16, (L, n, n)),
        ("mhc.phi_pre", CQ, (L * n, n * d)),
        ("mhc.phi_post", CQ, (L * n, n * d)),
        ("mhc.phi_res", CQ, (L * n * n, n * d)),
        ("hada.p1", FP32, (g.hada_n,)),
        ("hada.p2", FP32, (g.hada_n,)),
    ]
    rows = g.num_engram_tables * g.engram_slots
    width = g.num_engram_tables * g.engram_sub_dim
    for s in range(len(g.engram_sites)):
        out += [
            (f"engram.{s}.tables", CQ, (rows, g.engram_sub_dim)),
            (f"engram.{s}.key_proj", CQ, (d, width)),
            (f"engram.{s}.value_proj", CQ, (d, width)),
            (f"engram.{s}.taps", FP16, (g.engram_conv_taps, d)),
        ]
    out.append(("final_norm", FP16, (d,)))
    return out


def head_canon(g: Needle3Geometry, code: int, h: int) -> list:
    """(name, dtype, shape) of one probe head's records (§7)."""
    cells, d, n = g.num_layers + 1, g.d_model, g.mhc_lanes
    prefix = f"heads.{h}."
    out = [
        (prefix + "probes", CQ, (None, d)),
        (prefix + "gain", FP16, (cells, None)),
        (prefix + "query", CQ, (None, d)),
        (prefix + "row_bias", FP16, (None, cells, None)),
        (prefix + "proj", CQ, (HEAD_OUT.get(code), None)),
        (prefix + "bias", FP16, (HEAD_OUT.get(code),)),
    ]
    if code == ROUTER_HEAD:
        out.append((prefix + "calibration", FP16, (3,)))
    del n
    return out


# ----------------------------------------------------------------------------------- reading


def _fail(what: str, problem: str):
    raise ContainerError(f"{what}: {problem}")


def read_header(data: memoryview) -> tuple:
    if len(data) < 4:
        _fail("header", f"file is {len(data)} bytes, too short for a tag")
    (tag,) = struct.unpack_from("<I", data, 0)
    if tag == TAG_V2:
        raise UnsupportedModelError("header: this is a .cact v2 container; only v3 is supported")
    if tag != TAG_V3:
        _fail("header", f"wrong tag 0x{tag:08X} (expected 0x{TAG_V3:08X}, .cact v3)")
    if len(data) < HEADER.size:
        _fail("header", f"truncated: file is {len(data)} bytes, header needs {HEADER.size}")
    return HEADER.unpack_from(data, 0)


@checked
def load(source) -> CactFile:
    """Validate and open a container from a path, bytes, bytearray or memoryview.

    A file is read in three steps, each checked before the next (``source.read_source``): the
    header and codebook, then the directory, then the blobs up to the end of the last one.
    """
    return parse(read_source(source, bytes_needed, first=HEADER.size + 4 * CODEBOOK_LEN))


def _directory_span(words) -> tuple:
    """(directory_at, blobs_at) from the header's counts, after checking them."""
    num_tensors, codebook_len = words[1], words[2]
    if codebook_len != CODEBOOK_LEN:
        _fail("header", f"codebook_len {codebook_len} (expected {CODEBOOK_LEN})")
    if not 0 < num_tensors <= MAX_TENSORS:
        _fail("header", f"num_tensors {num_tensors} is out of range")
    directory_at = HEADER.size + 4 * codebook_len
    return directory_at, directory_at + RECORD.size * num_tensors


def bytes_needed(data: memoryview, size: int) -> int:
    """How many bytes of a ``size``-byte file the container takes, judged from ``data``, its
    first bytes: the header and codebook, then the directory (every record checked against the
    file's size, blobs packed as §8 lays them out), then the end of the last blob."""
    words = read_header(data)
    directory_at, blobs_at = _directory_span(words)
    if len(data) < blobs_at:
        return blobs_at
    geometry = Needle3Geometry.from_header(words)
    records = [_read_record(data, directory_at, i, blobs_at, size) for i in range(words[1])]
    _check_record_counts(geometry, records)
    _check_no_overlap(records)
    return _blobs_end(records, blobs_at)


def parse(data: memoryview) -> CactFile:
    words = read_header(data)
    geometry = Needle3Geometry.from_header(words)
    num_tensors = words[1]
    directory_at, blobs_at = _directory_span(words)
    if len(data) < blobs_at:
        _fail("directory", f"truncated: {num_tensors} records need {blobs_at} bytes, file has {len(data)}")
    codebook = struct.unpack_from(f"<{CODEBOOK_LEN}f", data, HEADER.size)
    _check_codebook(codebook)

    records = [_read_record(data, directory_at, i, blobs_at, len(data)) for i in range(num_tensors)]
    canon, raw, body = _check_record_counts(geometry, records)
    _check_no_overlap(records)

    tensors = {}
    for i, (name, dtype, shape) in enumerate(canon):
        tensors[name] = _make_tensor(data, i, name, body[i], dtype, shape)
    head_codes = _read_heads(data, geometry, body, len(canon), tensors)
    _check_cross_shapes(geometry, tensors)
    tokenizer = None
    if raw:
        r = raw[0]
        tokenizer = data[r[3] : r[3] + r[4]]
    return CactFile(geometry, codebook, tensors, head_codes, tokenizer, len(data), nonfinite_tensors(tensors))


# An FP16 value is NaN or ±inf when its five exponent bits are all ones: bits 2-6 of its high byte.
_FINITE_HIGH_BYTES = bytes(b for b in range(256) if b & 0x7C != 0x7C)


def count_nonfinite_halves(data: memoryview) -> int:
    """NaN and ±inf among little-endian FP16 values: one C-level pass over the high bytes."""
    return len(bytes(data[1::2]).translate(None, _FINITE_HIGH_BYTES))


def nonfinite_tensors(tensors: dict) -> tuple:
    """(name, count) of every tensor with non-finite FP16 values (its values, or its CQ norms).

    CQ codes index the codebook (checked finite) and FP32 records are permutations (checked
    when uploaded), so these are the only places a non-finite weight can hide. Linear time.
    """
    out = []
    for name, t in tensors.items():
        halves = t.norms if t.dtype == CQ else t.data if t.dtype == FP16 else None
        if halves is not None:
            count = count_nonfinite_halves(halves)
            if count:
                out.append((name, count))
    return tuple(out)


def _check_record_counts(geometry, records) -> tuple:
    """(canon, RAW records, body records): one tokenizer at most, last; enough tensor records."""
    canon = model_canon(geometry)
    raw = [r for r in records if r[0] == RAW]
    if len(raw) > 1:
        _fail("directory", f"{len(raw)} RAW records (at most one tokenizer is allowed)")
    if raw and records[-1][0] != RAW:
        _fail("directory", "the RAW tokenizer record must be the last record")
    body = records[: len(records) - len(raw)]
    if len(body) < len(canon):
        _fail("directory", f"{len(body)} tensor records, the geometry needs at least {len(canon)}")
    return canon, raw, body


def _check_codebook(codebook):
    for bits, (lo, hi) in CODEBOOK_SLICES.items():
        levels = codebook[lo:hi]
        if not all(x == x and abs(x) < 1e3 for x in levels):
            _fail("codebook", f"{bits}-bit levels are not finite")
        if any(b < a for a, b in zip(levels, levels[1:])):
            _fail("codebook", f"{bits}-bit levels are not sorted ascending")


def _read_record(data, directory_at, i, blobs_at, size):
    r = RECORD.unpack_from(data, directory_at + RECORD.size * i)
    dtype, ndim, pad, s0, s1, s2, s3, offset, nbytes, group, bits = r
    what = f"record {i}"
    if dtype not in DTYPE_NAMES:
        _fail(what, f"unknown dtype {dtype}")
    if ndim > 4:
        _fail(what, f"ndim {ndim} > 4")
    if pad != 0:
        _fail(what, f"padding field is {pad}, expected 0")
    dims = (s0, s1, s2, s3)
    if any(dims[k] for k in range(ndim, 4)):
        _fail(what, f"unused dimensions past ndim {ndim} are not zero: {dims}")
    if any(dim > MAX_DIM for dim in dims):
        _fail(what, f"absurd dimension in shape {dims[:ndim]} (limit {MAX_DIM})")
    if offset < blobs_at or offset % BLOB_ALIGN:
        _fail(what, f"blob offset {offset} is inside the header/directory or not 64-byte aligned")
    if offset > size or nbytes > size - offset:
        _fail(what, f"blob [{offset}, {offset + nbytes}) runs past the end of the file ({size} bytes)")
    if dtype == CQ:
        if ndim != 2:
            _fail(what, f"CQ tensor with ndim {ndim} (must be 2)")
        if group == 0 or group % 8 or group & (group - 1) or group > 4096:
            _fail(what, f"CQ group {group} is not a power of two in [8, 4096]")
        if bits not in CQ_BITS:
            _fail(what, f"unsupported CQ bit width {bits}")
        want = cq_blob_bytes(s0, s1, group, bits)
    else:
        if group or bits:
            _fail(what, f"group/bits set ({group}/{bits}) on a non-CQ record")
        size = 1
        for k in range(ndim):
            size *= dims[k]
        want = {FP16: 2 * size, FP32: 4 * size}.get(dtype, nbytes)
        if dtype == RAW and ndim != 0:
            _fail(what, f"RAW record with ndim {ndim} (must be 0)")
    if nbytes != want:
        _fail(what, f"{DTYPE_NAMES[dtype]} blob is {nbytes} bytes, its shape needs {want}")
    return dtype, ndim, dims[:ndim], offset, nbytes, group, bits


def _check_no_overlap(records):
    spans = sorted((r[3], r[3] + r[4], i) for i, r in enumerate(records) if r[4])
    for (a0, a1, ia), (b0, b1, ib) in zip(spans, spans[1:]):
        if b0 < a1:
            _fail(f"record {ib}", f"blob [{b0}, {b1}) overlaps record {ia} [{a0}, {a1})")


def _blobs_end(records, blobs_at) -> int:
    """The end of the last blob, refused when the blobs are spread over much more of the file
    than they fill: §8 packs them at 64-byte alignment, so a reader never has to read more than
    twice the header's own sizes (a slack for tools that lay blobs out differently)."""
    end = max([blobs_at] + [r[3] + r[4] for r in records])
    claimed = blobs_at + sum(r[4] for r in records) + BLOB_ALIGN * len(records)
    if end > 2 * claimed:
        last = max(range(len(records)), key=lambda i: records[i][3] + records[i][4])
        _fail(f"record {last}", f"blob ends at {end}, but the {len(records)} blobs hold only "
                                f"{claimed - blobs_at} bytes (§8 packs them with no gaps)")
    return end


def _make_tensor(data, i, name, record, dtype, shape):
    got_dtype, ndim, dims, offset, nbytes, group, bits = record
    what = f"record {i} ({name})"
    if got_dtype != dtype:
        _fail(what, f"dtype {DTYPE_NAMES[got_dtype]}, expected {DTYPE_NAMES[dtype]}")
    if shape is not None:
        if ndim != len(shape) or any(w is not None and w != g for w, g in zip(shape, dims)):
            want = "x".join("?" if w is None else str(w) for w in shape)
            _fail(what, f"shape {list(dims)} disagrees with the geometry ({want})")
    return Tensor(i, name, dtype, tuple(dims), offset, nbytes, group, bits, data[offset : offset + nbytes])


def _read_heads(data, g, body, start, tensors) -> tuple:
    """Probe heads (§0 item 6): every record after final_norm is a head, manifest first."""
    if len(body) == start:
        return ()
    manifest = _make_tensor(data, start, "heads.manifest", body[start], FP16, None)
    if len(manifest.shape) != 1 or not 0 < manifest.shape[0] <= 16:
        _fail(f"record {start} (heads.manifest)", f"shape {list(manifest.shape)} is not a short vector")
    tensors["heads.manifest"] = manifest
    codes = struct.unpack(f"<{manifest.shape[0]}e", manifest.data)
    at = start + 1
    for h, code in enumerate(codes):
        if code not in HEAD_CODES:
            _fail(f"record {start} (heads.manifest)", f"unknown head code {code}")
        for name, dtype, shape in head_canon(g, int(code), h):
            if at >= len(body):
                _fail("directory", f"head {h} ({HEAD_CODES[int(code)]}) is missing record {name}")
            tensors[name] = _make_tensor(data, at, name, body[at], dtype, shape)
            at += 1
    if at != len(body):
        # A Whistle (speech) file has the same tag and its audio.* records here (§U a).
        raise UnsupportedModelError(
            f"record {at}: {len(body) - at} records after the probe heads (a Whistle speech model's "
            f"audio records?); only Needle 3 text models are supported")
    return tuple(int(c) for c in codes)


def _check_cross_shapes(g, tensors):
    """Shapes the canon walk cannot know alone: cond rank, head widths, group vs widths."""
    for i in range(g.num_layers):
        rank_v = tensors[f"layers.{i}.cond_v"].shape[1]
        rank_u = tensors[f"layers.{i}.cond_u"].shape[0]
        if not 1 <= rank_v <= g.hada_n or rank_u != rank_v:
            _fail(f"layers.{i}.cond_v", f"cond rank {rank_v} vs cond_u rank {rank_u} (must agree, 1..hada_n)")
    groups = {t.group for t in tensors.values() if t.is_cq}
    if len(groups) > 1:
        raise UnsupportedModelError(f"CQ tensors use several group sizes {sorted(groups)}")
    c = 0
    while f"heads.{c}.probes" in tensors:
        pre = f"heads.{c}."
        cells = g.num_layers + 1
        probes, gain = tensors[pre + "probes"], tensors[pre + "gain"]
        k = gain.shape[1]
        queries = tensors[pre + "query"].rows
        if k == 0 or queries == 0:
            # Empty softmaxes (§7 steps 1-2) have no meaning; every other check would pass.
            _fail(pre + "gain", f"{k} probes per cell and {queries} queries (at least 1 each)")
        if probes.rows != cells * k:
            _fail(pre + "probes", f"{probes.rows} rows, expected cells*k = {cells * k}")
        if tensors[pre + "row_bias"].shape != (queries, cells, k):
            _fail(pre + "row_bias", f"shape {list(tensors[pre + 'row_bias'].shape)} != [{queries}, {cells}, {k}]")
        if tensors[pre + "proj"].cols != queries * g.d_model:
            _fail(pre + "proj", f"{tensors[pre + 'proj'].cols} columns, expected queries*d = {queries * g.d_model}")
        out = tensors[pre + "proj"].rows
        if out == 0 or tensors[pre + "bias"].shape != (out,):
            _fail(pre + "bias", f"shape {list(tensors[pre + 'bias'].shape)} != [{out}] (one bias per proj row)")
        c += 1
