"""A new dense architecture is one row (tests/test_dense_archs.py): on the GPU, a copy of a row
under a new name runs the original's graph, dispatch for dispatch and logit for logit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu.formats import dense_archs
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["gemma3", "qwen3moe"])  # between them every kind of rule but qkv biases
def test_a_copied_row_runs_the_same_graph(arch, tmp_path, device, monkeypatch):
    new = f"new{arch}"
    monkeypatch.setitem(dense_archs.ARCHITECTURES, new, dense_archs.ARCHITECTURES[arch])
    spec = SynthDense(arch=arch, n_layers=max(2, dense_archs.ARCHITECTURES[arch].sliding_every), seed=4)
    ids = [1, 17, 200, 42, 9, 5, 77, 130]
    logits, dispatches = {}, {}
    for a in (arch, new):
        path = write_dense_gguf(tmp_path / f"{a}.gguf", dataclasses.replace(spec, arch=a), tokenizer="bytes")
        model = needle_wgpu.load(str(path), device=device)
        assert model.describe()["architecture"] == a
        before = device.counters.dispatches
        logits[a] = np.array(model.logits(ids, context=len(ids)), np.float32)
        dispatches[a] = device.counters.dispatches - before
    assert dispatches[new] == dispatches[arch] > 0
    assert np.array_equal(logits[new], logits[arch])
