"""Seeded mutation fuzzing of the byte formats a user can hand us: .cact v3, its tokenizer blob and .gguf.

Every mutated input must end in a valid load or a ``NeedleError`` (docs/api.md, "Model files"),
within ``TIME_LIMIT_S``, and parsing must not allocate more than the input's own size (tracemalloc
peak; for the tokenizer a fixed multiple of it, see below): nothing may be sized by a number read
from the file. A loaded result is also used a little
(tensor views checked, the tokenizer encodes and decodes), since a reader that accepts a file
promises the rest of the engine consistent data.

The mutators are plain ``random.Random`` so a seed gives the same cases on every platform; a
failure message names the case number and the mutations, and ``cact_case(base, n)``,
``blob_case(n)`` or ``gguf_case(base, n)`` rebuilds that input.
"""

import random
import struct
import time
import tracemalloc
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_samples import build_gguf, dense_parts
from needle_wgpu.errors import NeedleError
from needle_wgpu.formats import cact
from needle_wgpu.formats.dense_geometry import DenseGeometry
from needle_wgpu.formats.gguf import open_gguf
from needle_wgpu.formats import needle3_tokenizer as tok
from needle_wgpu.formats.needle3_tokenizer import Tokenizer, synthetic_tokenizer_blob
from needle_wgpu.synth import synthesize

CACT_CASES_PER_BASE = 600  # two bases: 1200 containers per run
TOKENIZER_CASES = 1200
TIME_LIMIT_S = 1.0
# Below this size what is allocated is the exception and its message, not the parse.
SMALL_INPUT_FLOOR = 8 * 1024
# The tokenizer keeps every piece as a Python str and index dicts: about 23 bytes per blob byte
# for the synthetic 512-piece vocabulary (short pieces). 64 leaves room without hiding a
# count-driven blow-up.
TOKENIZER_BYTES_PER_BLOB_BYTE = 64

VALID = synthesize("tiny", seed=0)
NO_HEADS = synthesize("tiny", seed=0, heads=False)
BLOB = synthetic_tokenizer_blob(512)

DIRECTORY_AT = cact.HEADER.size + 4 * cact.CODEBOOK_LEN
RECORD = cact.RECORD
# (byte offset, struct code) of each directory field: dtype, ndim, pad, s0..s3, offset, nbytes, group, bits
RECORD_FIELDS = ((0, "B"), (1, "B"), (2, "H"), (4, "I"), (8, "I"), (12, "I"), (16, "I"), (20, "Q"), (28, "Q"),
                 (36, "I"), (40, "I"))
INTERESTING = (0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 257, 511, 512, 1023, 1024,
               4095, 4096, 65535, 65536, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 1 << 24, (1 << 24) + 1,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1)
