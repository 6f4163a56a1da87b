"""Malformed GGUF files: every one must fail fast, typed, naming the key or tensor, and without
allocating in proportion to anything the file claims.

The base is a valid one-layer llama (Q8_0 matrices, F32 norms, a 64-token vocabulary) from
tests/gguf_samples.py; each case either patches its bytes or rebuilds it with one part wrong, and
names the exception type and a pattern its message must match.
"""

import random
import struct
import time
import tracemalloc

import pytest

from gguf_samples import build_gguf, dense_parts, tensor_bytes
from needle_wgpu.errors import ContainerError, NeedleError, UnsupportedModelError
from needle_wgpu.formats import gguf as G
from needle_wgpu.formats.dense_geometry import DenseGeometry
from needle_wgpu.formats.gguf import open_gguf
from needle_wgpu.formats.gguf_types import BY_NAME

# Beyond the file itself parsing allocates the field and tensor objects and the 64 token strings
# (~30 KB here); a claim of 2^63 anything would show up as far more.
ALLOCATION_SLACK = 256 * 1024
TIME_LIMIT_S = 1.0
SIZES = dict(layers=1, vocab=64)
BASE_KVS, BASE_TENSORS = dense_parts("llama", **SIZES)
BASE, LAYOUT = build_gguf(BASE_KVS, BASE_TENSORS)
HUGE = 1 << 63


def open_model(data):
    """What the dense family does at load: the container, then the geometry."""
    return DenseGeometry.from_gguf(open_gguf(data))


def patch(fmt: str, at: int, value, data=BASE) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt if fmt[0] in "<>" else "<" + fmt, out, at, value)
    return bytes(out)


def string_at(text: str, data=BASE) -> int:
    """Offset of the bytes of a (unique) key, string value or tensor name."""
    raw = text.encode()
    at = data.index(raw)
    assert data.find(raw, at + 1) == -1, text
    return at


def value_at(key: str) -> int:
    """Offset of the u32 value type that follows a key."""
    return string_at(key) + len(key.encode())


def info_at(name: str) -> int:
    """Offset of n_dims in a tensor's info (ne, type and offset follow)."""
    return string_at(name) + len(name.encode())


def tensor_field(name: str, which: str) -> int:
    at = info_at(name)
    n_dims = struct.unpack_from("<I", BASE, at)[0]
    return {"n_dims": at, "ne0": at + 4, "type": at + 4 + 8 * n_dims, "offset": at + 8 + 8 * n_dims}[which]


def corrupt(at: int, byte: int, data=BASE) -> bytes:
    out = bytearray(data)
    out[at] = byte
    return bytes(out)


def rebuilt(arch="llama", kvs_fn=None, **options) -> bytes:
    kvs, tensors = dense_parts(arch, **{**SIZES, **options})
    return build_gguf(kvs_fn(kvs) if kvs_fn else kvs, tensors)[0]


def replace_tensor(name, ne=None, type_name=None):
    """A tensors_fn giving one tensor another shape and/or type, with bytes that match them."""
    def edit(tensors):
        out = []
        for n, shape, type_id, data in tensors:
            if n == name:
                shape = ne or shape
                t = BY_NAME[type_name] if type_name else next(t for t in BY_NAME.values() if t.id == type_id)
                type_id, data = t.id, tensor_bytes(random.Random(0), t.name, shape)
            out.append((n, shape, type_id, data))
        return out
    return edit


def without_tensor(name):
    return lambda tensors: [t for t in tensors if t[0] != name]


def with_tensor(name, ne, type_name="F32"):
    return lambda tensors: tensors + [(name, ne, BY_NAME[type_name].id, tensor_bytes(random.Random(1), type_name, ne))]


def nested(depth: int):
    value = (G.UINT8, [1])
    for _ in range(depth - 1):
        value = (G.ARRAY, [value])
    return value


def two_tensors_overlapping() -> bytes:
    offsets = LAYOUT.tensor_offsets
    second = struct.unpack_from("<Q", BASE, offsets[1])[0]
    return patch("Q", offsets[2], second)


