"""min_p, the penalties, logit_bias and logprobs without a GPU: how each option saturates, the
NumPy definition of the logits pass (reference/sampling.py steps 0a, 0b and 4b) and the pure-Python
log-softmax (needle_wgpu/logprobs.py)."""

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needle_wgpu.logprobs import log_softmax, row_values, saturate_top_logprobs, token_logprob
from needle_wgpu.reference import sampling as ref
from needle_wgpu.sampling import MAX_BIAS_ENTRIES, WHOLE_CONTEXT, Sampling, min_weight

F32 = np.float32
NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------- saturation


def test_defaults_are_the_plain_sampling():
    s = Sampling()
    assert s == Sampling(0.0, 0, 1.0, 0) == Sampling.saturate()
    assert not s.penalized and not s.processes_logits and min_weight(Sampling(1.0)) == 0
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.penalty_last_n,
            s.logit_bias) == (0.0, 1.0, 0.0, 0.0, 64, ())


@pytest.mark.parametrize("value,want", [(NAN, 0.0), (-1, 0.0), (0, 0.0), (0.05, 0.05), (1, 1.0), (7, 1.0),
                                        (INF, 1.0), ("0.2", 0.2), (None, 0.0), ([1], 0.0)])
def test_min_p(value, want):
    assert Sampling.saturate(1.0, min_p=value).min_p == want


@pytest.mark.parametrize("value,want", [(NAN, 1.0), (0, 1.0), (-3, 1.0), (1e-9, 0.01), (1.3, 1.3), (1e9, 100.0),
                                        (INF, 100.0), ("x", 1.0)])
def test_repetition_penalty(value, want):
    assert Sampling.saturate(repetition_penalty=value).repetition_penalty == want


@pytest.mark.parametrize("value,want", [(NAN, 0.0), (-INF, -2.0), (-0.5, -0.5), (1.5, 1.5), (10 ** 400, 2.0),
                                        (None, 0.0)])
def test_presence_and_frequency_penalties(value, want):
    s = Sampling.saturate(presence_penalty=value, frequency_penalty=value)
    assert s.presence_penalty == s.frequency_penalty == want


@pytest.mark.parametrize("value,want", [(NAN, 64), (None, 64), ("abc", 64), (0, 0), (7.9, 7), (Fraction(9, 2), 4),
                                        (-1, WHOLE_CONTEXT), (-5, WHOLE_CONTEXT), (INF, WHOLE_CONTEXT),
                                        (2 ** 40, WHOLE_CONTEXT), (4096, 4096)])
def test_penalty_last_n(value, want):
    assert Sampling.saturate(penalty_last_n=value).penalty_last_n == want


def test_penalties_off_when_the_window_is_empty_or_every_penalty_is_neutral():
    assert Sampling(repetition_penalty=1.1).penalized and Sampling(frequency_penalty=-0.1).penalized
    assert not Sampling(repetition_penalty=1.1, penalty_last_n=0).penalized
    assert not Sampling(repetition_penalty=NAN, presence_penalty=NAN).penalized


def test_logit_bias_saturates_ids_and_values():
    bias = {"50": -1e9, 7.0: NAN, 200: 3, -1: 4, "x": 2, 3: 0.1, 9: 0, "12 ": INF, 2 ** 32: 1, True: -INF,
            (1, 2): 5, 4: "abc"}
    s = Sampling.saturate(1.0, logit_bias=bias)
    assert s.logit_bias == ((1, -100.0), (3, float(F32(0.1))), (12, 100.0), (50, -100.0), (200, 3.0))
    assert Sampling.saturate(logit_bias=bias, vocab=100).logit_bias == s.logit_bias[:4]  # ids >= vocab dropped
    assert Sampling(logit_bias=[(5, 1.0), (5, 2.0)]).logit_bias == ((5, 2.0),)  # the last one counts
    for garbage in (None, 3, "abc", b"\x01", [1, 2, 3], float("nan")):
        assert Sampling(logit_bias=garbage).logit_bias == ()
    s2 = Sampling(1.0, logit_bias=s.logit_bias)  # the stored form reads back as itself
    assert s2 == s and hash(s2) == hash(Sampling(1.0, logit_bias=bias))


