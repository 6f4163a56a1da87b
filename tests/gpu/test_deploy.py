"""Deploy numerics on the GPU (spec §4.9, §U d, §U e): ``load(numerics="deploy")`` against the
deploy reference and upstream's ``logits_quant`` on the three upstream fixtures.

Tolerances (tests/test_deploy.py has the why): A8 rounding is discontinuous, and the GPU's f32
sums run in another order than the reference's (and than upstream's XLA), so a value within f32
noise of a .5 may round the other way; each such flip moves the logits by ~1e-3 of their RMS,
for good through a global layer. While no flip has happened (len1, len7) GPU, reference and
upstream agree to ≤ 1e-5; over whole sequences to ≤ 2e-2 max|d|/RMS, ≤ 3e-3 RMS, with 0 argmax
mismatches. The small-rung3 oracle was made with K/V unquantised: it is compared with kv="f32".
"""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from needle_wgpu.engine import Needle3
from needle_wgpu.errors import InputError, UnsupportedModelError
from needle_wgpu.formats import cact
from needle_wgpu.formats.cact_writer import records_of, write_cact
from needle_wgpu.reference.needle3.model import ReferenceModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_deploy import ORACLE_KV, errors  # noqa: E402
from upstream_fixtures import NAMES, SEQUENCES, oracle, upstream_file  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(device):
    return {name: Needle3.load(upstream_file(name), device=device, numerics="deploy") for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_deploy_matches_reference_and_logits_quant(models, name):
    model, z = models[name], oracle(name)
    reference = ReferenceModel(upstream_file(name), numerics="deploy", kv=ORACLE_KV[name])
    for seq in SEQUENCES:
        ids = z[f"{seq}.ids"]
        got = np.array(model.logits(ids.tolist(), kv=ORACLE_KV[name]))
        for want in (reference.forward_sequence(ids), z[f"{seq}.logits_quant"]):
            d_max, d_rms, mismatches = errors(got, want)
            assert mismatches == 0, (seq, mismatches)
            assert d_max <= (1e-5 if seq in ("len1", "len7") else 2e-2) and d_rms <= 3e-3, (seq, d_max, d_rms)


def test_header_kv_mode_is_the_default(models):
    """kv None: the header's kv_bits 8 -> int8 (§U d); kv="f32" overrides it, and differs."""
    model, z = models["small"], oracle("small")
    ids = z["len7.ids"].tolist()
    default, explicit, f32 = (np.array(model.logits(ids, kv=kv)) for kv in (None, "int8", "f32"))
    assert np.array_equal(default, explicit)
    assert np.abs(default - f32).max() > 1e-3
    assert model.describe()["numerics"] == "deploy" and model.describe()["kv_default"] == "int8"
    with pytest.raises(InputError, match="kv"):
        model.logits(ids, kv="cq7")


def test_deploy_adds_no_dispatch(device, models):
    """A8 is fused into kernels the float path runs anyway: the same dispatches per chunk."""
    from needle_wgpu.models.session import PlanKey

    counts = {}
    for numerics in ("float", "deploy"):
        model = models["small"] if numerics == "deploy" else Needle3.load(upstream_file("small"), device=device)
        session = model.gpu.session(context=64)
        counts[numerics] = len(session._build(PlanKey(positions=8)))
        session.close()
    assert counts["float"] == counts["deploy"], counts


def cq4_file() -> bytes:
    f = cact.load(upstream_file("small"))
    return write_cact(replace(f.geometry, kv_bits=4), records_of(f), f.codebook)


def test_cq_kv_from_the_header_matches_the_reference(device):
    """A file post-trained for 4-bit K/V (kv_bits 4): K/V are CQ-64 round trips by default;
    prefill in chunks plus stepped decode give the reference's whole-sequence logits."""
    data = cq4_file()
    model = Needle3.load(data, device=device, numerics="deploy")
    reference = ReferenceModel(cact.load(data), numerics="deploy")
    assert reference.kv_mode == "cq4" and model.describe()["kv_default"] == "cq4"
    ids = oracle("small")["len40.ids"].tolist()[:30]
    want = reference.forward_sequence(ids)
    got = np.array(model.logits(ids))
    # A level flip moves a whole K/V head vector by a 4-bit CQ step (~1/16 of its norm, where an
    # int8 flip is 1/255 of one value): the flip-tolerant bound is twice the int8 one.
    d_max, d_rms, mismatches = errors(got, want)
    assert mismatches == 0 and d_max <= 4e-2 and d_rms <= 6e-3, (d_max, d_rms)
    other = ReferenceModel(cact.load(data), numerics="deploy", kv="int8").forward_sequence(ids)
    assert errors(got, other)[1] >= 2 * d_rms  # it is the CQ mode that the GPU computes
    session = model.gpu.session(context=64)
    stepped = [session.all_logits(ids[:20])[-1]]
    for i in ids[20:]:
        stepped.append(session.all_logits([i])[-1])
    session.close()
    d_max, _, mismatches = errors(np.array(stepped), want[19:])
    assert mismatches == 0 and d_max <= 4e-2


def test_numerics_are_checked(device):
    from needle_wgpu.api import Model

    with pytest.raises(InputError, match="numerics"):
        Model.load(upstream_file("small"), device=device, numerics="int4")
    f = cact.load(upstream_file("small"))
    bad = write_cact(replace(f.geometry, kv_bits=5), records_of(f), f.codebook)
    with pytest.raises(UnsupportedModelError, match="kv_bits 5"):
        Model.load(bad, device=device, numerics="deploy")
    Model.load(bad, device=device)  # float numerics do not read kv_bits
    with pytest.raises(InputError, match="deploy"):
        Model.load(upstream_file("small"), device=device).logits([2, 5], kv="cq4")


def test_dense_models_refuse_deploy_numerics(device):
    from gguf_samples import dense_gguf

    from needle_wgpu.api import Model

    with pytest.raises(UnsupportedModelError, match="only float"):
        Model.load(dense_gguf(), device=device, numerics="deploy")


def test_past_kv_window_is_flagged(device):
    """kv_window is reported and never applied (§U e): a session says when it has grown past it."""
    f = cact.load(upstream_file("small"))
    data = write_cact(replace(f.geometry, kv_window=8), records_of(f), f.codebook)
    model = Needle3.load(data, device=device, numerics="deploy")
    assert model.describe()["kv_window"] == 8
    session = model.gpu.session(context=32)
    session.all_logits(list(range(2, 10)))
    assert not session.past_kv_window
    session.all_logits([11])
    assert session.past_kv_window
    session.close()


def test_heads_and_chunking_under_deploy(models):
    """The probe heads read the deploy forward's cells (§4.9: quant passes to hidden_cells): the
    GPU's confidence and router equal the deploy reference's (≤ 1e-5 before any rounding flip,
    len7; a flip moves a head output by ~1e-4, len40), and differ from the float path's. A8 is
    per position, so a prefill in one chunk and one split into prefill + decode steps are the
    same numbers."""
    import math

    model, z = models["small-allheads"], oracle("small-allheads")
    reference = ReferenceModel(upstream_file("small-allheads"), numerics="deploy")
    for seq, tol in (("len7", 1e-5), ("len40", 1e-3)):
        ids = z[f"{seq}.ids"].tolist()
        p = model.confidence(ids)
        logit = math.log(p / (1 - p))
        assert abs(logit - reference.confidence_logit(ids)) <= tol, seq
        assert abs(logit - float(z[f"{seq}.confidence"])) > 1e-4  # the float head (upstream quant=False)
        assert np.abs(np.array(model.route(ids=ids).logits) - reference.route(ids)[0]).max() <= tol, seq
    ids = z["len40.ids"].tolist()[:30]
    session = model.gpu.session(context=64)
    whole = np.array(session.all_logits(ids))
    session.close()
    session = model.gpu.session(context=64)
    parts = [np.array(session.all_logits(ids[:20]))] + [np.array(session.all_logits([i])) for i in ids[20:]]
    session.close()
    assert np.array_equal(np.concatenate(parts), whole)