E, U = ContainerError, UnsupportedModelError
FIRST = BASE_TENSORS[0][0]  # token_embd.weight
LAST = BASE_TENSORS[-1][0]
TOKENS = "tokenizer.ggml.tokens"
LAST_OFFSET = struct.unpack_from("<Q", BASE, LAYOUT.tensor_offsets[-1])[0]

CASES = {
    # --- header
    "empty file": (lambda: b"", E, r"header: file is 0 bytes"),
    "bad magic": (lambda: b"GGUX" + BASE[4:], E, r"header: wrong magic b'GGUX'"),
    "v1": (lambda: patch("I", 4, 1), U, r"header: GGUF v1 is not supported"),
    "unknown version": (lambda: patch("I", 4, 4), E, r"header: unknown GGUF version 4"),
    "big-endian": (lambda: patch(">I", 4, 3), U, r"header: a big-endian GGUF file"),
    "truncated counts": (lambda: BASE[:20], E, r"header: metadata count: truncated"),
    "tensor count 2^63": (lambda: patch("Q", 8, HUGE), E, rf"header: tensor count {HUGE} cannot fit"),
    "metadata count 2^64-1": (lambda: patch("Q", 16, (1 << 64) - 1), E, r"header: metadata count 18446744073709551615"),
    # --- metadata
    "key length 2^63": (lambda: patch("Q", LAYOUT.string_lengths[0], HUGE), E,
                        rf"metadata entry 0: key \(string of {HUGE} bytes\): truncated"),
    "string value past the end": (lambda: patch("Q", value_at("general.name") + 4, 1 << 40), E,
                                  r"metadata key 'general.name' \(string of 1099511627776 bytes\): truncated"),
    "string array count 2^63": (lambda: patch("Q", value_at(TOKENS) + 8, HUGE), E,
                                rf"metadata key '{TOKENS}': array of {HUGE} string cannot fit"),
    "numeric array count 2^62": (lambda: patch("Q", value_at("tokenizer.ggml.token_type") + 8, 1 << 62), E,
                                 r"metadata key 'tokenizer.ggml.token_type': array of \d+ i32 cannot fit"),
    "array element past the end": (lambda: patch("Q", value_at(TOKENS) + 16, 1 << 40), E,
                                   rf"metadata key '{TOKENS}'\[0\]: string of 1099511627776 bytes runs past"),
    "invalid UTF-8 in a key": (lambda: corrupt(string_at("general.name"), 0xFF), E,
                               r"metadata entry 1: key: invalid UTF-8 at byte 0"),
    "invalid UTF-8 in a value": (lambda: corrupt(string_at("tiny llama") + 2, 0xC3), E,
                                 r"metadata key 'general.name': invalid UTF-8 at byte 2"),
    "invalid UTF-8 in an array element": (lambda: corrupt(string_at("Ġé漢7"), 0xFF), E,
                                          rf"metadata key '{TOKENS}'\[7\]: invalid UTF-8"),
    "unknown value type": (lambda: patch("I", value_at("general.name"), 13), E,
                           r"metadata key 'general.name': unknown value type 13"),
    "unknown array item type": (lambda: patch("I", value_at(TOKENS) + 4, 42), E,
                                rf"metadata key '{TOKENS}': array of unknown value type 42"),
    "bool byte 2": (lambda: patch("B", value_at("tokenizer.ggml.add_bos_token") + 4, 2), E,
                    r"metadata key 'tokenizer.ggml.add_bos_token': bool byte is 2"),
    "duplicate key": (lambda: rebuilt(kvs_fn=lambda kvs: kvs + [("general.name", G.STRING, "again")]), E,
                      r"metadata key 'general.name': appears twice"),
    "arrays nested too deep": (lambda: rebuilt(keys={"x.deep": (G.ARRAY, nested(10))}), E,
                               r"metadata key 'x.deep'(\[0\])*: arrays nested deeper than 8"),
    "alignment not a power of two": (lambda: rebuilt(keys={"general.alignment": (G.UINT32, 48)}), E,
                                     r"metadata key 'general.alignment': 48 is not a power of two"),
    "alignment 0": (lambda: rebuilt(keys={"general.alignment": (G.UINT32, 0)}), E,
                    r"metadata key 'general.alignment': 0 is not a power of two"),
    "alignment of the wrong type": (lambda: rebuilt(keys={"general.alignment": (G.INT32, 32)}), E,
                                    r"metadata key 'general.alignment': is i32, expected u32"),
    # --- tensor infos
    "tensor name length 2^63": (lambda: patch("Q", string_at(FIRST) - 8, HUGE), E,
                                rf"tensor info 0: name \(string of {HUGE} bytes\): truncated"),
    "invalid UTF-8 in a tensor name": (lambda: corrupt(string_at(FIRST), 0xFE), E,
                                       r"tensor info 0: name: invalid UTF-8"),
    "n_dims 5": (lambda: patch("I", tensor_field(FIRST, "n_dims"), 5), E, rf"tensor '{FIRST}': n_dims 5 > 4"),
    "absurd dimension": (lambda: patch("Q", tensor_field(FIRST, "ne0"), HUGE), E,
                         rf"tensor '{FIRST}': absurd dimension"),
    "billions of elements": (lambda: patch("Q", tensor_field(FIRST, "ne0") + 8, 1 << 40), E,
                             rf"tensor '{FIRST}': bytes \[\d+, \d+\) run past the end"),
    "unknown tensor type": (lambda: patch("I", tensor_field(FIRST, "type"), 99), E,
                            rf"tensor '{FIRST}': unknown tensor type id 99"),
    "Q4_2 (never in GGUF)": (lambda: patch("I", tensor_field(FIRST, "type"), 4), E,
                             rf"tensor '{FIRST}': unknown tensor type id 4"),
    "row width not whole blocks": (lambda: patch("I", tensor_field(FIRST, "type"), BY_NAME["Q4_K"].id), E,
                                   rf"tensor '{FIRST}': row width 64 is not a multiple of the Q4_K block size 256"),
    "unaligned offset": (lambda: patch("Q", tensor_field(LAST, "offset"), 8 + LAST_OFFSET), E,
                         rf"tensor '{LAST}': offset {8 + LAST_OFFSET} is not a multiple of the alignment 32"),
    "offset past the end": (lambda: patch("Q", tensor_field(LAST, "offset"), 1 << 40), E,
                            rf"tensor '{LAST}': bytes \[\d+, \d+\) run past the end of the file"),
    "last tensor truncated": (lambda: BASE[:-1], E, rf"tensor '{LAST}': bytes .* run past the end"),
    "overlapping tensors": (two_tensors_overlapping, E,
                            rf"tensor '{BASE_TENSORS[2][0]}': bytes .* overlap tensor '{BASE_TENSORS[1][0]}'"),
    "duplicate tensor name": (lambda: rebuilt(tensors_fn=lambda t: t + [t[1]]), E,
                              rf"tensor '{BASE_TENSORS[1][0]}': appears twice"),
    # --- the dense model (spec §1, §2)
    "unknown architecture": (lambda: rebuilt(keys={"general.architecture": (G.STRING, "mamba")}), U,
                             r"metadata key 'general.architecture': architecture 'mamba' is not supported"),
    "architecture not a string": (lambda: rebuilt(keys={"general.architecture": (G.UINT32, 1)}), E,
                                  r"metadata key 'general.architecture': is u32, expected a string"),
    "no architecture": (lambda: rebuilt(keys={"general.architecture": None}), E,
                        r"metadata key 'general.architecture': missing"),
    "missing block_count": (lambda: rebuilt(keys={"llama.block_count": None}), E,
                            r"metadata key 'llama.block_count': missing"),
    "block_count a string": (lambda: rebuilt(keys={"llama.block_count": (G.STRING, "1")}), E,
                             r"metadata key 'llama.block_count': is string, expected an integer"),
    "block_count 0": (lambda: rebuilt(keys={"llama.block_count": (G.UINT32, 0)}), E,
                      r"metadata key 'llama.block_count': 0 is out of range"),
    "per-layer widths": (lambda: rebuilt(keys={"llama.feed_forward_length": (G.ARRAY, (G.UINT32, [128]))}), U,
                         r"metadata key 'llama.feed_forward_length': per-layer values are not supported"),
    "kv heads do not divide heads": (lambda: rebuilt(keys={"llama.attention.head_count_kv": (G.UINT32, 3)}), E,
                                     r"metadata key 'llama.attention.head_count_kv': 3 does not divide head_count 4"),
    "NaN epsilon": (lambda: rebuilt(keys={"llama.attention.layer_norm_rms_epsilon": (G.FLOAT32, float("nan"))}), E,
                    r"metadata key 'llama.attention.layer_norm_rms_epsilon': nan is out of range"),
    "odd rope dims": (lambda: rebuilt(keys={"llama.rope.dimension_count": (G.UINT32, 7)}), E,
                      r"metadata key 'llama.rope.dimension_count': 7 is odd"),
    "LongRoPE scaling": (lambda: rebuilt(keys={"llama.rope.scaling.type": (G.STRING, "longrope")}), U,
                         r"metadata key 'llama.rope.scaling.type': 'longrope' RoPE scaling is not supported"),
    "more experts used than exist": (lambda: rebuilt("qwen3moe", keys={"qwen3moe.expert_used_count": (G.UINT32, 5)}),
                                     E, r"metadata key 'qwen3moe.expert_used_count': 5 > expert_count 4"),
    "sigmoid routing": (lambda: rebuilt("qwen3moe", keys={"qwen3moe.expert_gating_func": (G.UINT32, 2)}), U,
                        r"metadata key 'qwen3moe.expert_gating_func': only softmax"),
    "missing tensor": (lambda: rebuilt(tensors_fn=without_tensor("blk.0.ffn_up.weight")), E,
                       r"tensor 'blk.0.ffn_up.weight': missing"),
    "missing embedding": (lambda: rebuilt(tensors_fn=without_tensor("token_embd.weight")), E,
                          r"tensor 'token_embd.weight': missing"),
    "mis-shaped tensor": (lambda: rebuilt(tensors_fn=replace_tensor("blk.0.attn_k.weight", ne=(64, 64))), E,
                          r"tensor 'blk.0.attn_k.weight': ne \[64, 64\] disagrees with the metadata "
                          r"\(expected \[64, 32\]\)"),
    "embedding narrower than d": (lambda: rebuilt(tensors_fn=replace_tensor("token_embd.weight", ne=(32, 64))), E,
                                  r"tensor 'token_embd.weight': ne \[32, 64\] disagrees with embedding_length 64"),
    "vocab_size disagrees with the embedding": (lambda: rebuilt(tokenizer=False,
                                                                keys={"llama.vocab_size": (G.UINT32, 65)}), E,
                                                r"tensor 'token_embd.weight': ne \[64, 64\] disagrees .*\[64, 65\]"),
    "fewer tokens than the vocabulary": (lambda: rebuilt(vocab=72, kvs_fn=lambda kvs: [
        kv if kv[0] != TOKENS else (TOKENS, G.ARRAY, (G.STRING, kv[2][1][:70])) for kv in kvs]), E,
                                         rf"metadata key '{TOKENS}': 70 tokens for a vocabulary of 72"),
    "tokens not an array": (lambda: rebuilt(keys={TOKENS: (G.UINT32, 64)}), E,
                            rf"metadata key '{TOKENS}': is not an array of strings"),
    "olmoe without its head": (lambda: rebuilt("olmoe", tensors_fn=without_tensor("output.weight")), E,
                               r"tensor 'output.weight': missing \(olmoe has no tied head\)"),
    "qwen2 without a bias": (lambda: rebuilt("qwen2", tensors_fn=without_tensor("blk.0.attn_v.bias")), E,
                             r"tensor 'blk.0.attn_v.bias': missing"),
    "unsupported quant type": (lambda: rebuilt(tensors_fn=replace_tensor("blk.0.attn_q.weight", type_name="MXFP4")),
                               U, r"tensor 'blk.0.attn_q.weight': tensor type MXFP4 is not supported"),
    "retired quant type": (lambda: rebuilt(tensors_fn=replace_tensor("blk.0.attn_q.weight", type_name="Q4_0_4_4")),
                           U, r"tensor 'blk.0.attn_q.weight': tensor type Q4_0_4_4 \(retired"),
    "F16 norm": (lambda: rebuilt(tensors_fn=replace_tensor("blk.0.ffn_norm.weight", type_name="F16")), U,
                 r"tensor 'blk.0.ffn_norm.weight': a F16 vector"),
    "a tensor the graph does not use": (lambda: rebuilt(tensors_fn=with_tensor("rope_factors_long.weight", (8,))), U,
                                        r"tensor 'rope_factors_long.weight': not part of the llama graph"),
    "rope_freqs on qwen2": (lambda: rebuilt("qwen2", tensors_fn=with_tensor("rope_freqs.weight", (8,))), U,
                            r"tensor 'rope_freqs.weight': not part of the qwen2 graph"),
}


