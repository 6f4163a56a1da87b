"""MoE ops on the GPU vs the NumPy reference (dense spec §3, MoE): the router (softmax over all
experts, top-k with ties to the lower index, qwen3moe's renormalisation, olmoe's none) and the
expert matmuls that read the expert ids from the routes buffer."""

import numpy as np
import pytest

from needle_wgpu.gpu import Plan, UniformArena
from needle_wgpu.kernels import moe, qmatmul
from needle_wgpu.reference import qmatmul as ref
from needle_wgpu.reference.dense import MoeWeights, matmul, moe_ffn, moe_route, silu

from .parity import GATE, download, rel, upload
from .test_qmatmul import random_tensor

pytestmark = pytest.mark.gpu
F32 = np.float32


def run_route(device, logits, used, renormalise):
    T, experts = logits.shape
    lb = upload(device, logits, "router logits")
    routes = device.buffer(moe.routes_bytes(T, used), label="routes")
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "route")
    moe.route(plan, arena, logits=lb, routes=routes, positions=T, experts=experts, used=used,
              renormalise=renormalise)
    device.run(plan)
    raw = np.frombuffer(device.read(routes, moe.routes_bytes(T, used)), np.uint32).reshape(T, used, 2)
    return raw[..., 0].astype(np.int64), raw[..., 1].copy().view(F32)


def reference_route(logits, used, renormalise):
    m = MoeWeights(gate_inp=np.eye(logits.shape[1], dtype=F32), gate=None, up=None, down=None, used=used,
                   renormalise=renormalise)
    return moe_route(logits, m)


@pytest.mark.parametrize("renormalise", [True, False], ids=["qwen3moe", "olmoe"])
@pytest.mark.parametrize("experts, used", [(8, 2), (60, 4), (128, 8)])
def test_route_matches_the_reference(device, experts, used, renormalise):
    rng = np.random.default_rng(experts + used)
    logits = (rng.normal(size=(37, experts)) * 2).astype(F32)
    ids, weights = run_route(device, logits, used, renormalise)
    want_ids, want_weights = reference_route(logits, used, renormalise)
    np.testing.assert_array_equal(ids, want_ids)
    assert rel(weights, want_weights) <= GATE
    sums = weights.sum(axis=1)
    if renormalise:
        np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
    else:
        assert (sums < 1.0).all() and (sums > 1.0 / experts).all()


def test_route_ties_go_to_the_lower_index_and_ids_stay_in_range(device):
    logits = np.zeros((4, 8), F32)
    logits[1, [2, 5, 6]] = 3.0          # a three-way tie for two places: 2 then 5
    logits[2] = np.float32("nan")       # garbage in: the ids still name experts
    logits[3, 7] = 1e30                 # one expert takes everything
    ids, weights = run_route(device, logits, 2, True)
    assert ids[0].tolist() == [0, 1] and ids[1].tolist() == [2, 5]
    assert ids[3, 0] == 7 and weights[3, 0] == 1.0
    assert ((0 <= ids) & (ids < 8)).all()
    np.testing.assert_array_equal(ids[[0, 1, 3]], reference_route(logits[[0, 1, 3]], 2, True)[0])


def run_moe_ffn(device, z, packs, experts, used, renormalise, router_logits):
    """The MoE FFN op sequence of models/dense.py on given router logits: route, expand gate and
    up, act, combine down."""
    from needle_wgpu.kernels import ffn

    T, d = z.shape
    ff = packs["gate"].rows // experts
    zb, lb = upload(device, z, "z"), upload(device, router_logits, "logits")
    routes = device.buffer(moe.routes_bytes(T, used), label="routes")
    gate_up = device.buffer(4 * T * used * 2 * ff, label="gate_up")
    act = device.buffer(4 * T * used * ff, label="act")
    out = upload(device, np.full((T, d + 4), np.nan, F32), "out")
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "moe")
    moe.route(plan, arena, logits=lb, routes=routes, positions=T, experts=experts, used=used,
              renormalise=renormalise)
    for name, offset in (("gate", 0), ("up", ff)):
        moe.routed_matmul(plan, arena, packs[name], routes, zb, gate_up, experts=experts, used=used, positions=T,
                          combine=False, x_stride=d, y_stride=2 * ff, y_offset=offset)
    ffn.gated_activation(plan, arena, gate=gate_up, up=gate_up, out=act, width=ff, positions=T * used,
                         gate_stride=2 * ff, up_stride=2 * ff, up_offset=ff)
    moe.routed_matmul(plan, arena, packs["down"], routes, act, out, experts=experts, used=used, positions=T,
                      combine=True, x_stride=ff, y_stride=d + 4, y_offset=4)
    device.run(plan)
    return download(device, out, (T, d + 4))[:, 4:]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "F16"])
@pytest.mark.parametrize("T", [1, 5])
def test_moe_ffn_matches_the_reference(device, qtype, T):
    rng = np.random.default_rng(T)
    experts, used, d, ff = 8, 2, 256, 256 if qtype == "Q4_K" else 96
    packs, dense = {}, {}
    for name, rows, cols in (("gate", ff, d), ("up", ff, d), ("down", d, ff)):
        raw = random_tensor(rng, qtype, experts * rows, cols)
        packs[name] = qmatmul.upload(device, f"ffn_{name}_exps", qtype, raw, rows=experts * rows, cols=cols)
        dense[name] = ref.dequantize(raw, qtype, experts * rows, cols).reshape(experts, rows, cols)
    gate_inp = rng.normal(size=(experts, d)).astype(F32) / np.sqrt(d) * 2
    z = rng.normal(size=(T, d)).astype(F32)
    for renormalise in (True, False):
        m = MoeWeights(gate_inp=gate_inp, gate=dense["gate"], up=dense["up"], down=dense["down"], used=used,
                       renormalise=renormalise)
        want = moe_ffn(z, type("Layer", (), {"moe": m}))
        got = run_moe_ffn(device, z, packs, experts, used, renormalise, matmul(z, gate_inp))
        assert rel(got, want) <= 1e-5, (renormalise, rel(got, want))
    # the reference's own check: one position's experts by hand
    ids, weights = moe_route(z[:1], m)
    by_hand = sum(w * matmul(silu(matmul(z[:1], m.gate[e])) * matmul(z[:1], m.up[e]), m.down[e])[0]
                  for e, w in zip(ids[0], weights[0]))
    assert rel(np.asarray(by_hand)[None], want[:1]) <= 1e-6
