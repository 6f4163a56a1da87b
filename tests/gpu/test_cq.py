"""CQ prepare + dequant-matmul on the GPU vs the NumPy reference (§5.5), all code widths."""

import struct

import numpy as np
import pytest

from needle_wgpu.errors import DeviceLimitError
from needle_wgpu.formats import cact
from needle_wgpu.gpu import Plan, UniformArena, open_device
from needle_wgpu.kernels import cq
from needle_wgpu.reference.needle3 import cq as ref_cq

from .parity import rel

pytestmark = pytest.mark.gpu
GATE = 1e-5  # f32 sums in a different order than the reference: a few ulps of the row norm


def random_cq(rng, rows, cols, bits, group=128, name="w"):
    """A CQ record with random codes and norms (no encoder needed: any codes are valid)."""
    in_pad = -(-cols // group) * group
    row_bytes = in_pad * (2 if bits == cact.TERNARY else bits) // 8  # 1-bit: 8 codes a byte
    codes = rng.integers(0, 256, size=rows * row_bytes, dtype=np.uint8).tobytes()
    norms = rng.uniform(0.5, 2.0, size=rows * (in_pad // group)).astype("<f2").tobytes()
    blob = memoryview(codes + norms)
    return cact.Tensor(0, name, cact.CQ, (rows, cols), 0, len(blob), group, bits, blob)


class FakeCact:
    """Just enough of a CactFile for levels_bytes."""

    def __init__(self, tensor):
        self.codebook = tuple(np.sort(np.random.default_rng(1).normal(size=28)).astype(np.float32).tolist())
        self.tensors = {"w": tensor}

    def levels(self, bits):
        return cact.CactFile.levels(self, bits)


def run_matmul(device, tensors, x, *, row_start=0, rows=None, levels_source=None):
    fake = levels_source or FakeCact(tensors[0])
    levels = device.buffer(cq.LEVELS_BYTES, label="levels", data=cq.levels_bytes(fake))
    pack = cq.upload_pack(device, "test", tensors)
    T, width = x.shape
    in_pad = pack.in_pad
    rows = pack.rows - row_start if rows is None else rows
    xb = device.buffer(x.nbytes, label="x", data=x.astype(np.float32).tobytes())
    xh = device.buffer(4 * T * in_pad, label="xh")
    y = device.buffer(4 * T * rows, label="y")
    arena, plan = UniformArena(device), Plan(device, "test")
    cq.prepare(plan, arena, xb, xh, width=width, group=pack.group, positions=T, x_stride=width)
    cq.matmul(plan, arena, pack, levels, xh, y, positions=T, x_stride=in_pad, y_stride=rows,
              row_start=row_start, rows=rows)
    device.run(plan)
    got_xh = np.frombuffer(device.read(xh, 4 * T * in_pad), np.float32).reshape(T, in_pad)
    got = np.frombuffer(device.read(y, 4 * T * rows), np.float32).reshape(T, rows)
    return got_xh, got, fake, pack


def reference(tensors, fake, x, row_start=0, rows=None):
    mats = [ref_cq.CQMatrix.from_tensor(t, fake.levels(t.bits)) for t in tensors]
    y = np.concatenate([ref_cq.matmul(m, x) for m in mats], axis=1)
    rows = y.shape[1] - row_start if rows is None else rows
    return y[:, row_start : row_start + rows]


@pytest.fixture(params=["workgroup", "rowwise"])
def variant(request, device):
    """Run each test with both matmul variants: the GPU one and the CPU-adapter one."""
    saved = device.software_rasterizer
    device.software_rasterizer = request.param == "rowwise"
    yield device
    device.software_rasterizer = saved


@pytest.mark.parametrize("bits", [cact.BINARY, 2, 3, 4, cact.TERNARY])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_matmul_all_widths(variant, bits, T):
    device = variant
    rng = np.random.default_rng(bits * 100 + T)
    w = random_cq(rng, rows=45, cols=200, bits=bits)  # odd rows, width padded to 256
    x = rng.normal(size=(T, 200)).astype(np.float32)
    xh, got, fake, _ = run_matmul(device, [w], x)
    np.testing.assert_allclose(xh, ref_cq.prepare_input(x, 128), rtol=0, atol=2e-6 * np.abs(x).max())
    assert rel(got, reference([w], fake, x)) <= GATE


def test_pack_band_and_rows(variant):
    device = variant
    rng = np.random.default_rng(7)
    parts = [random_cq(rng, rows=r, cols=384, bits=4) for r in (4, 4, 16, 4, 4, 16)]
    x = rng.normal(size=(5, 384)).astype(np.float32)
    _, got, fake, _ = run_matmul(device, parts, x, row_start=24, rows=24)
    assert rel(got, reference(parts, fake, x, row_start=24, rows=24)) <= GATE


def test_pack_of_mixed_widths(variant):
    """Every record has its own width (§U b): a pack of five widths runs one band per width,
    and a row range across bands reads each band's rows at their own offset."""
    device = variant
    rng = np.random.default_rng(11)
    parts = [random_cq(rng, rows=r, cols=200, bits=b)
             for r, b in ((6, 1), (5, 2), (7, 3), (4, 4), (9, cact.TERNARY), (3, 4))]
    x = rng.normal(size=(5, 200)).astype(np.float32)
    _, got, fake, pack = run_matmul(device, parts, x)
    assert [band.bits for _, band in pack.bands] == [1, 2, 3, 4, cact.TERNARY, 4]
    assert rel(got, reference(parts, fake, x)) <= GATE
    _, got, _, _ = run_matmul(device, parts, x, row_start=8, rows=20)
    assert rel(got, reference(parts, fake, x, row_start=8, rows=20)) <= GATE


def test_mixed_pack_with_input_blocks(device):
    """The engram [key; value] pack: blocks of rows read their own block of xh, with the key and
    value projections of one site at different widths (a band boundary inside a block)."""
    rng = np.random.default_rng(12)
    d, T = 8, 3
    parts = [random_cq(rng, rows=d, cols=128, bits=b) for b in (3, 1, 4, 4)]  # 2 sites x (key, value)
    fake = FakeCact(parts[0])
    levels = device.buffer(cq.LEVELS_BYTES, label="levels", data=cq.levels_bytes(fake))
    pack = cq.upload_pack(device, "kv", parts)
    xs = rng.normal(size=(2, T, 128)).astype(np.float32)  # [site][t][in]
    xh_data = np.stack([ref_cq.prepare_input(x, 128) for x in xs])
    xh = device.buffer(xh_data.nbytes, label="xh", data=xh_data.tobytes())
    y = device.buffer(4 * T * 4 * d, label="y")
    arena, plan = UniformArena(device), Plan(device, "test")
    cq.matmul(plan, arena, pack, levels, xh, y, positions=T, x_stride=128, y_stride=4 * d,
              x_block_rows=2 * d, x_block_stride=T * 128)
    device.run(plan)
    got = np.frombuffer(device.read(y, 4 * T * 4 * d), np.float32).reshape(T, 4 * d)
    want = np.concatenate([reference([p], fake, xs[i // 2]) for i, p in enumerate(parts)], axis=1)
    assert rel(got, want) <= GATE


def test_fixture_tensors(variant, fixture_dir):
    device = variant
    f = cact.load(fixture_dir / "tiny.cact")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, 256)).astype(np.float32)
    for name in ("embedding", "layers.0.q_proj", "layers.3.out_proj"):
        t = f[name]
        _, got, _, _ = run_matmul(device, [t], x, levels_source=f)
        want = ref_cq.matmul(ref_cq.CQMatrix.from_tensor(t, f.levels(t.bits)), x)
        assert rel(got, want) <= GATE, name


@pytest.mark.parametrize("width", [768, 200])
def test_prepare_deploy(device, width):
    """act_quant: xh = prepare_input(A8(x)), one scale per position (§4.9 point 6); a zero row
    keeps scale 1 and stays zero."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from a8_checks import check_a8, unprepare

    T = 4
    x = (np.random.default_rng(width).normal(size=(T, width)) * np.array([[0.1], [3.0], [40.0], [0.0]])).astype(
        np.float32)
    in_pad = -(-width // 128) * 128
    xb = device.buffer(x.nbytes, label="x", data=x.tobytes())
    xh = device.buffer(4 * T * in_pad, label="xh")
    arena, plan = UniformArena(device), Plan(device, "prepare")
    cq.prepare(plan, arena, xb, xh, width=width, group=128, positions=T, x_stride=width, act_quant=True)
    device.run(plan)
    got = np.frombuffer(device.read(xh, 4 * T * in_pad), np.float32).reshape(T, in_pad)
    check_a8(unprepare(got[:3], width), x[:3])
    assert not got[3].any()


def test_split_above_binding_limit(fixture_dir):
    """A tensor larger than maxStorageBufferBindingSize is split along rows and still exact."""
    f = cact.load(fixture_dir / "tiny.cact")
    small = open_device(max_storage_binding=16384)
    t = f["embedding"]  # 67,584 bytes: five slices at this limit
    x = np.random.default_rng(4).normal(size=(2, 256)).astype(np.float32)
    _, got, _, pack = run_matmul(small, [t], x, levels_source=f)
    assert len(pack.slices) >= 4
    want = ref_cq.matmul(ref_cq.CQMatrix.from_tensor(t, f.levels(t.bits)), x)
    assert rel(got, want) <= GATE
    with pytest.raises(DeviceLimitError):
        small.bind_group(small.pipeline(cq.KernelKey("cq_prepare", consts=(("GROUP", 128), ("CAP", 256), ("ACT_QUANT", False),
                         ("FWHT_SCALE", cq.fwht_scale(128))))), [small.buffer(64, label="u", usage="uniform"),
                         small.buffer(40000, label="big"), small.buffer(64, label="o")])


@pytest.mark.parametrize("bits", [cact.BINARY, 2, 3, 4, cact.TERNARY])
def test_positions_are_bitwise_one_position(variant, bits):
    """A position's row over several positions has the very bits it has alone (a batch of
    decode steps is each sequence's step alone, models/batch.py)."""
    device = variant
    rng = np.random.default_rng(bits * 7 + 1)
    w = random_cq(rng, rows=45, cols=200, bits=bits)
    x = rng.normal(size=(6, 200)).astype(np.float32)
    _, together, _, _ = run_matmul(device, [w], x)
    for t in range(len(x)):
        _, alone, _, _ = run_matmul(device, [w], x[t:t + 1])
        assert together[t].tobytes() == alone[0].tobytes(), f"position {t}"