def test_the_base_file_is_valid_and_the_cases_distinct():
    g = open_model(BASE)
    assert (g.arch, g.num_layers, g.vocab) == ("llama", 1, 64)
    built = [build() for build, _, _ in CASES.values()]
    assert len(set(built)) == len(built), "two cases build the same file"
    assert BASE not in built and len(CASES) >= 40


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_file(name):
    build, error, pattern = CASES[name]
    data = build()
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(NeedleError) as caught:
            open_model(data)
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert type(caught.value) is error, f"{name}: {type(caught.value).__name__}: {caught.value}"
    assert caught.match(pattern)
    assert elapsed < TIME_LIMIT_S
    assert peak < len(data) + ALLOCATION_SLACK


def test_a_file_cut_anywhere_is_a_container_error():
    """Every prefix up to a few bytes into the data section, then every 97th: truncation is
    named, never an IndexError or a struct.error, and never a valid file (the last tensor ends
    the base file exactly)."""
    cuts = list(range(LAYOUT.data_start + 8)) + list(range(LAYOUT.data_start + 8, len(BASE), 97))
    for cut in cuts:
        with pytest.raises(ContainerError, match=r"^(header|metadata|tensor)"):
            open_gguf(BASE[:cut])


def test_a_claim_of_many_layers_fails_at_the_first_missing_one_in_little_memory():
    data = rebuilt(keys={"llama.block_count": (G.UINT32, 1024)})
    tracemalloc.start()
    try:
        with pytest.raises(ContainerError, match=r"tensor 'blk.1.attn_norm.weight': missing"):
            open_model(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(data)  # listing 1024 layers' tensor names would take ~2 MB


# ----------------------------------------------------------------------------------- paths


def test_paths_that_are_not_regular_files_are_refused_without_waiting(tmp_path):
    import os

    import needle_wgpu
    from needle_wgpu import families

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # nobody writes: an open() that waits would hang the test
    for call in (lambda: open_gguf(fifo), lambda: families.magic(fifo), lambda: needle_wgpu.load(fifo),
                 lambda: open_gguf("/dev/zero"), lambda: open_gguf(tmp_path)):
        with pytest.raises(ContainerError, match="not a regular file"):
            call()


def test_a_huge_sparse_tail_is_never_read(tmp_path):
    """A valid file followed by 16 GiB of holes: only the bytes up to its last tensor are read."""
    from gguf_samples import dense_gguf

    data = dense_gguf("llama")
    path = tmp_path / "sparse.gguf"
    with open(path, "wb") as f:
        f.write(data)
        f.truncate(len(data) + (16 << 30))
    tracemalloc.start()
    try:
        f = open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f.file_size <= len(data) and peak < 4 * len(data) + (2 << 20)
