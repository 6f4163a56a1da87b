"""The NumPy reference against upstream cactus-needle 3.2.8 on containers its exporter wrote:
every fixture loads; logits and all three probe heads agree with upstream's JAX forward."""

import numpy as np
import pytest

from needle_wgpu.formats import cact
from needle_wgpu.reference.needle3.model import ReferenceModel

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
    from needle_wgpu.reference.needle3.heads import probe_logit
    cells = model.forward_cells(ids)
    head = model.weights.confidence
    kept = probe_logit(cells, head, np.array(ids) != 0)
    assert abs(model.confidence_logit(ids) - kept) < 1e-5
    assert abs(probe_logit(cells, head) - kept) > 1e-4


# ----------------------------------------------------------------------------------- other valid files (§U b, c)


@pytest.mark.parametrize("kind", ["mixed", "no-engram", "wide-sub", "narrow-fetch"])
def test_valid_variants_load_and_run(kind):
    from upstream_fixtures import variant

    f = cact.load(variant(kind))
    model = ReferenceModel(f)
    logits = model.forward_sequence([2, 17, 40, 9, 300, 12])
    assert logits.shape == (6, 500) and np.isfinite(logits).all()
    base = ReferenceModel(cact.load(upstream_file("small"))).forward_sequence([2, 17, 40, 9, 300, 12])
    assert np.abs(logits - base).max() > 1e-3  # the change reaches the logits
    if kind == "mixed":
        assert {f[n].bits for n in ("layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj",
                                    "layers.0.gate_proj")} == {1, 2, 3, 5}
    if kind == "no-engram":
        assert f.geometry.engram_sites == () and "engram.0.tables" not in f
    if kind == "wide-sub":
        assert f["engram.0.tables"].num_groups == 2
    if kind == "narrow-fetch":
        assert f.geometry.engram_width == 255 and f["engram.0.key_proj"].shape == (256, 255)


def test_heads_of_any_size():
    """Each head has its own k, q and output rows (§U a): the streaming pool equals the
    whole-sequence formula for every head, and the outputs have their own widths."""
    from upstream_fixtures import variant

    from needle_wgpu.reference.needle3.heads import probe_output

    model = ReferenceModel(cact.load(variant("odd-heads")))
    ids = np.array([2, 17, 40, 9, 300, 12, 7], np.uint32)
    cells = model.forward_cells(ids)
    for code, width in ((1, 5), (2, 1), (3, 3)):
        got = model.head_output(code, ids)
        assert got.shape == (width,)
        np.testing.assert_allclose(got, probe_output(cells, model.weights.heads[code]), atol=1e-5)
    assert abs(np.linalg.norm(model.embedding(ids)) - 1) < 1e-5
    np.testing.assert_allclose(model.route(ids)[1], [0.8, 0.1, 0.5], atol=1e-3)


def test_binary_cq_matches_its_dense_matrix():
    """1-bit CQ (§U b): codes 0/1 read as ∓sqrt(2/π)/sqrt(G); the rotated-domain product equals
    the product with the dequantised matrix."""
    from needle_wgpu.formats.cact_writer import Record
    from needle_wgpu.formats.cq_codec import cq_decode, levels_for
    from needle_wgpu.reference.needle3 import cq

    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (16, 256)).astype(np.float32)
    r = Record.cq("w", w, 1, 128)
    assert len(r.blob) == 16 * (256 // 8 + 2 * 2)
    levels = levels_for(1, group=128)
    np.testing.assert_allclose(levels, [-np.sqrt(2 / np.pi) / np.sqrt(128), np.sqrt(2 / np.pi) / np.sqrt(128)],
                               rtol=1e-6)
    dense = cq_decode(r.blob, 16, 256, 1, 128, levels)
    assert np.corrcoef(dense.ravel(), w.ravel())[0, 1] > 0.7  # a 1-bit code still follows w
    packed = np.frombuffer(r.blob[: 16 * 32], np.uint8).reshape(16, 32)
    norms = np.frombuffer(r.blob[16 * 32 :], "<f2").astype(np.float32).reshape(16, 2)
    matrix = cq.CQMatrix(16, 256, 128, 1, packed, norms, cq.level_table(1, 128, ()))
    x = rng.normal(0, 1, (3, 256)).astype(np.float32)
    np.testing.assert_allclose(cq.matmul(matrix, x), x @ dense.T, rtol=1e-4, atol=1e-4)


def test_pad_masked_cells_do_not_see_pad_positions():
    """Upstream's hidden cells (§U a) mask every term that reads a pad position: attention keys,
    q/k/v conv taps, engram tables and value-conv taps. So with ``pad_masked`` a pad position's
    own state (here: its embedding, changed) reaches no other position's cell, while the
    generation-pass cells (position mask only) do carry it."""
    model = ReferenceModel(cact.load(upstream_file("small-allheads")))
    ids = np.array([2, 17, 40, 0, 9, 300, 0, 12, 7, 5, 8, 3], np.uint32)
    embed = model.embed

    def outputs(scale):
        model.embed = lambda tokens: embed(tokens) * np.where(tokens == 0, np.float32(scale), 1)[:, None]
        try:
            return (model.head_output(3, ids, pad_masked=True), model.head_output(3, ids))
        finally:
            model.embed = embed

    (masked_a, plain_a), (masked_b, plain_b) = outputs(1.0), outputs(-3.0)
    assert np.array_equal(masked_a, masked_b)
    assert np.abs(plain_a - plain_b).max() > 1e-4
    # Without a pad the two forms are one computation.
    clean = np.array([2, 17, 40, 9, 300, 12], np.uint32)
    np.testing.assert_allclose(model.head_output(1, clean, pad_masked=True), model.embedding(clean), atol=1e-6)


def test_families_without_heads_refuse_embed_and_route():
    """embed and route are Needle-only capabilities, like confidence: a family without probe
    heads raises UnsupportedModelError before running anything."""
    from types import SimpleNamespace

    from needle_wgpu.api import Model
    from needle_wgpu.errors import UnsupportedModelError

    from needle_wgpu.models.protocols import Capabilities

    gpu = SimpleNamespace(geometry=SimpleNamespace(vocab=10, head_rows=10, max_seq_len=8), tokenizer=None,
                          chat=None, capabilities=Capabilities(),
                          session=lambda **k: pytest.fail("no session should be opened"))
    model = Model(gpu)
    for call in (lambda: model.embed(ids=[2, 3]), lambda: model.route(ids=[2, 3]),
                 lambda: model.confidence([2, 3])):
        with pytest.raises(UnsupportedModelError):
            call()
