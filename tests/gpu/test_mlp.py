"""The block tail (post norm, gated residual, HadaMLP, scatter_up, cell) on the GPU vs the NumPy
reference (§4.5 items 10-13, §4.6, §4.7, §4.8).

The tiny fixture's real layer parameters (16 x 16 Kronecker factors), and a synthetic parameter
set with ba != bb (hada_n 512 = 16 x 32), rank 5, d = 384 and 3 lanes.
"""

import numpy as np
import pytest

from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.formats import cact
from needle_wgpu.gpu import Plan, UniformArena
from needle_wgpu.kernels.needle3 import mhc, mlp
from needle_wgpu.gpu.device import Binding
from needle_wgpu.kernels.needle3.fp16_store import Fp16Store, Fp16Window, permutation_words
from needle_wgpu.reference.needle3 import attention as ref_attention
from needle_wgpu.reference.needle3 import mhc as ref_mhc
from needle_wgpu.reference.needle3.hada_mlp import HadaParams, hada_mlp
from needle_wgpu.reference.ops import sinkhorn, zc_rms_norm
from needle_wgpu.reference.needle3.weights import load_weights

from .parity import download, rel, upload

pytestmark = pytest.mark.gpu
GATE = 1e-5  # f32 sums (norms, softmax, Kronecker products) in a different order: a few ulps
T = 5
SENTINEL = -7.0


class TinyModel:
    def __init__(self, device, path):
        self.file = cact.load(path)
        self.weights = load_weights(self.file)
        self.store = Fp16Store(device, self.file)
        self.perm = upload(device, np.frombuffer(permutation_words(self.file), np.uint8), "perm")
        self.shape = mlp.HadaShape.from_cact(self.file)
        self.lanes = self.file.geometry.mhc_lanes
        self.layers = self.file.geometry.num_layers

    def hada(self, layer):
        return self.weights.hada[layer]

    def post_norm(self, layer):
        return self.weights.attention[layer].post_norm, self.weights.attention[layer].attn_gate


class SyntheticModel:
    """Random FP16 layer parameters in an Fp16Store look-alike, for sizes the fixture lacks."""

    def __init__(self, device, rng, d=384, ba=16, bb=32, rank=5, lanes=3):
        count = ba * bb
        shapes = {"post_norm": (d,), "attn_gate": (1,), "pre_hada": (d,), "d1": (count,), "d2": (count,),
                  "b2": (count,), "d3": (count,), "d4": (count,), "w1a": (ba, ba), "w1b": (bb, bb),
                  "w2a": (ba, ba), "w2b": (bb, bb), "w3a": (ba, ba), "w3b": (bb, bb), "cond_v": (d, rank),
                  "cond_u": (rank, count)}
        self.offsets, blobs, size = {}, [], 0
        self.values = {}
        for name, shp in shapes.items():
            scale = {"w1a": ba, "w2a": ba, "w3a": ba, "w1b": bb, "w2b": bb, "w3b": bb}.get(name)
            if scale:  # Walsh-like magnitude: entries ±1/sqrt(size), then perturbed
                value = rng.choice([-1.0, 1.0], size=shp) / np.sqrt(scale) + rng.normal(size=shp) * 0.05
            elif name in ("d1", "d2", "d3", "d4"):
                value = rng.uniform(0.5, 1.5, size=shp)
            else:
                value = rng.normal(size=shp) * 0.3
            half = value.astype("<f2")
            self.values[name] = half.astype(np.float32)
            self.offsets[f"layers.0.{name}"] = size // 2
            blob = half.tobytes()
            blobs.append(blob + b"\0" * (-len(blob) % 4))
            size += len(blobs[-1])
        self.store = type("Store", (), {})()
        self.store.buffer = upload(device, np.frombuffer(b"".join(blobs), np.uint8), "fp16")
        self.store.offset = self.offsets.__getitem__
        self.store.layer_window = lambda layer: Fp16Window(Binding(self.store.buffer), 0, self.offsets)
        self.p1, self.p2 = rng.permutation(count), rng.permutation(count)
        self.perm = upload(device, np.concatenate((self.p1, self.p2)).astype("<u4"), "perm")
        self.shape = mlp.HadaShape(d, count, rank, ba, bb)
        self.lanes, self.layers = lanes, 1

    def hada(self, layer):
        v = self.values
        return HadaParams(**{k: v[k] for k in ("pre_hada", "d1", "d2", "b2", "d3", "d4", "w1a", "w1b", "w2a",
                                                "w2b", "w3a", "w3b", "cond_v", "cond_u")}, p1=self.p1, p2=self.p2)

    def post_norm(self, layer):
        return self.values["post_norm"], float(self.values["attn_gate"][0])


@pytest.fixture(scope="module")
def tiny(fixture_dir, device):
    return TinyModel(device, fixture_dir / "tiny.cact")


