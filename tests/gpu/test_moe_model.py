"""The MoE architectures (qwen3moe, olmoe; dense spec §3) on the GPU against the NumPy reference:
every position, decode after prefill, one submit per decode step computing only the selected
experts, and the renormalisation rule of each architecture pinned (swapping it moves the whole
logit vectors by orders of magnitude more than the engine's distance to the reference)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu.formats import dense_archs
from needle_wgpu.models.session import PlanKey
from needle_wgpu.reference import dense as reference
from needle_wgpu.reference.dense import DenseReference
from needle_wgpu.sampling import Sampling
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

from .test_dense_model import PROMPTS, assert_parity

pytestmark = pytest.mark.gpu
ARCHS = ("qwen3moe", "olmoe")


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    specs = {"qwen3moe": SynthDense(arch="qwen3moe", qtype="Q8_0", n_expert=8, n_expert_used=2, seed=5),
             "olmoe": SynthDense(arch="olmoe", qtype="Q4_1", n_expert=12, n_expert_used=2, seed=6)}
    return {arch: write_dense_gguf(root / f"{arch}.gguf", spec, tokenizer="bytes") for arch, spec in specs.items()}


def nmse(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.mean((ours - theirs) ** 2) / np.mean(theirs ** 2))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_position_matches_the_reference(arch, moe_files, device):
    model = needle_wgpu.load(str(moe_files[arch]), device=device)
    info = model.describe()
    assert info["architecture"] == arch
    assert info["experts"]["used"] == 2 and info["experts"]["count"] >= 8
    assert info["experts"]["renormalised"] == (arch == "qwen3moe")
    vocab = model.geometry.vocab
    assert_parity(model, DenseReference(moe_files[arch]), [[i % vocab for i in ids] for ids in PROMPTS])


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_after_prefill_equals_prefill(arch, moe_files, device):
    """Greedy ids through prefill + decode steps equal the reference's, and a decode step's
    logits equal the all-positions prefill row of the same ids."""
    path = moe_files[arch]
    model = needle_wgpu.load(str(path), device=device)
    ref = DenseReference(path)
    prompt = [1, 40, 41, 42, 43]
    ours = model.generate(ids=prompt, max_tokens=10, context=32).ids
    assert len(ours) >= 1 and ours == ref.greedy(prompt, 10)[: len(ours)]
    every = np.array(model.logits(prompt + ours[:3], context=32), np.float32)
    theirs = ref.logits(prompt + ours[:3])
    assert (every.argmax(axis=1)[len(prompt) - 1:] == np.array(ours[:4])).all()
    assert float(np.abs(every - theirs).max() / np.sqrt(np.mean(theirs.astype(np.float64) ** 2))) <= 1e-4


def test_decode_step_is_one_submit_of_selected_experts_only(moe_files, device):
    """A decode step: one submit, no readback beyond the sampled id, 14 dispatches a layer (the
    dense FFN's 4 become router, routes, gate, up, act, down), and the expert matmuls cover one
    expert's rows per route (k workgroup rows), never all experts'."""
    model = needle_wgpu.load(str(moe_files["qwen3moe"]), device=device)
    g = model.geometry
    session = model.gpu.session(context=32)
    greedy = Sampling.saturate(0.0)
    try:
        session.prefill([1, 2, 3], greedy)
        session.step(greedy)
        counters = device.counters
        before = (counters.submits, counters.bytes_read, counters.dispatches)
        session.step(greedy)
        after = (counters.submits, counters.bytes_read, counters.dispatches)
        plan = session._plan(PlanKey(1, greedy))
    finally:
        session.close()
    assert after[0] - before[0] == 1
    assert after[1] - before[1] <= 16
    assert after[2] - before[2] == len(plan.dispatches)
    labels = [d.label for d in plan.dispatches]
    for layer in range(1, g.num_layers):  # layer 0 starts with a plain norm, the others fuse the residual add
        mine = [label for label in labels if f"blk.{layer}." in label or label.endswith(f" {layer}")]
        # q|k|v share a quant type here: one stacked matmul; the MoE FFN is 6 (router logits,
        # routes, gate and up expanded, the activation, down combined): 12 in all.
        assert len(mine) == 12, mine
    assert not any(label.startswith("q_matmul") and "_exps" in label for label in labels)  # no dense experts
    routed = [d for d in plan.dispatches if d.label.startswith("routed")]
    assert len(routed) == 3 * g.num_layers
    for d in routed:  # one expert's rows per route: k routes (expand) or one position (combine)
        assert d.groups[1] == (1 if "combine" in d.label else g.num_experts_used), (d.label, d.groups)
        assert d.groups[0] == -(-(g.d_model if "down" in d.label else g.ff_dim) // 64)


@pytest.mark.parametrize("arch", ARCHS)
def test_swapping_the_renormalisation_rule_is_caught(arch, moe_files, device, monkeypatch):
    """qwen3moe renormalises the top-k weights, olmoe does not (§3). The reference with the rule
    swapped is far from the correct one over whole logit vectors (NMSE), while the engine is
    within f32 rounding of the correct one: a swap in either would fail the parity tests."""
    path = moe_files[arch]
    ids = [1, 17, 200, 42, 9, 5, 77, 130]
    correct = DenseReference(path).logits(ids)
    engine = np.array(needle_wgpu.load(str(path), device=device).logits(ids, context=len(ids)), np.float32)
    rules = reference.ARCHITECTURES[arch]
    monkeypatch.setitem(reference.ARCHITECTURES, arch, replace(rules, renormalise=not rules.renormalise))
    swapped = DenseReference(path).logits(ids)
    engine_error, swap_error = nmse(engine, correct), nmse(swapped, correct)
    print(arch, f"NMSE engine vs reference {engine_error:.2e}, swapped rule vs reference {swap_error:.2e}")
    assert swap_error > 1e-2
    assert swap_error > 1e6 * engine_error
    rules = dense_archs.ARCHITECTURES[arch]  # the engine's own row (reference and engine tables are apart)
    monkeypatch.setitem(dense_archs.ARCHITECTURES, arch, replace(rules, renormalise=not rules.renormalise))
    swapped_engine = np.array(needle_wgpu.load(str(path), device=device).logits(ids, context=len(ids)), np.float32)
    assert nmse(swapped_engine, swapped) < 1e-8 < nmse(swapped_engine, correct)


def test_experts_above_the_binding_limit_are_refused_before_upload(moe_files):
    """Expert tensors are read through one binding (kernels/moe.py): a device whose limit is
    below one expert tensor refuses the file at load with nothing uploaded."""
    from needle_wgpu.gpu import open_device

    path = moe_files["qwen3moe"]
    small = open_device(max_storage_binding=32768)  # the Q8_0 experts: 8 x 128 x 64 -> 69,632 bytes
    before = dict(small.counters.bytes_allocated)
    with pytest.raises(needle_wgpu.DeviceLimitError, match="ffn_gate_exps"):
        needle_wgpu.load(str(path), device=small)
    assert small.counters.bytes_allocated.get("weights", 0) == before.get("weights", 0)
