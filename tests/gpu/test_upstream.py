"""The GPU model against upstream cactus-needle 3.2.8 on containers its exporter wrote, and
against the NumPy reference on the valid files upstream's exporter does not write (§U)."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from needle_wgpu.engine import Needle3
from needle_wgpu.errors import InputError, UnsupportedModelError
from needle_wgpu.formats import cact
from needle_wgpu.reference.needle3.model import ReferenceModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from upstream_fixtures import NAMES, SEQUENCES, assert_matches_oracle, logit_error, oracle, upstream_file, variant  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(device):
    return {name: Needle3.load(upstream_file(name), device=device) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_confidence_match_upstream(models, name):
    assert_matches_oracle(models[name], name)


def test_embedding_and_router_match_upstream(models):
    model, z = models["small-allheads"], oracle("small-allheads")
    for seq in SEQUENCES:
        ids = z[f"{seq}.ids"].tolist()
        vector, want = np.array(model.embed(ids=ids)), z[f"{seq}.embedding"]
        assert vector.shape == (32,) and abs(np.linalg.norm(vector) - 1) < 1e-5
        assert vector @ want / np.linalg.norm(want) >= 0.9999, seq
        route = model.route(ids=ids)
        assert np.abs(np.array(route.logits) - z[f"{seq}.router"]).max() <= 1e-4, seq
    np.testing.assert_allclose(route.calibration, [0.9, 0.0, 0.6], atol=1e-3)


def test_heads_the_file_lacks_are_refused(models):
    with pytest.raises(UnsupportedModelError, match="no embedding head"):
        models["small"].embed(ids=[2, 5])
    with pytest.raises(UnsupportedModelError, match="no router head"):
        models["small"].route(ids=[2, 5])


def test_generation_reports_confidence_from_its_own_forward(models):
    """A tool-call request's result carries the confidence of prompt + completion, computed
    by the pool that ran alongside prefill and decode; a separate call agrees to 1e-4."""
    model = models["small-allheads"]
    z = oracle("small-allheads")
    prompt = z["len7.ids"].tolist()
    session_ids = []
    original = model.encode_request
    model.encode_request = lambda *a, **k: prompt  # the fixture's tokenizer cannot encode text (README)
    try:
        result = model.generate(query="q", tools=[], max_tokens=6, constrained=False)  # the score, not the grammar
    finally:
        model.encode_request = original
    assert result.confidence is not None and 0.0 < result.confidence < 1.0
    session_ids = prompt + result.ids
    assert abs(result.confidence - model.confidence(session_ids)) <= 1e-4
    assert model.generate(ids=prompt, max_tokens=3).confidence is None  # not a tool call


@pytest.mark.parametrize("kind", ["mixed", "no-engram", "wide-sub", "narrow-fetch"])
def test_valid_variants_match_the_reference(device, kind):
    data = variant(kind)
    model, reference = Needle3.load(data, device=device), ReferenceModel(cact.load(data))
    ids = oracle("small")["len40.ids"].tolist()
    want = reference.forward_sequence(ids)
    rel, mismatches = logit_error(np.array(model.logits(ids)), want)
    assert rel <= 1e-4 and mismatches == 0, (rel, mismatches)
    p = model.confidence(ids)
    assert abs(math.log(p / (1 - p)) - reference.confidence_logit(ids)) <= 1e-4


def test_pad_positions_leave_the_gpu_probe_pools(models):
    """Positions holding the pad id 0 are skipped by every head's pool and masked inside the
    cells as in upstream's hidden cells (§U a; the reference's ``pad_masked``, which here
    differs from the unmasked pass); a sequence of pads only is no evidence (confidence 0.5)
    and no embedding."""
    model = models["small-allheads"]
    reference = ReferenceModel(cact.load(upstream_file("small-allheads")))
    ids = [2, 17, 0, 40, 9, 0, 300, 12, 0, 0, 55]
    route = reference.head_output(3, ids, pad_masked=True)
    assert np.abs(route - reference.head_output(3, ids)).max() > 1e-3  # the mask matters here
    assert np.abs(np.array(model.route(ids=ids).logits) - route).max() <= 1e-4
    embedding = reference.head_output(1, ids, pad_masked=True)
    assert embedding @ reference.embedding(ids) < 0.9999
    assert np.array(model.embed(ids=ids)) @ embedding >= 0.9999
    p = model.confidence(ids)
    assert abs(math.log(p / (1 - p)) - float(reference.head_output(2, ids, pad_masked=True)[0])) <= 1e-4
    assert model.confidence([0, 0]) == 0.5
    with pytest.raises(InputError, match="pad id 0"):
        model.embed(ids=[0])


def test_cli_heads_prints_every_head_the_file_has(capsys):
    from needle_wgpu import cli

    z = oracle("small-allheads")
    ids = ",".join(str(i) for i in z["len7.ids"])
    assert cli.main(["heads", str(upstream_file("small-allheads")), "--ids", ids, "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out) == ["confidence", "embedding", "router"]
    assert np.array(out["embedding"]) @ z["len7.embedding"] >= 0.9999
    assert np.abs(np.array(out["router"]["logits"]) - z["len7.router"]).max() <= 1e-4
    assert cli.main(["heads", str(upstream_file("small")), "--ids", ids, "--head", "router", "--quiet"]) == 2
    assert "no router head" in capsys.readouterr().err
    assert cli.main(["heads", str(upstream_file("small")), "--ids", "2,x", "--quiet"]) == 2


def test_heads_of_any_size_match_the_reference(device):
    data = variant("odd-heads")
    model, reference = Needle3.load(data, device=device), ReferenceModel(cact.load(data))
    ids = [2, 17, 40, 9, 300, 12, 7]
    vector = np.array(model.embed(ids=ids))
    assert vector.shape == (5,) and vector @ reference.embedding(ids) >= 0.9999
    route = model.route(ids=ids)
    logits, calibration = reference.route(ids)
    assert np.abs(np.array(route.logits) - logits).max() <= 1e-4
    np.testing.assert_allclose(route.calibration, calibration)
    p = model.confidence(ids)
    assert abs(math.log(p / (1 - p)) - reference.confidence_logit(ids)) <= 1e-4