INTERESTING64 = INTERESTING + (1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
FLOATS = (float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 3.4e38, -3.4e38, 1.0, -1.0, 1e6)
SAMPLE_TEXTS = ("", "hello world", " leading space", '<tools>[{"name":"f"}]</tools>', "é漢字😀", "\ud800 lone",
                "a" * 300, "<0x41><s></s><unk>", "\x00\x01\n\t")


# ----------------------------------------------------------------------------------- .cact mutators


def _records(data) -> int:
    return struct.unpack_from("<I", data, 4)[0]


def _record_at(i: int) -> int:
    return DIRECTORY_AT + RECORD.size * i


def _flip_bits(rng, out, count, limit):
    for _ in range(count):
        bit = rng.randrange(8 * limit)
        out[bit // 8] ^= 1 << (bit % 8)


def _huge_dims(rng, out, n):
    """One dimension made huge or off by one, with a byte count that agrees with the new shape,
    so the shape/size check passes and the bounds and canon checks must catch it."""
    i = rng.randrange(n)
    dtype, ndim, pad, *dims, offset, nbytes, group, bits = RECORD.unpack_from(out, _record_at(i))
    k = rng.randrange(max(ndim, 1))
    dims[k] = rng.choice((1 << 16, 1 << 20, 1 << 24, (1 << 24) + 1, (1 << 32) - 1, 2 * dims[k], dims[k] + 1))
    if dtype == cact.CQ and ndim == 2:
        nbytes = cact.cq_blob_bytes(dims[0], dims[1], group or 128, bits if bits in cact.CQ_BITS else 2)
    elif dtype in (cact.FP16, cact.FP32):
        size = 1
        for dim in dims[:ndim]:
            size *= dim
        nbytes = size * (2 if dtype == cact.FP16 else 4)
    RECORD.pack_into(out, _record_at(i), dtype, ndim, pad, *dims, offset, nbytes & ((1 << 64) - 1), group, bits)
    return f"record {i} dims -> {dims[:ndim]}"


def mutate_cact(rng: random.Random, base: bytes) -> tuple:
    """(mutated file, what was done)."""
    out = bytearray(base)
    n = _records(base)
    directory_end = _record_at(n)
    kind = rng.randrange(12)
    if kind == 0:
        count = rng.randint(1, 8)
        _flip_bits(rng, out, count, len(out))
        what = f"{count} bit flips anywhere"
    elif kind == 1:
        count = rng.randint(1, 4)
        _flip_bits(rng, out, count, directory_end)
        what = f"{count} bit flips in the header/directory"
    elif kind == 2:
        cut = rng.randrange(directory_end + 64) if rng.random() < 0.5 else rng.randrange(len(out))
        return bytes(out[:cut]), f"truncated to {cut} bytes"
    elif kind == 3:
        word = rng.randrange(48)
        value = rng.choice(INTERESTING) if rng.random() < 0.8 else rng.getrandbits(32)
        struct.pack_into("<I", out, 4 * word, value)
        what = f"header word {word} = {value}"
    elif kind == 4:
        value = rng.choice(FLOATS + (rng.uniform(-1e13, 1e13),))
        struct.pack_into("<f", out, 4 * 48, value)
        what = f"rope_theta = {value}"
    elif kind == 5:
        i = rng.randrange(n)
        at, code = rng.choice(RECORD_FIELDS)
        value = rng.choice(INTERESTING64 if code == "Q" else INTERESTING) & ((1 << (8 * struct.calcsize(code))) - 1)
        struct.pack_into("<" + code, out, _record_at(i) + at, value)
        what = f"record {i} field at +{at} = {value}"
    elif kind == 6:
        what = _huge_dims(rng, out, n)
    elif kind == 7:
        i, j = rng.randrange(n), rng.randrange(n)
        out[_record_at(i) : _record_at(i + 1)] = base[_record_at(j) : _record_at(j + 1)]
        what = f"record {j} copied over record {i}"
    elif kind == 8:
        start, length = rng.randrange(len(out)), rng.randint(1, 256)
        fill = rng.choice((0, 0xFF, rng.randrange(256)))
        out[start : start + length] = bytes([fill]) * len(out[start : start + length])
        what = f"{length} bytes at {start} = 0x{fill:02X}"
    elif kind == 9:
        extra = rng.randint(1, 200)
        out += bytes(rng.randrange(256) for _ in range(extra))
        what = f"{extra} garbage bytes appended"
    elif kind == 10:
        index, value = rng.randrange(cact.CODEBOOK_LEN), rng.choice(FLOATS)
        struct.pack_into("<f", out, cact.HEADER.size + 4 * index, value)
        what = f"codebook[{index}] = {value}"
    else:
        # Inside the tokenizer blob (the last record): Needle3.load parses it after the container.
        offset, nbytes = RECORD.unpack_from(base, _record_at(n - 1))[7:9]
        if nbytes < 24 or offset + nbytes > len(out):  # an earlier mutation broke the record
            _flip_bits(rng, out, 1, len(out))
            return bytes(out), "1 bit flip anywhere"
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 4)):
                bit = rng.randrange(8 * nbytes)
                out[offset + bit // 8] ^= 1 << (bit % 8)
            what = "bit flips in the tokenizer blob"
        else:
            word, value = rng.randrange(6), rng.choice(INTERESTING)
            struct.pack_into("<I", out, offset + 4 * word, value)
            what = f"tokenizer header word {word} = {value}"
    return bytes(out), what


def open_like_the_engine(data):
    """The CPU half of ``Needle3.load``: the container, then its tokenizer record."""
    container = cact.load(data)
    tokenizer = Tokenizer.from_blob(container.tokenizer) if container.tokenizer is not None else None
    return container, tokenizer


def check_loaded_container(container, size):
    for tensor in container.tensors.values():
        assert len(tensor.data) == tensor.nbytes and tensor.offset + tensor.nbytes <= size, tensor.name
    assert container.file_size == size


def check_loaded_tokenizer(tokenizer):
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids), text
        assert isinstance(tokenizer.decode(ids + [-1, 1 << 40, 2.5]), str)


