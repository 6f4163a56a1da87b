"""Cross-backend parity: the same container and prompts on Chromium's WebGPU (Pyodide), on
wgpu-py (the desktop back end) and in the NumPy reference.

The gate is the one the desktop model tests use: max|d| / RMS <= 1e-4 and no argmax mismatch.
The same WGSL runs on both GPUs; neither contracts multiply-adds, so the back ends agree to a
few ulps (about 2e-6 of RMS measured), far inside the gate.
"""

from __future__ import annotations

import numpy as np
import pytest

from needle_wgpu.engine import Needle3
from needle_wgpu.formats import cact
from needle_wgpu.reference.needle3 import cq as ref_cq
from needle_wgpu.reference.needle3.model import ReferenceModel

from gpu.parity import argmax_mismatches, rel
from .pages import BUNDLED, banner, ensure_bundled, generate, load_file, request

pytestmark = [pytest.mark.browser, pytest.mark.slow]

GATE = 1e-4
PROMPTS = {
    "one": [2],
    "seven": [2, 242, 262, 386, 486, 17, 73],
    # Crosses the 64-position prefill chunk, so the second chunk reads a cache the first wrote.
    "chunked": [2] + [int(v) for v in np.random.default_rng(66).integers(4, 512, size=67)],
}


def browser_logits(page, ids) -> np.ndarray:
    reply = request(page, "logits", {"ids": ids})
    assert reply["ok"], reply
    return np.array(reply["result"]["rows"], np.float64)


@pytest.fixture(scope="module")
def desktop():
    from needle_wgpu.errors import DeviceError
    from needle_wgpu.gpu import open_device

    try:
        device = open_device("native")
    except DeviceError as exc:
        pytest.fail(f"no desktop WebGPU adapter for the parity suite: {exc} (install mesa-vulkan-drivers)")
    return Needle3.load(BUNDLED, device=device)


@pytest.fixture(scope="module")
def reference():
    return ReferenceModel.from_path(BUNDLED)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_logits_match_desktop_and_reference(app, desktop, reference, name):
    ensure_bundled(app)
    ids = PROMPTS[name]
    got = browser_logits(app, ids)
    native = np.array(desktop.logits(ids))
    want = reference.forward_sequence(ids)
    assert got.shape == native.shape == want.shape == (len(ids), reference.head_rows)
    assert rel(got, want) <= GATE and argmax_mismatches(got, want) == 0, "browser vs NumPy reference"
    assert rel(native, want) <= GATE and argmax_mismatches(native, want) == 0, "wgpu-py vs NumPy reference"
    assert rel(got, native) <= GATE and argmax_mismatches(got, native) == 0, "browser vs wgpu-py"


@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "sampled"])
def test_generated_ids_match_desktop(app, desktop, settings):
    """Prefill, decode steps and the GPU sampler give the same ids on both back ends."""
    ensure_bundled(app)
    reply = generate(app, prompt="Hi there", max_tokens=6, **settings)
    assert reply["ok"], reply
    native = desktop.generate(prompt="Hi there", max_tokens=6, **settings)
    assert reply["result"]["ids"] == native.ids
    assert reply["result"]["text"] == native.text


def test_cq_kernel_matches_reference(app):
    """cq_prepare + cq_matmul alone (§5.5) on one tensor of the bundled file."""
    container = cact.load(BUNDLED)
    tensor = container["layers.0.q_proj"]
    x = np.random.default_rng(5).normal(size=(3, tensor.cols)).astype(np.float32)
    reply = request(app, "cq_matmul", {"tensor": tensor.name, "x": x.ravel().tolist(), "positions": 3})
    assert reply["ok"], reply
    got = np.array(reply["result"]["y"], np.float32).reshape(3, tensor.rows)
    want = ref_cq.matmul(ref_cq.CQMatrix.from_tensor(tensor, container.levels(tensor.bits)), x)
    assert rel(got, want) <= 1e-5  # the desktop CQ gate (tests/gpu/test_cq.py)


def test_fixture_model_through_the_file_picker(app, fixture_dir):
    """The independent implementation's goldens, with the container loaded as a user would."""
    reply = load_file(app, str(fixture_dir / "tiny.cact"))
    assert reply["ok"], reply
    try:
        ids = PROMPTS["seven"]
        want = np.fromfile(fixture_dir / "tiny.len7.forward.f32.bin", "<f4").reshape(len(ids), -1)
        got = browser_logits(app, ids)
        assert rel(got, want) <= GATE and argmax_mismatches(got, want) == 0
    finally:
        ensure_bundled(app)


def test_device_loss_is_reported_then_recovered(app):
    ensure_bundled(app)
    assert request(app, "lose_device")["ok"]
    lost = generate(app, prompt="Hi", max_tokens=1)
    assert not lost["ok"] and lost["error"]["kind"] == "DeviceLostError"
    assert "GPU device was lost" in banner(app)
    recovered = generate(app, prompt="Hi", max_tokens=2)  # a new device, the model uploaded again
    assert recovered["ok"], recovered
    assert banner(app) == ""
    got = browser_logits(app, PROMPTS["seven"])
    want = ReferenceModel.from_path(BUNDLED).forward_sequence(PROMPTS["seven"])
    assert rel(got, want) <= GATE


def test_rounds_of_several_steps_give_the_ids_of_one_step(app, tmp_path):
    """A request's ``tokens_per_round`` on a dense file: 4 decode steps a submit, each round's
    ids copied into a staging buffer inside its own submit and mapped after it, the next round
    submitted before this one is read (the session rewinds over the overshoot), give the ids of
    one step a submit, greedy and seeded, in fewer submits."""
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    path = write_dense_gguf(tmp_path / "rounds.gguf", SynthDense(arch="llama", seed=3), tokenizer="bytes")
    assert load_file(app, str(path))["ok"]
    try:
        for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
            replies = {}
            for k in (1, 4):
                submits = request(app, "info")["result"]["counters"]["submits"]
                reply = request(app, "generate", {"request": {"mode": "prompt", "prompt": "Hello there", "max_tokens": 11,
                                                              "tokens_per_round": k, **sampling}})
                assert reply["ok"], reply
                assert reply["result"]["settings"]["tokens_per_round"] == k
                replies[k] = (reply["result"]["ids"], request(app, "info")["result"]["counters"]["submits"] - submits)
            assert replies[4][0] == replies[1][0] and len(replies[1][0]) == 11, replies
            assert replies[4][1] < replies[1][1], replies
    finally:
        ensure_bundled(app)
