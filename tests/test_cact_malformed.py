"""Malformed .cact v3 containers: every one must fail fast, typed, named and without big allocations.

Each case edits a valid synthetic tiny container (confidence head + tokenizer, 137 records:
0 embedding, 1 layers.0.norm_in, 2 layers.0.q_proj, ..., 128 final_norm, 129 heads.manifest,
130-135 the head, 136 the tokenizer) and names the exception type and a pattern the message
must match, so that a user can tell which record or field is wrong (§8).
"""

import struct
import time
import tracemalloc

import numpy as np
import pytest

from needle_wgpu.errors import ContainerError, NeedleError, UnsupportedModelError
from needle_wgpu.formats import cact
from needle_wgpu.formats.cact_writer import Record, pack_container, records_of
from needle_wgpu.synth import synthesize

HEADER_WORDS = struct.Struct("<48If")
RECORD = struct.Struct("<BBHIIIIQQII")
CODEBOOK_AT = 196
FIELDS = ("dtype", "ndim", "pad", "s0", "s1", "s2", "s3", "offset", "nbytes", "group", "bits")
# What parsing may allocate beyond the file itself: the directory tuples, the Tensor objects
# and the name strings of a 137-record file take about 70 KB.
ALLOCATION_SLACK = 256 * 1024
TIME_LIMIT_S = 1.0

VALID = synthesize("tiny", seed=0)
NO_HEADS = synthesize("tiny", seed=0, heads=False)
RAW_INDEX = 136
MANIFEST_INDEX = 129


# ----------------------------------------------------------------------------------- editing helpers


def num_records(data) -> int:
    return struct.unpack_from("<I", data, 4)[0]


def record_at(i: int) -> int:
    return CODEBOOK_AT + 4 * 28 + RECORD.size * i


def read_record(data, i: int) -> dict:
    return dict(zip(FIELDS, RECORD.unpack_from(data, record_at(i))))


def set_words(data=VALID, **words) -> bytes:
    """Replace header words by index, e.g. set_words(w8=3); ``theta`` is the f32 at word 48."""
    values = list(HEADER_WORDS.unpack_from(data, 0))
    for key, value in words.items():
        values[48 if key == "theta" else int(key[1:])] = value
    out = bytearray(data)
    HEADER_WORDS.pack_into(out, 0, *values)
    return bytes(out)


def set_record(i: int, data=VALID, **fields) -> bytes:
    """Replace fields of directory record i (names as in FIELDS)."""
    record = read_record(data, i)
    record.update(fields)
    out = bytearray(data)
    RECORD.pack_into(out, record_at(i), *(record[name] for name in FIELDS))
    return bytes(out)


def set_codebook(index: int, value: float) -> bytes:
    out = bytearray(VALID)
    struct.pack_into("<f", out, CODEBOOK_AT + 4 * index, value)
    return bytes(out)


def set_blob(i: int, payload: bytes, data=VALID) -> bytes:
    out = bytearray(data)
    offset = read_record(data, i)["offset"]
    out[offset : offset + len(payload)] = payload
    return bytes(out)


def with_extra_record(data, extra: Record) -> bytes:
    """Insert one record just before the tokenizer, re-laid-out by the unchecked packer."""
    f = cact.load(data)
    records = records_of(f)
    records.insert(len(records) - 1, extra)
    return pack_container(f.geometry.header_words(len(records)), f.codebook, records)


