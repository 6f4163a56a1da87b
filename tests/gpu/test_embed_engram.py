"""Embedding, Engram fetch/conv and the final norm on the GPU vs the NumPy reference.

Fixture: tiny.cact (d 256, 4 tables of sub_dim 64 < the 128 group, 257 slots, 2 sites).
"""

import dataclasses
import math
import struct

import numpy as np
import pytest

from needle_wgpu.errors import DeviceLimitError
from needle_wgpu.formats import cact
from needle_wgpu.gpu import Plan, UniformArena, open_device
from needle_wgpu.kernels import cq
from needle_wgpu.kernels.needle3 import embed as embed_ops, engram as engram_ops
from needle_wgpu.kernels.needle3.fp16_store import Fp16Store
from needle_wgpu.reference import ops as ref_ops
from needle_wgpu.reference.needle3 import cq as ref_cq, engram as ref_engram, mhc as ref_mhc
from needle_wgpu.reference.needle3.weights import float_array

from .parity import rel

pytestmark = pytest.mark.gpu
F32 = np.float32
GATE = 1e-5  # max|d| / RMS(ref): f32 sums in another order than NumPy (a few ulps)


class Gpu:
    """The fixture's weights on a device, as the model uploads them."""

    def __init__(self, device, f):
        self.device, self.f, self.g = device, f, f.geometry
        self.levels = device.buffer(cq.LEVELS_BYTES, label="levels", data=cq.levels_bytes(f))
        self.fp16 = Fp16Store(device, f)
        self.embedding = cq.upload_pack(device, "embedding", [f["embedding"]])
        sites = range(len(self.g.engram_sites))
        self.tables = [cq.upload_pack(device, f"engram.{s}.tables", [f[f"engram.{s}.tables"]]) for s in sites]
        self.kv = cq.upload_pack(device, "engram.kv",
                                 [f[f"engram.{s}.{p}"] for s in sites for p in ("key_proj", "value_proj")])

    def cq_matrix(self, name):
        t = self.f[name]
        return ref_cq.CQMatrix.from_tensor(t, self.f.levels(t.bits))

    def read(self, buffer, count, dtype=np.float32):
        return read(self.device, buffer, count, dtype)


def read(device, buffer, count, dtype=np.float32):
    return np.frombuffer(device.read(buffer, 4 * count), dtype).copy()


@pytest.fixture(scope="module")
def tiny(fixture_dir):
    return cact.load(fixture_dir / "tiny.cact")


@pytest.fixture(scope="module")
def gpu(device, tiny):
    return Gpu(device, tiny)


def write_step(device, step, pos0):
    device.write(step, struct.pack("<4I", pos0, 0, 0, 0))


# ---------------------------------------------------------------------------------- embed


def expected_embedding(gpu, ids):
    g = gpu.g
    rows = np.minimum(np.asarray(ids, dtype=np.uint64), g.vocab - 1).astype(np.int64)
    return ref_cq.dequantize_rows(gpu.cq_matrix("embedding"), rows) * F32(np.sqrt(F32(g.d_model)))


def run_embed(device, g, levels, pack, ids, pos0, cells):
    T = len(ids)
    tokens = device.buffer(4 * (pos0 + T + 4), label="tokens")
    device.write(tokens, struct.pack(f"<{T}I", *ids), 4 * pos0)
    step = device.buffer(16, label="step", usage="uniform")
    write_step(device, step, pos0)
    lanes = device.buffer(4 * T * g.mhc_lanes * g.d_model, label="lanes")
    cell_buffer = device.buffer(4 * T * (g.num_layers + 1) * g.d_model, label="cells") if cells else None
    arena, plan = UniformArena(device), Plan(device, "embed")
    embed_ops.embed(plan, arena, step, geometry=g, pack=pack, levels=levels, tokens=tokens, lanes=lanes,
                    positions=T, cells=cell_buffer)
    device.run(plan)
    got = read(device, lanes, T * g.mhc_lanes * g.d_model).reshape(T, g.mhc_lanes, g.d_model)
    got_cells = None
    if cells:
        got_cells = read(device, cell_buffer, T * (g.num_layers + 1) * g.d_model).reshape(T, g.num_layers + 1, -1)
    return got, got_cells


IDS = [2, 0, 511, 512, 70000, 0xFFFFFFFF, 17, 300, 2]  # 512 and above clamp to vocab - 1 (§0 item 1)