def test_logit_bias_is_bounded():
    huge = {i: 1.0 for i in range(5000, 0, -1)}
    s = Sampling(logit_bias=huge)
    assert len(s.logit_bias) == MAX_BIAS_ENTRIES and s.logit_bias[0][0] == 1  # the lowest ids
    assert s.logit_bias[-1][0] == MAX_BIAS_ENTRIES and s.processes_logits
    assert hash(s) == hash(Sampling(logit_bias=dict(reversed(list(huge.items())))))


anything = st.one_of(
    st.integers(), st.integers(-(2 ** 80), 2 ** 80), st.floats(), st.fractions(),
    st.decimals(allow_nan=True, allow_infinity=True), st.complex_numbers(), st.text(max_size=12),
    st.binary(max_size=8), st.none(), st.booleans(), st.lists(st.integers(), max_size=2), st.timedeltas(),
    st.sampled_from([Decimal("1e999999999"), Decimal("-sNaN"), Fraction(10 ** 400), "1e400", "-inf", "nan", "²",
                     "٣", " 42 ", object()]))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(value=anything, bias=st.one_of(anything, st.dictionaries(anything.filter(lambda v: v.__hash__), anything,
                                                                 max_size=6)))
def test_every_option_takes_anything(value, bias):
    """Never raises; every field in its documented range; always hashable (a plan key)."""
    s = Sampling.saturate(1.0, min_p=value, repetition_penalty=value, presence_penalty=value,
                          frequency_penalty=value, penalty_last_n=value, logit_bias=bias, vocab=512)
    assert 0.0 <= s.min_p <= 1.0 and 0.01 <= s.repetition_penalty <= 100.0
    assert -2.0 <= s.presence_penalty <= 2.0 and -2.0 <= s.frequency_penalty <= 2.0
    assert s.penalty_last_n == WHOLE_CONTEXT or 0 <= s.penalty_last_n < 2 ** 31
    assert all(type(t) is int and 0 <= t < 512 and -100.0 <= b <= 100.0 and b != 0 for t, b in s.logit_bias)
    assert [t for t, _ in s.logit_bias] == sorted({t for t, _ in s.logit_bias})
    assert hash(s) == hash(Sampling(**vars(s))) and 0 <= saturate_top_logprobs(value) <= 20


def test_top_logprobs_saturates():
    assert [saturate_top_logprobs(v) for v in (NAN, -3, 0, 2.7, 20, 21, INF, "5", None)] == [0, 0, 0, 2, 20, 20, 0,
                                                                                          5, 0]


# ---------------------------------------------------------------------------------- the reference


def test_penalty_window():
    tokens = np.arange(100, 120)
    assert ref.penalty_window(tokens, 9, 4).tolist() == [106, 107, 108, 109]
    assert ref.penalty_window(tokens, 2, 64).tolist() == [100, 101, 102]  # the context's start
    assert ref.penalty_window(tokens, 5, WHOLE_CONTEXT).tolist() == list(range(100, 106))


def test_process_logits_follows_its_definition():
    x = np.array([2.0, -2.0, 0.0, 4.0, -np.inf, np.nan, 1.0, 3.0], F32)
    s = Sampling(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: -10.0, 6: 1.5})
    got = ref.process_logits(x, s, window=[0, 1, 1, 2, 4, 5, 7, 7, 7, 99])
    # bias first (7: 3 - 10 = -7, 6: 2.5, not penalized); then x/2 or x*2, minus 0.5 + 0.25·count
    want = [2 / 2 - 0.75, -4 - 1.0, 0 - 0.75, 4.0, -np.inf, np.nan, 2.5, -14 - 1.25]
    np.testing.assert_array_equal(got, np.array(want, F32))
    assert x[7] == 3.0  # the input is left as it was
    only_bias = ref.process_logits(x, Sampling(logit_bias={1: 100, 20: 5}), window=[0, 1])
    assert only_bias[1] == 98.0 and np.array_equal(np.delete(only_bias, 1), np.delete(x, 1), equal_nan=True)


