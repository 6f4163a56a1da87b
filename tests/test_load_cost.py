"""Load cost is bounded by the file (docs/api.md, "Cost"): adversarial files whose size is
spent on one part (a wide confidence head, long user-defined tokenizer pieces) load in time and
memory near-linear in their size, and a head too costly to finish on the host is refused at use.
"""

import struct
import time
import tracemalloc

import pytest

from needle_wgpu import synth
from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.formats import cact
from needle_wgpu.formats.needle3_tokenizer import HEADER, RECORD, USER_DEFINED, Tokenizer, synthetic_tokenizer
from needle_wgpu.kernels.needle3.probe import MAX_HOST_WORK, ConfidenceHead, dequantize_row, unpack_codes

# Pure-Python parsing runs at several MB/s on a slow CPU (record-dense tokenizer blobs at
# ~3 MB/s); these bounds leave 5-10x room.
SECONDS_PER_MB = 2.0
BYTES_PER_FILE_BYTE = 8
# Every tokenizer piece costs ~300 bytes of Python objects (its str, score, type, index entries)
# whatever its length; a record takes at least 8 bytes of blob, so short pieces cost ~40 bytes
# a blob byte and long ones ~3.
BYTES_PER_PIECE = 400


def _measure(fn):
    """(result, seconds, peak bytes): timed on its own, then run again under tracemalloc (which
    slows allocation-heavy code several times over)."""
    started = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - started
    tracemalloc.start()
    try:
        fn()
        return result, elapsed, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def wide_head_file():
    """A tiny model whose confidence head has 4096 queries (1.8 MB, most of it the head)."""
    old = synth.HEAD_QUERIES
    synth.HEAD_QUERIES = 4096
    try:
        return synth.synthesize("tiny", seed=0)
    finally:
        synth.HEAD_QUERIES = old


def test_a_wide_confidence_head_loads_in_linear_time_and_is_refused_at_use(wide_head_file):
    container = cact.load(wide_head_file)
    head, elapsed, peak = _measure(lambda: ConfidenceHead(container))
    assert elapsed < SECONDS_PER_MB * len(wide_head_file) / 1e6
    assert peak < BYTES_PER_FILE_BYTE * len(wide_head_file)
    assert head.queries == 4096 and head.host_work > MAX_HOST_WORK
    with pytest.raises(UnsupportedModelError, match=r"confidence head: 4096 queries .* host operations"):
        head.check()


def test_the_shipped_and_tiny_heads_are_within_the_host_budget():
    head = ConfidenceHead(cact.load(synth.synthesize("tiny", seed=0)))
    head.check()
    g = synth.GEOMETRIES["shipped"]
    probes = (g.num_layers + 1) * synth.PROBES_PER_CELL
    shipped = synth.HEAD_QUERIES * probes * g.d_model + (2 * synth.HEAD_QUERIES + probes) * g.d_model * 7
    assert shipped < MAX_HOST_WORK // 8


