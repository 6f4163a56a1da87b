"""mHC lane norm and mix_down on the GPU vs the NumPy reference (§4.4, §4.5 items 1-2, §4.7).

The tiny fixture's real parameters (mhc scalars, norm_in); random lanes, phi products and
Engram K/V, several positions per dispatch.
"""

from dataclasses import dataclass

import numpy as np
import pytest

from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.formats import cact
from needle_wgpu.gpu import Plan, UniformArena
from needle_wgpu.kernels.needle3 import mhc
from needle_wgpu.gpu.device import Binding
from needle_wgpu.kernels.needle3.fp16_store import Fp16Store, Fp16Window
from needle_wgpu.reference.needle3 import cq as ref_cq
from needle_wgpu.reference.needle3 import engram as ref_engram
from needle_wgpu.reference.needle3 import mhc as ref_mhc
from needle_wgpu.reference.ops import zc_rms_norm
from needle_wgpu.reference.needle3.weights import load_weights

from .parity import download, rel, upload

pytestmark = pytest.mark.gpu
GATE = 1e-5  # f32 reductions in tree order instead of NumPy's pairwise order: a few ulps
T = 5


@dataclass
class MixModel:
    """What mhc_mix reads: sizes, the FP16 store, and the same parameters for the reference."""

    lanes: int
    width: int
    engram_sites: tuple
    store: object
    mhc: list  # reference MhcLayer per layer
    norm_in: list


@pytest.fixture(scope="module")
def model(fixture_dir, device):
    f = cact.load(fixture_dir / "tiny.cact")
    w, g = load_weights(f), f.geometry
    return MixModel(g.mhc_lanes, g.d_model, g.engram_sites, Fp16Store(device, f), list(w.mhc),
                    [a.norm_in for a in w.attention])


def synthetic_model(device, rng, lanes, width, layers=3, engram_sites=(1,)):
    """Random mHC parameters at sizes the fixture lacks (shipped d = 768, or padded widths)."""
    n, L = lanes, layers
    arrays = {"mhc.a_pre": rng.uniform(0.0, 0.5, L), "mhc.a_post": rng.uniform(0.0, 0.5, L),
              "mhc.a_res": rng.uniform(0.0, 0.5, L), "mhc.b_pre": rng.normal(size=(L, n)) * 0.5,
              "mhc.b_post": rng.normal(size=(L, n)) * 0.5,
              "mhc.b_res": 4.0 * np.eye(n) + rng.normal(size=(L, n, n)) * 0.5}
    arrays.update({f"layers.{l}.norm_in": rng.normal(size=width) * 0.2 for l in range(L)})
    store = FakeStore(device, arrays)
    v = store.values
    layers = [ref_mhc.MhcLayer(l % n, float(v["mhc.a_pre"][l]), float(v["mhc.a_post"][l]), float(v["mhc.a_res"][l]),
                               v["mhc.b_pre"][l], v["mhc.b_post"][l], v["mhc.b_res"][l]) for l in range(L)]
    return MixModel(n, width, engram_sites, store, layers, [v[f"layers.{l}.norm_in"] for l in range(L)])


class FakeStore:
    """An Fp16Store look-alike holding the given arrays (as FP16) for sizes the fixture lacks."""

    def __init__(self, device, arrays: dict):
        self.offsets, blobs, size = {}, [], 0
        self.values = {}
        for name, value in arrays.items():
            half = np.asarray(value).astype("<f2")
            self.values[name] = half.astype(np.float32)
            self.offsets[name] = size // 2
            blob = half.tobytes()
            blobs.append(blob + b"\0" * (-len(blob) % 4))
            size += len(blobs[-1])
        data = b"".join(blobs)
        self.buffer = device.buffer(len(data), label="fp16", data=data)

    def offset(self, name):
        return self.offsets[name]

    def layer_window(self, layer):
        """The whole buffer, with the per-layer mHC slice names the real store provides."""
        offsets = dict(self.offsets)
        for name, value in self.values.items():
            if name.startswith("mhc."):
                per_layer = int(np.prod(value.shape[1:], dtype=int))
                offsets[f"layers.{layer}.{name}"] = self.offsets[name] + layer * per_layer
        return Fp16Window(Binding(self.buffer), 0, offsets)


