"""The §7 verdict's rules on hand-made logit pairs, the derivation rule and the battery (no GPU)."""

import json
import math
from pathlib import Path

import pytest

from needle_wgpu import verdict
from needle_wgpu.errors import InputError
from needle_wgpu.kernels import qmatmul
from needle_wgpu.verdict import MATCH, NEAR_TIE_FLIP, STRUCTURED, Thresholds, classify

T = Thresholds(maxdiff=0.01, margin=0.004)


def test_identical_logits_match():
    v = classify([1.0, 3.0, 2.0], [1.0, 3.0, 2.0], T)
    assert (v.kind, v.maxdiff, v.margin, v.tokenwise_top, v.batched_top) == (MATCH, 0.0, 1.0, 1, 1)


def test_small_difference_same_argmax_matches():
    v = classify([1.0, 3.0, 2.0], [1.005, 2.995, 2.0], T)
    assert v.kind == MATCH and v.maxdiff == pytest.approx(0.005)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_is_structured(bad):
    assert classify([1.0, bad, 2.0], [1.0, 3.0, 2.0], T).kind == STRUCTURED
    assert classify([1.0, 3.0, 2.0], [1.0, bad, 2.0], T).kind == STRUCTURED
    v = classify([bad, 3.0], [bad, 3.0], T)  # inf - inf is nan: never a Match
    assert v.kind == STRUCTURED and not math.isfinite(v.maxdiff)


def test_difference_above_maxdiff_is_structured_even_with_the_same_argmax():
    v = classify([1.0, 3.0, 2.0], [1.0, 3.0, 2.02], T)
    assert v.kind == STRUCTURED and v.tokenwise_top == v.batched_top


def test_flip_at_a_near_tie_is_a_near_tie_flip():
    v = classify([1.0, 2.003, 2.0], [1.0, 2.0, 2.003], T)  # margin 0.003 <= 0.004
    assert (v.kind, v.tokenwise_top, v.batched_top) == (NEAR_TIE_FLIP, 1, 2)
    assert v.margin == pytest.approx(0.003)


def test_flip_above_the_margin_is_structured():
    loose = Thresholds(maxdiff=1.0, margin=0.004)
    v = classify([1.0, 2.3, 2.0], [1.0, 2.0, 2.3], loose)  # diff 0.3 allowed, but a margin-0.3 flip is not
    assert v.kind == STRUCTURED and v.margin == pytest.approx(0.3)


def test_margin_boundary_is_inclusive():
    exact = Thresholds(maxdiff=1.0, margin=0.5)
    assert classify([0.0, 0.5], [0.5, 0.0], exact).kind == NEAR_TIE_FLIP


def test_mismatched_or_empty_vectors_raise():
    with pytest.raises(InputError):
        classify([1.0, 2.0], [1.0], T)
    with pytest.raises(InputError):
        classify([], [], T)


def test_top_two_first_index_wins_a_tie():
    assert verdict.top_two([2.0, 5.0, 5.0, 1.0]) == (1, 5.0, 5.0)


def test_round_up_and_derive_follow_the_stated_rule():
    assert verdict.round_up(1.234e-4) == pytest.approx(1.3e-4)
    assert verdict.round_up(2.0e-4) == pytest.approx(2.0e-4)
    assert verdict.round_up(0.0) == 0.0
    t = verdict.derive([1e-5, 5.0e-5, 3e-5], [])
    assert (t.maxdiff, t.margin) == (pytest.approx(2.0e-4), pytest.approx(1.0e-4))
    t = verdict.derive([5.0e-5], [0.00033])  # a flip seen at a larger margin raises MARGIN to it
    assert t.margin == pytest.approx(3.3e-4)
    assert verdict.derive([0.0], []) == Thresholds(verdict.FLOOR, verdict.FLOOR)


def test_every_quant_type_has_measured_thresholds():
    assert set(qmatmul.QTYPES) <= set(verdict.THRESHOLDS)
    for t in verdict.THRESHOLDS.values():
        assert 0 < t.margin <= t.maxdiff < 1.0  # measured on our kernels: far below memra's 8.0 / 1.0


def test_thresholds_for_a_mixed_file_take_the_loosest():
    table = {"F32": Thresholds(1e-5, 1e-5), "Q4_1": Thresholds(3e-4, 1e-4), "Q8_0": Thresholds(2e-4, 2e-4)}
    assert verdict.thresholds_for(["F32", "Q4_1", "Q8_0"], table) == Thresholds(3e-4, 2e-4)
    assert verdict.thresholds_for(["F32", "Q4_1"], {**table, "F32": Thresholds(1, 1)}) == table["Q4_1"]
    assert verdict.thresholds_for(["F32"], table) == table["F32"]  # an all-F32 file
    with pytest.raises(InputError):
        verdict.thresholds_for(["IQ2_XXS"], table)


def test_the_battery_is_large_and_varied():
    prompts = verdict.read_battery()
    assert len(prompts) >= 100 and len(set(prompts)) == len(prompts)
    assert any("def " in p and "\n" in p for p in prompts)                # code, with newlines decoded
    assert sum(any(ord(c) > 0x2FF for c in p) for p in prompts) >= 12    # other scripts
    assert sum(any(c.isdigit() for c in p) for p in prompts) >= 15
    assert not any(p.startswith("#") for p in prompts)


def test_a_battery_that_is_not_utf8_is_an_input_error(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(InputError):
        verdict.read_battery(path)


def test_the_table_is_what_the_committed_sweep_derives():
    """THRESHOLDS were measured, not copied: docs/verdict_sweep.json (the sweep's every maxdiff
    and flip) gives exactly the table by the stated rule, and covers every type with >= 100
    healthy prompts."""
    sweep = json.loads((Path(__file__).resolve().parents[1] / "docs" / "verdict_sweep.json").read_text())
    assert verdict.thresholds_from_sweep(sweep["runs"]) == verdict.THRESHOLDS
    for qtype in verdict.THRESHOLDS:
        assert sum(r["prompts"] for r in verdict.sweep_runs_holding(sweep["runs"], qtype)) >= 100
    smollm2 = [r for r in sweep["runs"] if r["label"].startswith("SmolLM2")]
    assert smollm2 and smollm2[0]["prompts"] >= 100 and {"Q4_1", "Q8_0"} <= set(smollm2[0]["types"])