# ----------------------------------------------------------------------------------- tokenizer mutators


def _piece_offsets(blob) -> list:
    count = struct.unpack_from("<I", blob, 0)[0]
    at, out = tok.HEADER.size, []
    for _ in range(count):
        out.append(at)
        at += tok.RECORD.size + tok.RECORD.unpack_from(blob, at)[2]
    return out


PIECES = _piece_offsets(BLOB)


def mutate_blob(rng: random.Random, blob: bytes) -> tuple:
    """(mutated blob, what was done). Record-level edits assume BLOB's layout."""
    out = bytearray(blob)
    kind = rng.randrange(10) if len(blob) == len(BLOB) else rng.randrange(2)
    if kind == 0:
        count = rng.randint(1, 8)
        _flip_bits(rng, out, count, len(out))
        return bytes(out), f"{count} bit flips"
    if kind == 1:
        cut = rng.randrange(len(out))
        return bytes(out[:cut]), f"truncated to {cut} bytes"
    i = rng.randrange(len(PIECES))
    at = PIECES[i]
    if kind == 2:
        word = rng.randrange(5)  # n_pieces, pad, eos, bos, unk
        value = rng.choice(INTERESTING) if rng.random() < 0.8 else rng.getrandbits(32)
        struct.pack_into("<I", out, 4 * word, value)
        what = f"header word {word} = {value}"
    elif kind == 3:
        flags = (rng.randrange(4), rng.randrange(4), rng.choice((0, 1, 0xFFFF)))
        struct.pack_into("<BBH", out, 20, *flags)
        what = f"flags = {flags}"
    elif kind == 4:
        value = rng.choice((0, 1, 2, 255, 256, 0xFFFF, rng.randrange(64)))
        struct.pack_into("<H", out, at + 5, value)
        what = f"piece {i} length = {value}"
    elif kind == 5:
        value = rng.choice((0, 1, 2, 3, 4, 5, 255))
        struct.pack_into("<B", out, at + 4, value)
        what = f"piece {i} type = {value}"
    elif kind == 6:
        value = rng.choice((float("nan"), float("inf"), -float("inf"), 0.0, 3e38, -3e38))
        struct.pack_into("<f", out, at, value)
        what = f"piece {i} score = {value}"
    elif kind == 7:
        length = struct.unpack_from("<H", out, at + 5)[0]
        byte = rng.choice((0x80, 0xC0, 0xFF, 0xED, 0x00, 0x20))
        if length and at + 7 + length <= len(out):
            out[at + 7 + rng.randrange(length)] = byte
        what = f"piece {i} text byte = 0x{byte:02X}"
    elif kind == 8:
        j = rng.randrange(len(PIECES))
        other = PIECES[j]
        mine, theirs = (struct.unpack_from("<H", blob, p + 5)[0] for p in (at, other))
        if mine == theirs:  # same length: the text is copied (a duplicate piece)
            out[at + 7 : at + 7 + mine] = blob[other + 7 : other + 7 + theirs]
        else:  # score and type copied
            out[at : at + 5] = blob[other : other + 5]
        what = f"piece {j} copied onto piece {i}"
    else:
        extra = rng.randint(1, 16)
        out += bytes(rng.randrange(256) for _ in range(extra))
        what = f"{extra} bytes appended"
    return bytes(out), what


# ----------------------------------------------------------------------------------- the runs


