"""The NumPy reference against upstream cactus-needle 3.2.8 on containers its exporter wrote:
every fixture loads; logits and all three probe heads agree with upstream's JAX forward."""

import numpy as np
import pytest

from needle_wgpu.formats import cact
from needle_wgpu.reference.model import ReferenceModel

from upstream_fixtures import NAMES, SEQUENCES, logit_error, oracle, upstream_file


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
    return request.param, ReferenceModel(cact.load(upstream_file(request.param)))


def test_every_upstream_fixture_loads(loaded):
    name, model = loaded
    want_heads = (1, 2, 3) if name == "small-allheads" else (2,)
    assert model.file.head_codes == want_heads
    assert model.geometry.out_vocab == 500


def test_logits_match_upstream(loaded):
    name, model = loaded
    z = oracle(name)
    for seq in SEQUENCES:
        rel, mismatches = logit_error(model.forward_sequence(z[f"{seq}.ids"]), z[f"{seq}.logits"])
        assert rel <= 1e-4 and mismatches == 0, (name, seq, rel, mismatches)


def test_confidence_matches_upstream(loaded):
    name, model = loaded
    z = oracle(name)
    for seq in SEQUENCES:
        assert abs(model.confidence_logit(z[f"{seq}.ids"]) - float(z[f"{seq}.confidence"])) <= 1e-4, (name, seq)


def test_embedding_and_router_match_upstream():
    model = ReferenceModel(cact.load(upstream_file("small-allheads")))
    z = oracle("small-allheads")
    for seq in SEQUENCES:
        ids = z[f"{seq}.ids"]
        vector = model.embedding(ids)
        want = z[f"{seq}.embedding"]
        assert vector.shape == (32,)
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
        assert float(vector @ want / np.linalg.norm(want)) >= 0.9999, seq
        logits, calibration = model.route(ids)
        assert np.max(np.abs(logits - z[f"{seq}.router"])) <= 1e-4, seq
    np.testing.assert_allclose(calibration, [0.9, 0.0, 0.6], atol=1e-3)  # upstream's defaults, FP16


def test_pad_positions_leave_the_probe_softmax():
    """A pad id 0 scores −inf in the probe softmax (§U a): the streaming pool equals the
    whole-sequence formula with those positions dropped, and differs from keeping them."""
    model = ReferenceModel(cact.load(upstream_file("small")))
    ids = [2, 17, 0, 40, 0, 9]
    from needle_wgpu.reference.heads import probe_logit
    cells = model.forward_cells(ids)
    head = model.weights.confidence
    kept = probe_logit(cells, head, np.array(ids) != 0)
    assert abs(model.confidence_logit(ids) - kept) < 1e-5
    assert abs(probe_logit(cells, head) - kept) > 1e-4