def tokenizer_moved_before_bias() -> bytes:
    """The RAW record is not last: heads.0.bias becomes RAW and the tokenizer an FP16 vector."""
    tokenizer = read_record(VALID, RAW_INDEX)
    even = tokenizer["nbytes"] // 2 * 2
    data = set_record(RAW_INDEX, dtype=cact.FP16, ndim=1, s0=even // 2, nbytes=even)
    return set_record(RAW_INDEX - 1, data, dtype=cact.RAW, ndim=0, s0=0)


def manifest_with_codes(*codes) -> bytes:
    data = set_record(MANIFEST_INDEX, s0=len(codes), nbytes=2 * len(codes))
    return set_blob(MANIFEST_INDEX, struct.pack(f"<{len(codes)}e", *codes), data)


def empty_probe_head() -> bytes:
    """A head with no probes and no queries: every head tensor shrinks to zero elements."""
    data = set_record(130, s0=0, nbytes=0)  # probes (0, d)
    data = set_record(131, data, s1=0, nbytes=0)  # gain (cells, 0)
    data = set_record(132, data, s0=0, nbytes=0)  # query (0, d)
    data = set_record(133, data, s0=0, s2=0, nbytes=0)  # row_bias (0, cells, 0)
    return set_record(134, data, s1=0, nbytes=0)  # proj (1, 0)


def q_proj_of_group_256() -> bytes:
    # 128 x 256 at 2 bits: one norm per row instead of two, so the blob shrinks and still fits.
    return set_record(2, group=256, nbytes=cact.cq_blob_bytes(128, 256, 256, 2))


# ----------------------------------------------------------------------------------- the cases

E, U = ContainerError, UnsupportedModelError
LAST_OFFSET = read_record(VALID, RAW_INDEX)["offset"]

CASES = {
    # --- header
    "empty file": (lambda: b"", E, r"header: file is 0 bytes"),
    "wrong tag": (lambda: set_words(w0=0x12345678), E, r"header: wrong tag 0x12345678"),
    "v2 tag": (lambda: set_words(w0=0x05E12A83), U, r"header: .*v2"),
    "truncated header": (lambda: VALID[:150], E, r"header: truncated"),
    "truncated directory": (lambda: VALID[: record_at(20)], E, r"directory: truncated"),
    "num_tensors 0": (lambda: set_words(w1=0), E, r"header: num_tensors 0"),
    "num_tensors huge": (lambda: set_words(w1=0xFFFFFFFF), E, r"header: num_tensors 4294967295"),
    "directory runs into blobs": (lambda: set_words(w1=187), E, r"record 0: blob offset \d+ is inside"),
    "missing records": (lambda: set_words(w1=100), E, r"directory: 100 tensor records, .* at least 129"),
    "codebook_len wrong": (lambda: set_words(w2=27), E, r"header: codebook_len 27"),
    "codebook NaN": (lambda: set_codebook(1, float("nan")), E, r"codebook: 2-bit levels are not finite"),
    "codebook unsorted": (lambda: set_codebook(12, 0.5), E, r"codebook: 4-bit levels are not sorted"),
    "heads not GQA divisible": (lambda: set_words(w9=3), E, r"num_heads 4 .*num_kv_heads 3"),
    "sub_dim != d // (orders*heads)": (lambda: set_words(w21=32), E, r"engram_sub_dim 32 != d_model // tables = 64"),
    "global layer past num_layers": (lambda: set_words(w17=1 << 4), E, r"global layer .*num_layers 4"),
    "engram site past num_layers": (lambda: set_words(w32=9), E, r"engram sites \(9, 3\)"),
    "num_layers 0": (lambda: set_words(w10=0), E, r"num_layers = 0"),
    "rope_theta NaN": (lambda: set_words(theta=float("nan")), E, r"rope_theta nan"),
    "d_model > hada_n": (lambda: set_words(w7=512), E, r"d_model 512 > hada_n 256"),
    "too many engram orders": (lambda: set_words(w26=5), E, r"header: 5 engram orders"),
    "engram order 9": (lambda: set_words(w28=9), E, r"engram orders \(2, 9\)"),
    "tables not divisible by orders": (lambda: set_words(w22=5), E, r"5 engram tables"),
    "out_vocab > vocab": (lambda: set_words(w6=1024), E, r"out_vocab 1024 > vocab 512"),
    "odd qk_head_dim": (lambda: set_words(w11=31), E, r"qk_head_dim 31 is odd"),
    # --- directory records
    "unknown dtype": (lambda: set_record(3, dtype=9), E, r"record 3: unknown dtype 9"),
    "ndim 5": (lambda: set_record(3, ndim=5), E, r"record 3: ndim 5 > 4"),
    "nonzero pad": (lambda: set_record(3, pad=1), E, r"record 3: padding field is 1"),
    "nonzero unused dims": (lambda: set_record(1, s1=7), E, r"record 1: unused dimensions past ndim 1"),
    "absurd dimension": (lambda: set_record(0, s0=1 << 31), E, r"record 0: absurd dimension"),
    "billions of elements": (lambda: set_record(1, ndim=4, s0=1 << 24, s1=1 << 24, s2=1 << 24, s3=1 << 24),
                             E, r"record 1: FP16 blob is 512 bytes, its shape needs \d{20,}"),
    "offset past end": (lambda: set_record(5, offset=cact.align(len(VALID)) + 64), E,
                        r"record 5: blob \[\d+, \d+\) runs past the end"),
    "nbytes past end": (lambda: set_record(RAW_INDEX, nbytes=read_record(VALID, RAW_INDEX)["nbytes"] + 1000), E,
                        rf"record {RAW_INDEX}: blob .* runs past the end"),
    "truncated blobs": (lambda: VALID[: LAST_OFFSET + 10], E, rf"record {RAW_INDEX}: blob .* runs past the end"),
    "offset inside directory": (lambda: set_record(2, offset=64), E, r"record 2: blob offset 64 is inside"),
    "unaligned offset": (lambda: set_record(2, offset=read_record(VALID, 2)["offset"] + 4), E,
                         r"record 2: blob offset \d+ .*aligned"),
    "overlapping blobs": (lambda: set_record(2, offset=read_record(VALID, 1)["offset"]), E,
                          r"record 2: blob .* overlaps record 1"),
    "CQ nbytes disagrees with shape": (lambda: set_record(2, nbytes=read_record(VALID, 2)["nbytes"] - 2), E,
                                       r"record 2: CQ blob is \d+ bytes, its shape needs \d+"),
    "CQ bits 7": (lambda: set_record(2, bits=7), E, r"record 2: unsupported CQ bit width 7"),
    "CQ group 0": (lambda: set_record(2, group=0), E, r"record 2: CQ group 0"),
    "CQ group not pow2": (lambda: set_record(2, group=96), E, r"record 2: CQ group 96"),
    "CQ ndim 1": (lambda: set_record(2, ndim=1, s1=0), E, r"record 2: CQ tensor with ndim 1"),
    "group/bits on FP16": (lambda: set_record(1, group=128, bits=2), E, r"record 1: group/bits set"),
    "RAW with ndim 1": (lambda: set_record(RAW_INDEX, ndim=1, s0=5), E, rf"record {RAW_INDEX}: RAW record with ndim 1"),
    # --- canon walk
    "wrong dtype in a slot": (lambda: set_record(1, dtype=cact.FP32, s0=128), E,
                              r"record 1 \(layers.0.norm_in\): dtype FP32, expected FP16"),
    "FP16 shape disagrees with geometry": (lambda: set_record(1, ndim=2, s0=128, s1=2), E,
                                           r"record 1 \(layers.0.norm_in\): shape \[128, 2\] disagrees"),
    "CQ shape disagrees with geometry": (lambda: set_record(2, s0=64, nbytes=cact.cq_blob_bytes(64, 256, 128, 2)),
                                         E, r"record 2 \(layers.0.q_proj\): shape \[64, 256\] disagrees"),
    "cond ranks disagree": (lambda: set_record(27, s0=4, nbytes=4 * 256 * 2), E,
                            r"layers.0.cond_v: cond rank 8 vs cond_u rank 4"),
    "several CQ groups": (q_proj_of_group_256, U, r"several group sizes \[128, 256\]"),
    "two RAW records": (lambda: set_record(128, dtype=cact.RAW, ndim=0, s0=0), E, r"directory: 2 RAW records"),
    "RAW record not last": (tokenizer_moved_before_bias, E, r"directory: the RAW tokenizer record must be the last"),
    # --- probe heads
    "bad head code": (lambda: manifest_with_codes(7.0), E, r"record 129 \(heads.manifest\): unknown head code 7.0"),
    "NaN head code": (lambda: manifest_with_codes(float("nan")), E, r"heads.manifest\): unknown head code nan"),
    "head missing its records": (lambda: manifest_with_codes(2.0, 2.0), E,
                                 r"head 1 \(confidence\) is missing record heads.1.probes"),
    # A Whistle (speech) file carries audio records here (§U a): refused by name.
    "extra record after heads": (lambda: with_extra_record(VALID, Record.fp16("extra", [1.0])), U,
                                 r"record 136: 1 records after the probe heads \(a Whistle"),
    "extra record without heads": (lambda: with_extra_record(NO_HEADS, Record.fp16("extra", np.ones((3, 3)))), E,
                                   r"record 129 \(heads.manifest\): shape \[3, 3\] is not a short vector"),
    "probe rows disagree with gain": (lambda: set_record(131, s1=2, nbytes=5 * 2 * 2), E,
                                      r"heads.0.probes: 20 rows, expected cells\*k = 10"),
    "empty probe head": (empty_probe_head, E, r"heads.0.gain: 0 probes per cell and 0 queries"),
}


def test_there_are_enough_distinct_cases():
    assert len(CASES) >= 25
    built = [build() for build, _, _ in CASES.values()]
    assert len(set(built)) == len(built), "two cases build the same file"
    assert VALID not in built


def test_the_base_containers_are_valid():
    assert cact.load(VALID).head_codes == (2,)
    assert cact.load(NO_HEADS).head_codes == ()
    assert num_records(VALID) == RAW_INDEX + 1


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_container(name):
    build, error, pattern = CASES[name]
    data = build()
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(NeedleError) as caught:
            cact.load(data)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert type(caught.value) is error, f"{name}: {type(caught.value).__name__}: {caught.value}"
    assert caught.match(pattern)
    assert elapsed < TIME_LIMIT_S
    assert peak < len(data) + ALLOCATION_SLACK


def test_unreadable_path_is_a_container_error(tmp_path):
    with pytest.raises(ContainerError, match=r"file .*missing.cact: cannot read"):
        cact.load(tmp_path / "missing.cact")


# ----------------------------------------------------------------------------------- fuzz


def _mutate(rng: np.random.Generator, data: bytes) -> bytes:
    """One random corruption: bit flips (anywhere or in the header/directory), a truncation,
    or an interesting value written into a header word or a directory field."""
    out = bytearray(data)
    kind = rng.integers(5)
    directory_end = record_at(num_records(data))
    if kind == 0:
        for _ in range(rng.integers(1, 9)):
            bit = rng.integers(8 * len(out))
            out[bit // 8] ^= 1 << (bit % 8)
    elif kind == 1:
        for _ in range(rng.integers(1, 5)):
            bit = rng.integers(8 * directory_end)
            out[bit // 8] ^= 1 << (bit % 8)
    elif kind == 2:
        return bytes(out[: rng.integers(len(out))])
    else:
        interesting = [0, 1, 2, 3, 4, 5, 7, 8, 63, 64, 127, 128, 255, 1 << 16, 1 << 24, 1 << 31,
                       0xFFFFFFFF, int(rng.integers(1 << 32))]
        value = interesting[rng.integers(len(interesting))]
        if kind == 3:
            at = 4 * rng.integers(49)
        else:
            # A u32 lane inside a random record; u64 offset/nbytes get their low word edited.
            at = record_at(rng.integers(num_records(data))) + 4 * rng.integers(11)
        struct.pack_into("<I", out, at, value)
    return bytes(out)


@pytest.mark.parametrize("base_name", ["heads", "no_heads"])
def test_random_mutations_end_in_a_load_or_a_needle_error(base_name):
    base = VALID if base_name == "heads" else NO_HEADS
    rng = np.random.default_rng(20240 + len(base_name))
    outcomes = {"loaded": 0, "rejected": 0}
    for case in range(150):
        data = _mutate(rng, base)
        started = time.perf_counter()
        try:
            cact.load(data)
            outcomes["loaded"] += 1
        except NeedleError:
            outcomes["rejected"] += 1
        except Exception as exc:  # anything else is a reader bug
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        assert time.perf_counter() - started < TIME_LIMIT_S, f"case {case} took too long"
    # Both outcomes must occur, or the mutations are not exercising the reader.
    assert outcomes["loaded"] > 5 and outcomes["rejected"] > 50, outcomes