def cact_case(base_name: str, case: int) -> tuple:
    """The mutated file of one case (stack of 1-3 mutations), to reproduce a failure."""
    rng = random.Random(f"cact-{base_name}-{case}")
    data, steps = VALID if base_name == "heads" else NO_HEADS, []
    for _ in range(rng.choice((1, 1, 2, 3))):
        if len(data) < DIRECTORY_AT or not 0 < _records(data) or _record_at(_records(data)) > len(data):
            break  # no readable directory left to edit: stop stacking
        data, what = mutate_cact(rng, data)
        steps.append(what)
    return data, "; ".join(steps)


def blob_case(case: int) -> tuple:
    rng = random.Random(f"blob-{case}")
    data, steps = BLOB, []
    for _ in range(rng.choice((1, 1, 2, 3))):
        if len(data) < tok.HEADER.size + tok.RECORD.size:
            break
        data, what = mutate_blob(rng, data)
        steps.append(what)
    return data, "; ".join(steps)


def run_cases(cases, target, check, allowed_peak):
    """Run every case under tracemalloc; returns (outcomes, failures)."""
    outcomes, failures = Counter(), []
    tracemalloc.start()
    try:
        for case, (data, what) in cases:
            tracemalloc.reset_peak()
            floor = tracemalloc.get_traced_memory()[0]
            started = time.perf_counter()
            try:
                loaded = target(data)
                outcome = "loaded"
            except NeedleError as exc:
                loaded, outcome = None, type(exc).__name__
            except Exception as exc:  # anything else is a reader bug
                failures.append(f"case {case} ({what}): {type(exc).__name__}: {exc}")
                continue
            elapsed = time.perf_counter() - started
            peak = tracemalloc.get_traced_memory()[1] - floor
            outcomes[outcome] += 1
            if elapsed > TIME_LIMIT_S:
                failures.append(f"case {case} ({what}): took {elapsed:.2f} s")
            if peak > allowed_peak(len(data)):
                failures.append(f"case {case} ({what}): allocated {peak} bytes for a {len(data)}-byte input")
            if loaded is not None:
                try:
                    check(loaded, len(data))
                except Exception as exc:
                    failures.append(f"case {case} ({what}): loaded, then {type(exc).__name__}: {exc}")
    finally:
        tracemalloc.stop()
    return outcomes, failures


def _check_both(loaded, size):
    container, tokenizer = loaded
    check_loaded_container(container, size)
    if tokenizer is not None:
        check_loaded_tokenizer(tokenizer)


@pytest.mark.parametrize("base_name", ["heads", "no_heads"])
def test_cact_mutations_load_or_raise_a_needle_error(base_name):
    cases = ((case, cact_case(base_name, case)) for case in range(CACT_CASES_PER_BASE))
    outcomes, failures = run_cases(cases, open_like_the_engine, _check_both,
                                   lambda size: max(size, SMALL_INPUT_FLOOR))
    assert not failures, "\n".join(failures[:20])
    assert sum(outcomes.values()) == CACT_CASES_PER_BASE
    # Both outcomes in bulk, or the mutations are not reaching the reader's checks.
    assert outcomes["loaded"] >= CACT_CASES_PER_BASE // 20, outcomes
    assert outcomes["ContainerError"] >= CACT_CASES_PER_BASE // 2, outcomes


def test_tokenizer_blob_mutations_load_or_raise_a_needle_error():
    cases = ((case, blob_case(case)) for case in range(TOKENIZER_CASES))
    outcomes, failures = run_cases(
        cases, Tokenizer.from_blob, lambda tokenizer, size: check_loaded_tokenizer(tokenizer),
        lambda size: max(TOKENIZER_BYTES_PER_BLOB_BYTE * size, SMALL_INPUT_FLOOR))
    assert not failures, "\n".join(failures[:20])
    assert sum(outcomes.values()) == TOKENIZER_CASES
    assert outcomes["loaded"] >= TOKENIZER_CASES // 20, outcomes
    assert outcomes["ContainerError"] >= TOKENIZER_CASES // 2, outcomes