def test_embed_lanes_and_cells(device, gpu):
    got, cells = run_embed(device, gpu.g, gpu.levels, gpu.embedding, IDS, pos0=5, cells=True)
    want = expected_embedding(gpu, IDS)
    for j in range(gpu.g.mhc_lanes):
        assert rel(got[:, j], want) <= GATE
    assert np.array_equal(got[:, 0], got[:, -1])
    assert rel(cells[:, 0], want) <= GATE
    assert not cells[:, 1:].any()  # only cell 0 is the embedding's
    assert np.array_equal(got[3, 0], got[2, 0])  # 512 reads row 511


def test_embed_matches_rust_cells(device, gpu, fixture_dir):
    """Cell 0 of the independent engine's fixture is the scaled embedding (§4.8)."""
    ids = [2, 242, 262, 386, 486, 17, 73]  # the fixture README's len7 ids
    rust = np.fromfile(fixture_dir / "tiny.len7.cells.f32.bin", "<f4").reshape(7, gpu.g.num_layers + 1, -1)
    _, cells = run_embed(device, gpu.g, gpu.levels, gpu.embedding, ids, pos0=0, cells=True)
    assert rel(cells[:, 0], rust[:, 0]) <= GATE


def test_embed_without_cells(device, gpu):
    got, _ = run_embed(device, gpu.g, gpu.levels, gpu.embedding, IDS[:4], pos0=0, cells=False)
    assert rel(got[:, 1], expected_embedding(gpu, IDS[:4])) <= GATE


class RandomLevels:
    """Just enough of a CactFile for levels_bytes: a sorted random codebook."""

    def __init__(self, tensor):
        self.codebook = tuple(np.sort(np.random.default_rng(1).normal(size=28) / 11.3).astype(F32).tolist())
        self.tensors = {"embedding": tensor}

    def levels(self, bits):
        return cact.CactFile.levels(self, bits)


@pytest.mark.parametrize("bits", [2, 3, 4, cact.TERNARY])
def test_embed_any_width(device, gpu, bits):
    """Any code width, and a width d that is not a multiple of the group (rows truncated)."""
    vocab, d, group = 40, 200, 128
    row_bytes = 256 * (2 if bits == cact.TERNARY else bits) // 8
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 256, size=vocab * row_bytes, dtype=np.uint8).tobytes()
    norms = rng.uniform(0.5, 2.0, size=vocab * 2).astype("<f2").tobytes()
    blob = memoryview(codes + norms)
    tensor = cact.Tensor(0, "embedding", cact.CQ, (vocab, d), 0, len(blob), group, bits, blob)
    source = RandomLevels(tensor)
    levels = device.buffer(cq.LEVELS_BYTES, label="levels", data=cq.levels_bytes(source))
    pack = cq.upload_pack(device, "embedding", [tensor])
    g = dataclasses.replace(gpu.g, vocab=vocab, out_vocab=vocab, d_model=d)
    ids = [0, 39, 40, 7, 1 << 31]
    got, _ = run_embed(device, g, levels, pack, ids, pos0=1, cells=False)
    matrix = ref_cq.CQMatrix.from_tensor(tensor, source.levels(bits) if bits != cact.TERNARY else ())
    rows = np.minimum(np.asarray(ids), vocab - 1)
    want = ref_cq.dequantize_rows(matrix, rows) * F32(np.sqrt(F32(d)))
    assert got.shape == (len(ids), g.mhc_lanes, d)
    assert rel(got[:, 3], want) <= GATE


def test_embed_split_pack(tiny):
    """The pack split along rows over several bindings: one dispatch per slice, same result."""
    small = open_device(max_storage_binding=16384)
    split = Gpu(small, tiny)
    assert len(split.embedding.slices) >= 4
    ids = [0, 300, 511, 70000]  # rows in the first, a middle and the last slice (lanes: 16 KiB)
    got, _ = run_embed(small, split.g, split.levels, split.embedding, ids, pos0=3, cells=False)
    assert rel(got[:, 2], expected_embedding(split, ids)) <= GATE


# ---------------------------------------------------------------------------------- engram


def shifted(keep, offset):
    """keep[p - offset], False where p < offset (upstream's mask diagonal, §U a)."""
    return np.concatenate((np.zeros(min(offset, len(keep)), bool), keep[: max(len(keep) - offset, 0)]))