def random_lanes(rng, n, d):
    # Lanes of unequal scale, as after a few layers (the norm must not assume unit rms).
    return (rng.normal(size=(T, n, d)) * rng.uniform(0.5, 30.0, size=(T, n, 1))).astype(np.float32)


@pytest.mark.parametrize("n, d", [(4, 256), (4, 768), (3, 200)])
def test_mhc_norm(device, n, d):
    """The fixture's n·d = 1024, the shipped 3072 and a width that needs padding (600 -> 640)."""
    rng = np.random.default_rng(d)
    lanes = random_lanes(rng, n, d)
    in_pad = -(-n * d // 128) * 128
    lanes_buf, nxh = upload(device, lanes, "lanes"), device.buffer(4 * T * in_pad, label="nxh")
    arena, plan = UniformArena(device), Plan(device, "mhc_norm")
    mhc.mhc_norm(plan, arena, lanes_buf, nxh, lanes_n=n, width=d, group=128, positions=T)
    device.run(plan)
    want = ref_cq.prepare_input(ref_mhc.lane_norm(lanes), 128)
    assert rel(download(device, nxh, (T, in_pad)), want) <= GATE


@pytest.mark.parametrize("n, d", [(4, 256), (3, 200)])
def test_mhc_norm_deploy(device, n, d):
    """act_quant: nxh = prepare_input(A8(rms_unit(flatten(X_t)))) (§4.9 point 2)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from a8_checks import check_a8, unprepare

    lanes = random_lanes(np.random.default_rng(d + 1), n, d)
    in_pad = -(-n * d // 128) * 128
    lanes_buf, nxh = upload(device, lanes, "lanes"), device.buffer(4 * T * in_pad, label="nxh")
    arena, plan = UniformArena(device), Plan(device, "mhc_norm")
    mhc.mhc_norm(plan, arena, lanes_buf, nxh, lanes_n=n, width=d, group=128, positions=T, act_quant=True)
    device.run(plan)
    check_a8(unprepare(download(device, nxh, (T, in_pad)), n * d), ref_mhc.lane_norm(lanes))


@pytest.mark.parametrize("layer", [1, 2])
def test_mhc_mix_deploy(device, model, layer):
    """act_quant: hh = prepare_input(A8(ZCRMSNorm(bx; norm_in))) (§4.9 point 3); the rest unchanged."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from a8_checks import check_a8, unprepare

    got, want, _ = run_mix(device, model, layer, seed=20 + layer, act_quant=True)
    d = model.width
    check_a8(unprepare(got.pop("hh"), d), zc_rms_norm(want.pop("bx_for_hh"), model.norm_in[layer]))
    want.pop("hh")
    for name in want:
        assert rel(got[name], want[name]) <= GATE, name


def run_mix(device, model, layer, seed, act_quant=False):
    """One mhc_mix dispatch on random inputs; returns (got, want) dicts of arrays."""
    n, d = model.lanes, model.width
    sites = len(model.engram_sites)
    rng = np.random.default_rng(seed)
    lanes = random_lanes(rng, n, d)
    mix_dots = (rng.normal(size=(T, 2 * n + n * n)) * 3.0).astype(np.float32)
    ekv = rng.normal(size=(T, sites * 2 * d)).astype(np.float32) * 2.0
    ev = rng.normal(size=(T, sites, d)).astype(np.float32)
    d_pad = -(-d // 128) * 128
    state = mhc.mhc_state(device, T + 2, d, n)  # capacity larger than the chunk on purpose
    hh = device.buffer(4 * T * d_pad, label="hh")
    site = model.engram_sites.index(layer) if layer in model.engram_sites else None
    gate = None
    if site is not None:
        gate = mhc.EngramGateInputs(upload(device, ekv, "ekv"), upload(device, ev, "ev"), site, sites)
    arena, plan = UniformArena(device), Plan(device, "mhc_mix")
    mhc.mhc_mix(plan, arena, model.store, upload(device, lanes, "lanes"), upload(device, mix_dots, "mix"), state, hh,
                layer=layer, lanes_n=n, width=d, group=128, positions=T, engram=gate, act_quant=act_quant)
    device.run(plan)
    hmix = download(device, state.buffer, (T, n + n * n), state.hmix_at)
    got = {"u": download(device, state.buffer, (T, d), state.u_at),
           "bx": download(device, state.buffer, (T, d), state.bx_at),
           "hpost": hmix[:, :n], "hres": hmix[:, n:].reshape(T, n, n),
           "hh": download(device, hh, (T, d_pad))}

    p = model.mhc[layer]
    pre, post, res = mix_dots[:, :n], mix_dots[:, n : 2 * n], mix_dots[:, 2 * n :].reshape(T, n, n)
    u = ref_mhc.mix_down(lanes, ref_mhc.pre_weights(pre, p))
    bx = u
    if site is not None:
        bx = ref_engram.gate(u, ekv[:, site * 2 * d : site * 2 * d + d], ev[:, site])
    want = {"u": u, "bx": bx, "hpost": ref_mhc.post_weights(post, p), "hres": ref_mhc.residual_mix(res, p),
            "hh": ref_cq.prepare_input(zc_rms_norm(bx, model.norm_in[layer]), 128)}
    if act_quant:
        want["bx_for_hh"] = bx
    return got, want, site


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_mhc_mix(device, model, layer):
    got, want, site = run_mix(device, model, layer, seed=10 + layer)
    check_mix(got, want, site)


def check_mix(got, want, site):
    for name in want:
        assert rel(got[name], want[name]) <= GATE, name
    if site is not None:  # the gate's own term α·V, not hidden under u
        assert np.abs(want["bx"] - want["u"]).max() > 0.1
        assert rel(got["bx"] - got["u"], want["bx"] - want["u"]) <= GATE


@pytest.mark.parametrize("lanes, width", [(4, 768), (3, 200)])
@pytest.mark.parametrize("layer", [1, 2])
def test_mhc_mix_synthetic(device, lanes, width, layer):
    """The shipped d = 768 (pad(d) = 768, six FWHT groups) and d = 200 (padded to 256), 3 lanes."""
    model = synthetic_model(device, np.random.default_rng(width + layer), lanes, width)
    got, want, site = run_mix(device, model, layer, seed=layer)
    assert (site is not None) == (layer == 1)
    check_mix(got, want, site)


def test_sinkhorn_doubly_stochastic(device, model):
    got, want, _ = run_mix(device, model, layer=2, seed=99)
    hres = got["hres"]
    assert (hres > 0).all()
    # Columns are normalised last in every iteration, so they sum to 1 up to rounding.
    np.testing.assert_allclose(hres.sum(axis=1), 1.0, atol=1e-5)
    # Rows are 20 iterations from convergence: with the strongly diagonal logits of b_res ≈ 4·I
    # they are off by up to ~1e-2 in the reference too, so compare with the reference's sums.
    np.testing.assert_allclose(hres.sum(axis=2), want["hres"].sum(axis=2), atol=1e-5)
    np.testing.assert_allclose(hres.sum(axis=2), 1.0, atol=5e-2)


def test_mhc_mix_needs_width_multiple_of_4(device):
    state = mhc.mhc_state(device, 1, 202, 4)
    with pytest.raises(UnsupportedModelError, match="multiple of 4"):
        mhc.mhc_mix(Plan(device, "x"), UniformArena(device), None, None, None, state, None, layer=0, lanes_n=4,
                    width=202, group=128, positions=1)