def test_the_unmutated_inputs_load_within_the_same_limits():
    """The limits above are not vacuous: the valid inputs pass them with room to spare."""
    outcomes, failures = run_cases([(0, (VALID, "none")), (1, (NO_HEADS, "none"))], open_like_the_engine,
                                   _check_both, lambda size: size)
    assert outcomes == {"loaded": 2} and not failures, failures
    outcomes, failures = run_cases([(0, (BLOB, "none"))], Tokenizer.from_blob,
                                   lambda tokenizer, size: check_loaded_tokenizer(tokenizer),
                                   lambda size: TOKENIZER_BYTES_PER_BLOB_BYTE * size)
    assert outcomes == {"loaded": 1} and not failures, failures


@pytest.mark.parametrize("claim", ["n_pieces", "piece length"])
def test_a_huge_claimed_count_allocates_nothing_in_proportion(claim):
    """A header that claims 2^32 - 1 pieces, or a piece of 65535 bytes, is refused before any
    allocation of that size (the check the fuzzer's allocation bound relies on)."""
    out = bytearray(BLOB)
    if claim == "n_pieces":
        struct.pack_into("<I", out, 0, 0xFFFFFFFF)
    else:
        struct.pack_into("<H", out, PIECES[300] + 5, 0xFFFF)
    tracemalloc.start()
    try:
        with pytest.raises(NeedleError, match="tokenizer: "):
            Tokenizer.from_blob(bytes(out))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < TOKENIZER_BYTES_PER_BLOB_BYTE * len(out)


# ----------------------------------------------------------------------------------- .gguf

GGUF_CASES_PER_BASE = 600  # two bases: 1200 files per run
# Parsing builds a Python object per key, string and tensor of the metadata: up to ~10 bytes per
# byte of it (a 2-character string in 10 file bytes becomes a 56-byte str plus two pointers). A
# file cut just after its 64-token vocabulary reaches 7.5x; the whole files stay below 2x, their
# tensor data costing nothing (views).
GGUF_BYTES_PER_FILE_BYTE = 10
# Two small models: a one-layer llama with a 64-token vocabulary, and a MoE (qwen3moe).
GGUF_BASES = {
    "llama": build_gguf(*dense_parts("llama", layers=1, vocab=64)),
    "qwen3moe": build_gguf(*dense_parts("qwen3moe", layers=1, vocab=64, d=32, heads=2, kv_heads=1, head_dim=16,
                                        ff=32)),
}


def _set(out, fmt, at, value):
    if at + struct.calcsize(fmt) <= len(out):  # an earlier mutation in the stack may have cut it off
        struct.pack_into("<" + fmt, out, at, value & ((1 << (8 * struct.calcsize(fmt))) - 1))