def engram_reference(gpu, ids, pad_masked=False):
    """Per site: idx, valid, eh (prepared fetch), K, Vraw and V for positions 0..len(ids)-1;
    ``pad_masked``: tables whose n-gram starts at id 0 and value taps on id 0 dropped (§U a)."""
    g = gpu.g
    back = g.engram_max_order - 1
    idx = ref_engram.hash_indices(np.asarray(ids, np.uint64), np.zeros(back, np.uint64), g.engram_orders,
                                  g.engram_heads, g.engram_seed_heads, g.engram_slots)
    positions = np.arange(len(ids))
    valid = ref_engram.hash_validity(positions, g.engram_orders, g.engram_heads)
    value_keep = None
    if pad_masked:
        keep = np.asarray(ids) != 0
        orders = np.repeat(np.asarray(g.engram_orders), g.engram_heads)
        valid = valid & np.stack([shifted(keep, o - 1) for o in orders], axis=1)
        value_keep = np.stack([shifted(keep, j * g.engram_max_order) for j in range(g.engram_conv_taps)])
    sites = []
    for s in range(len(g.engram_sites)):
        tables = gpu.cq_matrix(f"engram.{s}.tables")
        fetched = ref_engram.fetch(tables, idx, valid, g.engram_slots, g.engram_sub_dim)
        eh = ref_cq.prepare_input(fetched, tables.group)
        keys, raw = ref_engram.project(gpu.cq_matrix(f"engram.{s}.key_proj"), gpu.cq_matrix(f"engram.{s}.value_proj"),
                                       fetched)
        taps = float_array(gpu.f[f"engram.{s}.taps"])
        values = ref_engram.value_conv(raw, taps, g.engram_conv_dilation, g.engram_max_order, positions,
                                       tap_keep=value_keep)
        sites.append({"eh": eh, "k": keys, "vraw": raw, "v": values})
    return idx, valid, sites