def run_tail(device, model, layer, rng, *, isolate=False, with_cells=True):
    """mlp_mix on random inputs; returns (lanes, cells) from the GPU and the reference."""
    n, d, L = model.lanes, model.shape.width, model.layers
    lanes = (rng.normal(size=(T, n, d)) * rng.uniform(1.0, 20.0, size=(T, n, 1))).astype(np.float32)
    attn_out = (rng.normal(size=(T, d)) * 4.0).astype(np.float32)
    u = (rng.normal(size=(T, d)) * 8.0).astype(np.float32)
    bx = (u + rng.normal(size=(T, d)) * 3.0).astype(np.float32)
    if isolate:  # X' = y exactly: the MLP path is not hidden under the lane mix
        hpost, hres = np.ones((T, n), np.float32), np.zeros((T, n, n), np.float32)
    else:
        hpost = rng.uniform(0.0, 2.0, size=(T, n)).astype(np.float32)
        hres = sinkhorn(rng.normal(size=(T, n, n)).astype(np.float32) + 2.0 * np.eye(n, dtype=np.float32))
    state = mhc.mhc_state(device, T + 1, d, n)
    host = np.zeros(mhc.MhcState.floats(T + 1, d, n), np.float32)
    host[state.u_at : state.u_at + T * d] = u.ravel()
    host[state.bx_at : state.bx_at + T * d] = bx.ravel()
    host[state.hmix_at : state.hmix_at + T * (n + n * n)] = np.concatenate(
        (hpost, hres.reshape(T, n * n)), axis=1).ravel()
    device.write(state.buffer, host.tobytes())
    lanes_buf = upload(device, lanes, "lanes")
    cells = cells_buf = None
    if with_cells:
        cells = np.full((T, L + 1, d), SENTINEL, np.float32)
        cells_buf = upload(device, cells, "cells")
    arena, plan = UniformArena(device), Plan(device, "mlp_mix")
    mlp.mlp_mix(plan, arena, model.store, model.perm, upload(device, attn_out, "a"), state, lanes_buf,
                layer=layer, shape=model.shape, lanes_n=n, positions=T, cells=cells_buf,
                cell_stride=(L + 1) * d if with_cells else None)
    device.run(plan)
    got_lanes = download(device, lanes_buf, (T, n, d))
    got_cells = download(device, cells_buf, (T, L + 1, d)) if with_cells else None

    post_norm, attn_gate = model.post_norm(layer)
    hada = model.hada(layer)
    bx = ref_attention.residual(bx, zc_rms_norm(attn_out, post_norm), attn_gate)
    bx = bx + hada_mlp(zc_rms_norm(bx, hada.pre_hada), hada)
    want_lanes = ref_mhc.scatter_up(lanes, hres, hpost, bx - u)
    want_cells = None
    if with_cells:
        want_cells = cells.copy()
        want_cells[:, layer + 1] = ref_mhc.lane_mean(want_lanes)
    return got_lanes, want_lanes, got_cells, want_cells


@pytest.mark.parametrize("layer", [0, 3])
def test_mlp_mix_tiny(device, tiny, layer):
    got_lanes, want_lanes, got_cells, want_cells = run_tail(device, tiny, layer, np.random.default_rng(layer))
    assert rel(got_lanes, want_lanes) <= GATE
    assert rel(got_cells[:, layer + 1], want_cells[:, layer + 1]) <= GATE
    others = [i for i in range(tiny.layers + 1) if i != layer + 1]
    assert (got_cells[:, others] == SENTINEL).all()  # only this layer's cell is written


@pytest.mark.parametrize("layer", [1, 2])
def test_mlp_block_delta_tiny(device, tiny, layer):
    """hpost = 1, Hres = 0: the lanes receive y = bx − u itself (the MLP output is not diluted)."""
    got, want, _, _ = run_tail(device, tiny, layer, np.random.default_rng(20 + layer), isolate=True)
    assert rel(got, want) <= GATE


SYNTHETIC = [
    dict(d=384, ba=16, bb=32, rank=5, lanes=3),  # ba != bb, d not a multiple of 256
    dict(d=768, ba=32, bb=32, rank=8, lanes=4),  # the shipped sizes (13 KiB of workgroup memory)
    dict(d=200, ba=32, bb=8, rank=1, lanes=2),  # ba > bb, a rank-1 cond (softmax of one logit)
]


@pytest.mark.parametrize("isolate", [False, True])
@pytest.mark.parametrize("sizes", SYNTHETIC, ids=lambda s: "d{d}-{ba}x{bb}-r{rank}-n{lanes}".format(**s))
def test_mlp_mix_synthetic(device, sizes, isolate):
    """Sizes the fixture lacks, without cells (the placeholder binding)."""
    model = SyntheticModel(device, np.random.default_rng(sizes["d"]), **sizes)
    got, want, _, _ = run_tail(device, model, 0, np.random.default_rng(6), isolate=isolate, with_cells=False)
    assert rel(got, want) <= GATE


@pytest.mark.parametrize("sizes", [dict(width=24, hada_n=24, rank=2, ba=4, bb=6),  # ba, bb of §4.6 for n = 24
                                   dict(width=18, hada_n=64, rank=2, ba=8, bb=8)])
def test_hada_shape_needs_multiples_of_4(sizes):
    with pytest.raises(UnsupportedModelError, match="multiples of 4"):
        mlp.HadaShape(**sizes).check()