def mutate_gguf(rng: random.Random, data: bytes, base: bytes, layout) -> tuple:
    """(mutated file, what was done). Field edits use the unmutated base's layout and values, so
    they hit the header, metadata and tensor infos; earlier mutations in a stack may have moved
    the fields (that is fine: the result is still some file)."""
    out = bytearray(data)
    head = layout.data_start  # header, metadata and tensor infos
    kind = rng.randrange(14)
    if kind == 0:
        count = rng.randint(1, 8)
        _flip_bits(rng, out, count, len(out))
        what = f"{count} bit flips anywhere"
    elif kind == 1:
        count = rng.randint(1, 4)
        _flip_bits(rng, out, count, min(head, len(out)))
        what = f"{count} bit flips before the data"
    elif kind == 2:
        cut = rng.randrange(min(head + 64, len(out))) if rng.random() < 0.7 else rng.randrange(len(out))
        return bytes(out[:cut]), f"truncated to {cut} bytes"
    elif kind == 3:
        at, value = rng.choice((8, 16)), rng.choice(INTERESTING64)
        _set(out, "Q", at, value)
        what = f"{'tensor' if at == 8 else 'metadata'} count = {value}"
    elif kind in (4, 5):
        fields = layout.string_lengths if kind == 4 else layout.array_counts
        at = rng.choice(fields)
        old = struct.unpack_from("<Q", base, at)[0]
        value = rng.choice(INTERESTING64 + (old + 1, old - 1, 2 * old))
        _set(out, "Q", at, value)
        what = f"{'string length' if kind == 4 else 'array count'} at {at} = {value}"
    elif kind == 6:
        at = rng.choice(layout.value_types)
        value = rng.choice((0, 4, 6, 7, 8, 9, 10, 12, 13, 255, rng.randrange(1 << 32)))
        _set(out, "I", at, value)
        what = f"value type at {at} = {value}"
    elif kind == 7:
        i, value = rng.randrange(len(layout.n_dims)), rng.choice((0, 1, 2, 3, 4, 5, 6, 1 << 31))
        _set(out, "I", layout.n_dims[i], value)
        what = f"tensor {i} n_dims = {value}"
    elif kind == 8:
        i = rng.randrange(len(layout.ne))
        at = layout.ne[i] + 8 * rng.randrange(struct.unpack_from("<I", base, layout.n_dims[i])[0])
        old = struct.unpack_from("<Q", base, at)[0]
        value = rng.choice(INTERESTING64 + (old + 1, old - 1, 2 * old, old // 2))
        _set(out, "Q", at, value)
        what = f"tensor {i} ne field at {at} = {value}"
    elif kind == 9:
        i, value = rng.randrange(len(layout.tensor_types)), rng.choice((*range(45), 255, 1 << 31))
        _set(out, "I", layout.tensor_types[i], value)
        what = f"tensor {i} type = {value}"
    elif kind == 10:
        i, j = rng.randrange(len(layout.tensor_offsets)), rng.randrange(len(layout.tensor_offsets))
        other = struct.unpack_from("<Q", base, layout.tensor_offsets[j])[0]
        value = rng.choice((other, other + 32, other - 32, other + 1, rng.choice(INTERESTING64)))
        _set(out, "Q", layout.tensor_offsets[i], value)
        what = f"tensor {i} offset = {value}"
    elif kind == 11:
        i, j = rng.randrange(len(layout.info_spans)), rng.randrange(len(layout.info_spans))
        (a0, a1), (b0, b1) = layout.info_spans[i], layout.info_spans[j]
        if a1 - a0 == b1 - b0:  # same size: a duplicate name (or an identical copy)
            out[a0:a1] = base[b0:b1] if a1 <= len(out) else out[a0:a1]
            what = f"tensor info {j} copied over {i}"
        else:
            out[a0:a0 + 4] = base[b0:b0 + 4]
            what = f"tensor info {j}'s first bytes copied over {i}'s"
    elif kind == 12:
        at, length = rng.choice(layout.string_bytes)
        byte = rng.choice((0x80, 0xC0, 0xC3, 0xED, 0xF4, 0xFF, 0x00))
        if length and at + length <= len(out):
            out[at + rng.randrange(length)] = byte
        what = f"string byte at {at} = 0x{byte:02X}"
    else:
        at, extra = rng.randrange(head), bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        out[at:at] = extra if rng.random() < 0.5 else b""
        if not extra or rng.random() < 0.5:
            del out[at : at + len(extra)]
        what = f"bytes inserted/removed at {at}"
    return bytes(out), what


def gguf_case(base_name: str, case: int) -> tuple:
    """The mutated file of one case (stack of 1-3 mutations), to reproduce a failure."""
    rng = random.Random(f"gguf-{base_name}-{case}")
    base, layout = GGUF_BASES[base_name]
    data, steps = base, []
    for _ in range(rng.choice((1, 1, 2, 3))):
        data, what = mutate_gguf(rng, data, base, layout)
        steps.append(what)
        if len(data) < layout.data_start:
            break  # cut before the data: the field offsets no longer point into the file
    return data, "; ".join(steps)


def open_gguf_like_the_engine(data):
    gguf_file = open_gguf(data)
    return gguf_file, DenseGeometry.from_gguf(gguf_file)


def check_loaded_gguf(loaded, size):
    gguf_file, geometry = loaded
    assert gguf_file.file_size == size and gguf_file.data_start % gguf_file.alignment == 0
    for tensor in gguf_file.tensors.values():
        start = gguf_file.data_start + tensor.offset
        assert len(tensor.data) == tensor.nbytes and start + tensor.nbytes <= size, tensor.name
        assert tensor.nbytes == tensor.n_elements // tensor.type.block_size * tensor.type.type_size, tensor.name
    for name, ne in geometry.tensors():
        assert gguf_file[name].ne == ne and gguf_file[name].type.supported, name
    for entry in gguf_file.fields.values():
        value = entry.value
        if isinstance(value, memoryview):
            value.tolist()


@pytest.mark.parametrize("base_name", list(GGUF_BASES))
def test_gguf_mutations_load_or_raise_a_needle_error(base_name):
    cases = ((case, gguf_case(base_name, case)) for case in range(GGUF_CASES_PER_BASE))
    outcomes, failures = run_cases(cases, open_gguf_like_the_engine, check_loaded_gguf,
                                   lambda size: max(GGUF_BYTES_PER_FILE_BYTE * size, SMALL_INPUT_FLOOR))
    assert not failures, "\n".join(failures[:20])
    assert sum(outcomes.values()) == GGUF_CASES_PER_BASE
    assert outcomes["loaded"] >= GGUF_CASES_PER_BASE // 20, outcomes
    assert outcomes["ContainerError"] >= GGUF_CASES_PER_BASE // 2, outcomes
    assert outcomes["UnsupportedModelError"] >= GGUF_CASES_PER_BASE // 100, outcomes  # type ids, versions


def test_the_unmutated_gguf_files_load_within_the_same_limits():
    cases = [(i, (data, "none")) for i, (data, _) in enumerate(GGUF_BASES.values())]
    outcomes, failures = run_cases(cases, open_gguf_like_the_engine, check_loaded_gguf, lambda size: size)
    assert outcomes == {"loaded": 2} and not failures, failures


# ----------------------------------------------------------------------------------- GGUF tokenizer metadata


def _tokenizer_metadata_file(model, tokens, types, scores, merges, extra) -> bytes:
    from needle_wgpu.formats import gguf as G

    kvs = [("tokenizer.ggml.model", G.STRING, model), ("tokenizer.ggml.tokens", G.ARRAY, (G.STRING, tokens))]
    if types is not None:
        kvs.append(("tokenizer.ggml.token_type", G.ARRAY, (G.INT32, types)))
    if scores is not None:
        kvs.append(("tokenizer.ggml.scores", G.ARRAY, (G.FLOAT32, scores)))
    if merges is not None:
        kvs.append(("tokenizer.ggml.merges", G.ARRAY, (G.STRING, merges)))
    kvs += [(f"tokenizer.ggml.{key}", G.UINT32, value) for key, value in extra]
    return build_gguf(kvs, [])[0]


_piece = st.one_of(st.text(max_size=12), st.sampled_from(["<s>", "</s>", "<|im_end|>", "<|endoftext|>", "\u2581a",
                                                          "Ġ", "<0x41>", "<0xZZ>", "a" * 300, "<" * 50]))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(model=st.sampled_from(["gpt2", "llama", "bert"]), tokens=st.lists(_piece, min_size=1, max_size=40),
       types=st.one_of(st.none(), st.lists(st.integers(-3, 9), max_size=45)),
       scores=st.one_of(st.none(), st.lists(st.floats(width=32), max_size=45)),
       merges=st.one_of(st.none(), st.lists(st.text(max_size=9), max_size=20)),
       extra=st.lists(st.tuples(st.sampled_from(["bos_token_id", "eos_token_id", "unknown_token_id", "eot_token_id",
                                                 "add_bos_token"]), st.integers(0, 2 ** 32 - 1)), max_size=4),
       text=st.text(max_size=60))
def test_fuzz_gguf_tokenizer_metadata_loads_or_raises_a_needle_error(model, tokens, types, scores, merges, extra,
                                                                     text):
    from needle_wgpu.errors import NeedleError
    from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf

    data = _tokenizer_metadata_file(model, tokens, types, scores, merges, extra)
    try:
        tokenizer = tokenizer_from_gguf(open_gguf(data).metadata())
    except NeedleError:
        return
    for parse_special in (False, True):
        ids = tokenizer.encode(text + "".join(tokens[:3]), parse_special=parse_special)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert isinstance(tokenizer.decode(ids), str)