class EngramRun:
    """The chunk pipeline of docs/gpu-layout.md rows 2-4, with prebuilt plans per chunk size."""

    def __init__(self, device, gpu, ids, max_chunk, ring, pad_masked=False):
        g = gpu.g
        self.pad_masked = pad_masked
        self.device, self.gpu, self.g = device, gpu, g
        self.sites, self.d = len(g.engram_sites), g.d_model
        self.d_pad = -(-g.d_model // 128) * 128
        self.tokens = device.buffer(4 * (len(ids) + 1), label="tokens",
                                    data=struct.pack(f"<{len(ids)}I", *ids))
        self.step = device.buffer(16, label="step", usage="uniform")
        T = max_chunk
        self.eh = device.buffer(4 * self.sites * T * self.d_pad, label="eh")
        self.ekv = device.buffer(4 * T * self.sites * 2 * self.d, label="ekv")
        self.ev = device.buffer(4 * T * self.sites * self.d, label="ev")
        self.slots = device.buffer(4 * T * g.num_engram_tables, label="slots")
        self.ring_size = ring
        self.ring = device.buffer(4 * self.sites * ring * self.d, label="engram_ring")
        self.plans = {}

    def plan(self, T):
        if T not in self.plans:
            g, gpu, dev = self.g, self.gpu, self.device
            arena, plan = UniformArena(dev), Plan(dev, f"engram T={T}")
            engram_ops.hashes(plan, arena, self.step, geometry=g, tables=gpu.tables[0], tokens=self.tokens,
                              slots=self.slots, positions=T)
            for s in range(self.sites):
                engram_ops.fetch(plan, arena, self.step, geometry=g, site=s, tables=gpu.tables[s],
                                 levels=gpu.levels, tokens=self.tokens, eh=self.eh, positions=T,
                                 pad_mask=self.pad_masked)
            cq.matmul(plan, arena, gpu.kv, gpu.levels, self.eh, self.ekv, positions=T, x_stride=self.d_pad,
                      y_stride=self.sites * 2 * self.d, x_block_rows=2 * self.d, x_block_stride=T * self.d_pad)
            engram_ops.conv(plan, arena, self.step, geometry=g, fp16_store=gpu.fp16, ekv=self.ekv, ring=self.ring,
                            ring_size=self.ring_size, ev=self.ev, positions=T,
                            pad_tokens=self.tokens if self.pad_masked else None)
            self.plans[T] = plan
        return self.plans[T]

    def chunk(self, pos0, T):
        write_step(self.device, self.step, pos0)
        self.device.run(self.plan(T))
        read = self.gpu.read
        S, d = self.sites, self.d
        return {
            "slots": read(self.slots, T * self.g.num_engram_tables, np.uint32).reshape(T, -1),
            "eh": read(self.eh, S * T * self.d_pad).reshape(S, T, self.d_pad),
            "ekv": read(self.ekv, T * S * 2 * d).reshape(T, S, 2, d),
            "ev": read(self.ev, T * S * d).reshape(T, S, d),
        }


CHUNKS = [(0, 9), (9, 12), (21, 1), (22, 1), (23, 1), (24, 1)]  # prefill 0..20 in two chunks, then decode


@pytest.fixture(scope="module")
def engram_runs(device, gpu):
    rng = np.random.default_rng(11)
    ids = rng.integers(0, gpu.g.vocab, size=25).tolist()
    ids[4], ids[13] = 70000, 0xFFFFFFFF  # raw ids above the vocabulary hash as themselves (§0 item 1)
    ring = engram_ops.ring_slots_needed(gpu.g, 12)  # the smallest safe ring: 12 + 3·3 = 21
    run = EngramRun(device, gpu, ids, max_chunk=12, ring=ring)
    outputs = [(pos0, T, run.chunk(pos0, T)) for pos0, T in CHUNKS]
    return ids, outputs


def test_hash_indices_exact(gpu, engram_runs):
    ids, outputs = engram_runs
    idx, valid, _ = engram_reference(gpu, ids)
    for pos0, T, out in outputs:
        got = out["slots"]
        assert np.array_equal(got & 0x7FFFFFFF, idx[pos0 : pos0 + T]), pos0
        assert np.array_equal((got >> 31) == 0, valid[pos0 : pos0 + T]), pos0
    assert not valid[0].any() and valid[1, :2].all() and not valid[1, 2:].any() and valid[2].all()


def test_fetch_prepared(gpu, engram_runs):
    ids, outputs = engram_runs
    _, _, sites = engram_reference(gpu, ids)
    for pos0, T, out in outputs:
        for s, site in enumerate(sites):
            want = site["eh"][pos0 : pos0 + T]
            assert rel(out["eh"][s], want) <= GATE, (pos0, s)
    assert not outputs[0][2]["eh"][:, 0].any()  # position 0: no table is valid yet


def test_projections_and_conv_across_chunks(gpu, engram_runs):
    """K/Vraw by the shared cq_matmul, then V across the chunk boundary and the decode steps."""
    ids, outputs = engram_runs
    _, _, sites = engram_reference(gpu, ids)
    for pos0, T, out in outputs:
        for s, site in enumerate(sites):
            assert rel(out["ekv"][:, s, 0], site["k"][pos0 : pos0 + T]) <= GATE
            assert rel(out["ekv"][:, s, 1], site["vraw"][pos0 : pos0 + T]) <= GATE
            assert rel(out["ev"][:, s], site["v"][pos0 : pos0 + T]) <= GATE, (pos0, s)


def test_pad_mask_in_fetch_and_conv(device, gpu):
    """With the pad mask (upstream's hidden cells, §U a): a table whose n-gram starts at id 0
    fetches zeros and a value tap on id 0 is skipped, across a chunk edge and decode steps;
    the unmasked values differ, so the test sees the mask."""
    rng = np.random.default_rng(12)
    ids = rng.integers(4, gpu.g.vocab, size=25).tolist()
    for p in (0, 5, 8, 9, 15, 21):
        ids[p] = 0
    run = EngramRun(device, gpu, ids, max_chunk=12, ring=engram_ops.ring_slots_needed(gpu.g, 12), pad_masked=True)
    _, _, sites = engram_reference(gpu, ids, pad_masked=True)
    _, _, plain = engram_reference(gpu, ids)
    assert rel(plain[0]["v"], sites[0]["v"]) > 1e-2
    for pos0, T in CHUNKS:
        out = run.chunk(pos0, T)
        for s, site in enumerate(sites):
            assert rel(out["eh"][s], site["eh"][pos0 : pos0 + T]) <= GATE, (pos0, s)
            assert rel(out["ev"][:, s], site["v"][pos0 : pos0 + T]) <= GATE, (pos0, s)


def test_conv_ring_too_small(device, gpu):
    arena, plan = UniformArena(device), Plan(device, "x")
    scratch = device.buffer(64, label="scratch")
    with pytest.raises(DeviceLimitError):
        engram_ops.conv(plan, arena, scratch, geometry=gpu.g, fp16_store=gpu.fp16, ekv=scratch, ring=scratch,
                        ring_size=engram_ops.ring_slots_needed(gpu.g, 8) - 1, ev=scratch, positions=8)


# ---------------------------------------------------------------------------------- final norm


def test_final_norm(device, gpu):
    g = gpu.g
    T, n, d = 5, g.mhc_lanes, g.d_model
    lanes = np.random.default_rng(5).normal(scale=3.0, size=(T, n, d)).astype(F32)
    lanes[2] *= 1e-3  # a small position: the epsilon inside the root matters a little
    lane_buffer = device.buffer(lanes.nbytes, label="lanes", data=lanes.tobytes())
    d_pad = -(-d // 128) * 128
    xfh = device.buffer(4 * T * d_pad, label="xfh")
    arena, plan = UniformArena(device), Plan(device, "final_norm")
    embed_ops.final_norm(plan, arena, geometry=g, fp16_store=gpu.fp16, lanes=lane_buffer, xfh=xfh, positions=T,
                         group=128)
    device.run(plan)
    got = gpu.read(xfh, T * d_pad).reshape(T, d_pad)
    scale = float_array(gpu.f["final_norm"])
    want = ref_cq.prepare_input(ref_ops.zc_rms_norm(ref_mhc.lane_mean(lanes), scale), 128)
    for t in range(T):  # per position: position 2 is a thousand times smaller
        assert rel(got[t], want[t]) <= GATE, t


def _a8_checks():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import a8_checks

    return a8_checks


def test_final_norm_deploy(device, gpu):
    """act_quant: xfh = prepare_input(A8(x_f)) (§4.9 point 7)."""
    a8 = _a8_checks()
    g = gpu.g
    T, n, d = 5, g.mhc_lanes, g.d_model
    lanes = np.random.default_rng(6).normal(scale=3.0, size=(T, n, d)).astype(F32)
    lane_buffer = device.buffer(lanes.nbytes, label="lanes", data=lanes.tobytes())
    d_pad = -(-d // 128) * 128
    xfh = device.buffer(4 * T * d_pad, label="xfh")
    arena, plan = UniformArena(device), Plan(device, "final_norm")
    embed_ops.final_norm(plan, arena, geometry=g, fp16_store=gpu.fp16, lanes=lane_buffer, xfh=xfh, positions=T,
                         group=128, act_quant=True)
    device.run(plan)
    got = gpu.read(xfh, T * d_pad).reshape(T, d_pad)
    scale = float_array(gpu.f["final_norm"])
    a8.check_a8(a8.unprepare(got, d), ref_ops.zc_rms_norm(ref_mhc.lane_mean(lanes), scale))


def test_fetch_deploy(device, gpu):
    """act_quant: eh = prepare_input(A8(e_p)) (§4.9 point 1), the hash and the rows unchanged."""
    a8 = _a8_checks()
    g = gpu.g
    ids = np.random.default_rng(12).integers(0, g.vocab, size=9).tolist()
    run = EngramRun(device, gpu, ids, max_chunk=9, ring=engram_ops.ring_slots_needed(g, 9))
    dev = device
    arena, plan = UniformArena(dev), Plan(dev, "engram fetch deploy")
    for s in range(run.sites):
        engram_ops.fetch(plan, arena, run.step, geometry=g, site=s, tables=gpu.tables[s], levels=gpu.levels,
                         tokens=run.tokens, eh=run.eh, positions=9, act_quant=True)
    write_step(dev, run.step, 0)
    dev.run(plan)
    eh = gpu.read(run.eh, run.sites * 9 * run.d_pad).reshape(run.sites, 9, run.d_pad)
    idx, valid, _ = engram_reference(gpu, ids)
    width = g.num_engram_tables * g.engram_sub_dim
    for s in range(run.sites):
        fetched = ref_engram.fetch(gpu.cq_matrix(f"engram.{s}.tables"), idx, valid, g.engram_slots, g.engram_sub_dim)
        a8.check_a8(a8.unprepare(eh[s], width)[1:], fetched[1:])  # position 0 fetches nothing (all zero)
        assert not eh[s, 0].any()


def test_sqrt_d_constant():
    assert embed_ops.f32(math.sqrt(768)) == F32(np.sqrt(F32(768)))