def test_unpack_codes_reads_an_lsb_first_bit_stream():
    for bits in (2, 3, 4):
        codes = [(7 * i + 3) % (1 << bits) for i in range(64)]
        value = sum(c << (bits * i) for i, c in enumerate(codes))
        assert unpack_codes(value.to_bytes(64 * bits // 8, "little"), bits) == codes


def test_dequantizing_a_long_row_is_linear():
    """A row of a million columns (the projection of a 4096-query head) decodes in linear time;
    the old decoder shifted one million-bit integer per code (quadratic: minutes)."""
    old = synth.HEAD_QUERIES
    synth.HEAD_QUERIES = 1024
    try:
        container = cact.load(synth.synthesize("tiny", seed=0))
    finally:
        synth.HEAD_QUERIES = old
    row, elapsed, _ = _measure(lambda: dequantize_row(container, "heads.0.proj", 0))
    assert len(row) == 1024 * 256
    assert elapsed < 10.0


def _blob_with_markers(markers) -> bytes:
    base = synthetic_tokenizer(300)
    pieces, scores, types = list(base._pieces), list(base._scores), list(base._types)
    pieces += markers
    scores += [0.0] * len(markers)
    types += [USER_DEFINED] * len(markers)
    parts = [HEADER.pack(len(pieces), 0, 1, 2, 3, 0, 1, 0)]  # no dummy prefix
    for text, score, kind in zip(pieces, scores, types):
        raw = text.encode("utf-8")
        parts += [RECORD.pack(score, kind, len(raw)), raw]
    return b"".join(parts)


@pytest.mark.parametrize("shape", ["shared prefix", "distinct prefixes", "many short"])
def test_long_user_defined_pieces_parse_in_linear_time_and_memory(shape):
    if shape == "shared prefix":  # 32 markers of 64 KB that share 65000 characters
        markers = ["a" * 65000 + f"{i:02d}" for i in range(32)]
    elif shape == "distinct prefixes":  # 32 markers of 63 KB of 3-byte characters
        markers = ["<" + chr(0x4E00 + i) * 21000 for i in range(32)]
    else:  # 20000 short markers with one first character
        markers = [f"<m{i}>" for i in range(20000)]
    blob = _blob_with_markers(markers)
    tokenizer, elapsed, peak = _measure(lambda: Tokenizer.from_blob(blob))
    assert elapsed < SECONDS_PER_MB * max(len(blob), 1e6) / 1e6
    assert peak < BYTES_PER_FILE_BYTE * len(blob) + BYTES_PER_PIECE * tokenizer.vocab_size
    # Markers still win longest-first at the leftmost position (§8 step 2).
    text = "x " + markers[3] + markers[5]
    ids = tokenizer.encode(text)
    marker_ids = [tokenizer.id_of(markers[3]), tokenizer.id_of(markers[5])]
    assert ids[-2:] == marker_ids
    assert tokenizer.decode(ids) == text


def test_markers_are_matched_longest_first_at_the_leftmost_position():
    blob = _blob_with_markers(["<a>", "<a>b", "b<a"])
    tokenizer = Tokenizer.from_blob(blob)
    ids = tokenizer.encode("b<a>x<a>")
    # At 0 "b<a" matches (leftmost), then ">x", then "<a>" (the longer "<a>b" does not fit).
    assert tokenizer.id_of("b<a") == ids[0] and ids[-1] == tokenizer.id_of("<a>")
    assert tokenizer.decode(ids) == "b<a>x<a>"
    ids = tokenizer.encode("<a>b")
    assert ids == [tokenizer.id_of("<a>b")]


# ------------------------------------------------------------------------------ GGUF tokenizers


def _tokenizer_gguf(metadata: dict) -> bytes:
    """A GGUF file holding only ``metadata``'s tokenizer keys (strings, string arrays, u32/i32
    arrays, f32 arrays, u32 values)."""
    from gguf_samples import build_gguf
    from needle_wgpu.formats import gguf as G

    kvs = []
    for key, value in metadata.items():
        if isinstance(value, str):
            kvs.append((key, G.STRING, value))
        elif isinstance(value, bool):
            kvs.append((key, G.BOOL, value))
        elif isinstance(value, int):
            kvs.append((key, G.UINT32, value))
        elif value and isinstance(value[0], str):
            kvs.append((key, G.ARRAY, (G.STRING, value)))
        elif value and isinstance(value[0], float):
            kvs.append((key, G.ARRAY, (G.FLOAT32, value)))
        else:
            kvs.append((key, G.ARRAY, (G.INT32, value)))
    return build_gguf(kvs, [])[0]


def _adversarial_vocabularies():
    from gguf_tokenizer_files import CONTROL, USER_DEFINED, bpe_metadata, spm_metadata

    long = 65536
    return {
        "one long control token (bpe)": bpe_metadata(specials=[("<" + "y" * long, CONTROL)]),
        "one long user-defined token (bpe)": bpe_metadata(specials=[("x" + "y" * long, USER_DEFINED)]),
        "one long control token (spm)": spm_metadata([("<" + "a" * long + ">", CONTROL, 0.0)]),
        "a long token of one repeated character": bpe_metadata(specials=[("q" * long, CONTROL)]),
        "long tokens sharing a prefix": bpe_metadata(
            specials=[("<" + "s" * 8000 + f"{i:02d}", USER_DEFINED) for i in range(16)]),
        "many special tokens": bpe_metadata(specials=[(f"<t{i}>", CONTROL) for i in range(20000)]),
        "long normal pieces": spm_metadata([("\u2581" + "n" * 16000 + str(i), -1.0) for i in range(4)]),
    }


@pytest.mark.parametrize("shape", list(_adversarial_vocabularies()))
def test_gguf_tokenizer_metadata_loads_in_linear_time_and_memory(shape):
    """Load cost is near-linear in the file whatever its pieces hold: the special-token index
    once kept every prefix of every special token (a 65,536-character control token took 2 GB)."""
    from needle_wgpu.formats.gguf import open_gguf
    from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf

    data = _tokenizer_gguf(_adversarial_vocabularies()[shape])
    tokenizer, elapsed, peak = _measure(lambda: tokenizer_from_gguf(open_gguf(data).metadata()))
    assert elapsed < SECONDS_PER_MB * max(len(data), 1e6) / 1e6
    # A special token costs its piece's objects twice over (both partition modes' tries).
    assert peak < BYTES_PER_FILE_BYTE * len(data) + 2 * BYTES_PER_PIECE * tokenizer.vocab_size
    # The longest special token is still cut out whole, and text made of its prefix costs linear time.
    last = tokenizer.piece(tokenizer.vocab_size - 1)
    if "normal" not in shape:
        assert tokenizer.encode("a" + last, parse_special=True)[-1] == tokenizer.vocab_size - 1
    started = time.perf_counter()
    tokenizer.encode(last[:-1] * 2, parse_special=True)
    assert time.perf_counter() - started < 5.0