def test_repetition_penalty_changes_the_greedy_choice():
    x = np.array([5.0, 4.0, 1.0], F32)
    tokens = [0, 0]
    assert ref.sample_with(x, Sampling(), 2, tokens) == 0
    assert ref.sample_with(x, Sampling(repetition_penalty=1.5), 2, tokens) == 1  # 5 / 1.5 < 4
    assert ref.sample_with(x, Sampling(frequency_penalty=0.6), 2, tokens) == 1  # 5 - 1.2
    assert ref.sample_with(x, Sampling(frequency_penalty=0.4), 2, tokens) == 0  # 5 - 0.8
    assert ref.sample_with(x, Sampling(presence_penalty=2.0, penalty_last_n=0), 2, tokens) == 0  # window off
    assert ref.sample_with(x, Sampling(logit_bias={2: 100}), 2, tokens) == 2


def test_min_p_keeps_tokens_relative_to_the_most_likely():
    x = np.array([0.0, -0.5, -3.0, -4.0], F32)  # relative probabilities 1, 0.61, 0.05, 0.018
    seen = {m: {ref.sample(x, 1.0, 0, 1.0, seed, 7, min_p=m) for seed in range(1000)} for m in (0.0, 0.04, 0.5, 1.0)}
    assert seen[0.0] == {0, 1, 2, 3} and seen[0.04] == {0, 1, 2} and seen[0.5] == {0, 1} and seen[1.0] == {0}
    assert min_weight(Sampling(1.0, min_p=0.5)) == 1 << 23 and min_weight(Sampling(0.0, min_p=0.5)) == 0
    # the draws of the kept tokens are the plain sampler's over the same weights (renormalised)
    w = ref.weights(ref.order_keys(x), int(ref.order_keys(x).max()), 2.0 ** 24)
    assert (w >= (1 << 23)).sum() == 2


# ---------------------------------------------------------------------------------- logprobs


def test_log_softmax_matches_numpy():
    rng = np.random.default_rng(3)
    x = rng.normal(scale=4, size=500).astype(F32)
    x[[3, 9]] = -np.inf
    ours = np.array(log_softmax(x.tolist()))
    xs = x.astype(np.float64)
    theirs = xs - (xs[np.isfinite(xs)].max() + np.log(np.exp(xs - xs[np.isfinite(xs)].max()).sum()))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
    assert math.isclose(math.fsum(math.exp(v) for v in ours), 1.0, rel_tol=1e-12)


def test_token_logprob_ties_infinities_and_masks():
    values = row_values(np.array([1.0, 3.0, 3.0, np.nan, 2.0], F32).tobytes(), 5)
    got = token_logprob(values, 2, 3)
    assert [t for t, _ in got.top] == [1, 2, 4] and got.top[0][1] == got.top[1][1] == got.logprob
    assert values[3] == -math.inf and got.as_dict()["top_logprobs"][2]["token"] == 4
    assert token_logprob(values, 3, 0) == type(got)(3, -math.inf, ())
    masked = row_values(np.array([1.0, 3.0, 3.0, 0.0, 2.0], F32).tobytes(), 5, mask=bytes([0b10001]))
    assert token_logprob(masked, 4, 1).logprob == pytest.approx(2 - math.log(math.e + math.e ** 2))
    shared = token_logprob([math.inf, 0.0, math.inf], 2, 2)
    assert shared.logprob == -math.log(2) and shared.top == ((0, -math.log(2)), (2, -math.log(2)))
    assert token_logprob([-math.inf] * 3, 0, 1).logprob == -math.inf
