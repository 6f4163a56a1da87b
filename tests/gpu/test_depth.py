"""Elastic depth on the GPU (spec §10, §U f): small.cact run at depth 3 against upstream's
rung file's oracle, over the full model's weight buffers (no GPU copy)."""

import sys
from pathlib import Path

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu.engine import Needle3
from needle_wgpu.errors import DepthError
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from upstream_fixtures import SEQUENCES, assert_matches_oracle, logit_error, oracle, upstream_file  # noqa: E402

pytestmark = pytest.mark.gpu


def weight_bytes(device) -> int:
    return device.counters.bytes_allocated.get("weights", 0)


@pytest.fixture(scope="module")
def loaded(device):
    """(full, depth 3, GPU weight bytes of each load)."""
    before = weight_bytes(device)
    full = Needle3.load(upstream_file("small"), device=device)
    between = weight_bytes(device)
    rung = needle_wgpu.load(upstream_file("small"), device=device, depth=3)
    return full, rung, between - before, weight_bytes(device) - between


def test_depth_3_matches_upstreams_rung_oracle(loaded):
    _, model, _, _ = loaded
    assert_matches_oracle(model, "small-rung3")


def test_depth_selection_copies_no_weights(loaded, device):
    full, model, full_bytes, rung_bytes = loaded
    assert rung_bytes == full_bytes > 0  # load(depth=3) uploads the file once, as the full load
    assert model.gpu.weight_bytes == full.gpu.weight_bytes
    before = dict(device.counters.bytes_allocated)
    view = full.gpu.at_depth(2)
    assert device.counters.bytes_allocated == before  # a rung of a loaded model allocates nothing
    assert view.embedding is full.gpu.embedding and view.mhc is full.gpu.mhc and view.fp16 is full.gpu.fp16
    assert all(a is full.gpu.layers[b] for a, b in zip(view.layers, (0, 3)))


def test_describe_shows_the_depth(loaded):
    full, model, _, _ = loaded
    info = model.describe()
    assert info["depth"] == 3 and info["blocks"] == [0, 1, 3] and info["file_layers"] == 4
    assert info["geometry"]["num_layers"] == 3 and info["geometry"]["engram_sites"] == (1, 2)
    assert full.describe()["depth"] == 4 and "blocks" not in full.describe()


def test_full_depth_is_the_full_model(loaded, device):
    full, _, _, _ = loaded
    assert full.gpu.at_depth(4) is full.gpu
    ids = oracle("small")["len7.ids"].tolist()
    model = Needle3(full.gpu.at_depth(4))
    np.testing.assert_array_equal(np.array(model.logits(ids)), np.array(full.logits(ids)))


@pytest.mark.parametrize("bad", [0, 1, 5, 2.5, "3", True])
def test_bad_depths_are_refused_before_upload(device, bad):
    before = dict(device.counters.bytes_allocated)
    with pytest.raises(DepthError):
        needle_wgpu.load(upstream_file("small"), device=device, depth=bad)
    assert device.counters.bytes_allocated == before


def test_dense_files_have_no_depth(device, tmp_path):
    path = write_dense_gguf(tmp_path / "tiny.gguf", SynthDense())
    with pytest.raises(DepthError, match="only Needle 3"):
        needle_wgpu.load(path, device=device, depth=2)


def test_logits_command_at_a_depth(capsys):
    import json

    from needle_wgpu import cli

    z = oracle("small-rung3")
    ids = z["len7.ids"].tolist()
    assert cli.main(["logits", str(upstream_file("small")), "--ids", ",".join(map(str, ids)), "--depth", "3",
                     "--last", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["depth"] == 3 and len(out["logits"]) == 1
    rel, mismatches = logit_error(np.array(out["logits"]), z["len7.logits"][-1:])
    assert rel <= 1e-4 and mismatches == 0


@pytest.mark.parametrize("kind, depth", [("mixed", 3), ("mixed", 2), ("no-engram", 2)])
def test_rungs_of_valid_variants_match_the_reference(device, kind, depth):
    """A rung runs only its kept Engram sites, each a band of the stored key/value pack (here
    of several CQ widths): GPU against the NumPy reference at the same depth."""
    from needle_wgpu.reference.needle3.model import ReferenceModel
    from upstream_fixtures import variant

    data = variant(kind)
    model = needle_wgpu.load(data, device=device, depth=depth)
    ids = oracle("small")["len40.ids"].tolist()
    want = ReferenceModel(data, depth=depth).forward_sequence(ids)
    rel, mismatches = logit_error(np.array(model.logits(ids)), want)
    assert rel <= 1e-4 and mismatches == 0, (rel, mismatches)


def test_a_rung_under_deploy_numerics_is_the_rung_files_deploy_forward(device):
    """Depth and numerics compose: small.cact at depth 3 with deploy numerics computes what the
    exported rung file does (same weights, same A8 points; K/V f32 as small-rung3's oracle was
    made), and lands on the rung's ``logits_quant``."""
    rung = needle_wgpu.load(upstream_file("small"), device=device, depth=3, numerics="deploy")
    exported = needle_wgpu.load(upstream_file("small-rung3"), device=device, numerics="deploy")
    assert rung.describe()["numerics"] == "deploy" and rung.describe()["depth"] == 3
    z = oracle("small-rung3")
    for seq in SEQUENCES[:2]:  # before any int8 rounding flip (docs/api.md, "Numerics")
        ids = z[f"{seq}.ids"].tolist()
        ours = np.array(rung.logits(ids, kv="f32"), np.float32)
        theirs = np.array(exported.logits(ids, kv="f32"), np.float32)
        assert logit_error(ours, theirs)[0] <= 1e-5
        assert logit_error(ours, z[f"{seq}.logits_quant"])[0] <= 1e-5
