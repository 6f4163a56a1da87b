"""The speculative-sampling rule (needle_wgpu.speculative, pure Python) against its NumPy
definition, and the distribution it produces on a tiny bigram model: every emitted id must
follow the target model, whatever the draft (a chi-square test with a fixed seed)."""

import math
import random

import numpy as np
import pytest

from needle_wgpu import speculative
from needle_wgpu.errors import DepthError, InputError
from needle_wgpu.reference import speculative as reference
from needle_wgpu.sampling import Sampling

VOCAB = 4
# Tiny models: row a is the next-id distribution after id a. Q (the draft) is far from P.
P = np.array([[0.50, 0.20, 0.20, 0.10], [0.10, 0.60, 0.20, 0.10], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.10, 0.80]])
Q = np.array([[0.10, 0.40, 0.40, 0.10], [0.30, 0.30, 0.30, 0.10], [0.70, 0.10, 0.10, 0.10], [0.25, 0.25, 0.25, 0.25]])
CHI2_999 = {15: 37.70}  # the 0.999 quantile of chi-square with 15 degrees of freedom


class Recorder(random.Random):
    """A Random that remembers its draws, to replay them into the NumPy rule."""

    def __init__(self, seed):
        super().__init__(seed)
        self.draws = []

    def random(self):
        u = super().random()
        self.draws.append(u)
        return u


def first_two_ids(rule, rng, k: int, start: int = 0) -> tuple:
    """Rounds of self-speculative decoding on the bigram models until two ids are out."""
    out, x = [], start
    while len(out) < 2:
        drafts, q_rows, previous = [], [], x
        for _ in range(k):
            q = Q[previous]
            previous = speculative.draw(list(q), rng.random())
            drafts.append(previous)
            q_rows.append(list(q))
        p_rows = [list(P[x])] + [list(P[d]) for d in drafts]
        ids = rule(p_rows, q_rows, drafts, rng)
        out += ids
        x = ids[-1]
    return tuple(out[:2])


def chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(np.sum((counts - expected) ** 2 / expected))


def pair_statistic(rule, k: int, rounds: int = 6000, seed: int = 11) -> float:
    rng = random.Random(seed)
    counts = np.zeros((VOCAB, VOCAB))
    for _ in range(rounds):
        a, b = first_two_ids(rule, rng, k)
        counts[a, b] += 1
    expected = rounds * P[0][:, None] * P  # P(a | 0) · P(b | a)
    return chi_square(counts.ravel(), expected.ravel())


@pytest.mark.parametrize("k", [1, 3])
def test_emitted_ids_follow_the_target_model(k):
    assert pair_statistic(speculative.accept, k) < CHI2_999[15]


def test_the_test_catches_a_rule_that_keeps_every_draft():
    """The same statistic on a wrong rule (every draft kept, i.e. the draft's distribution) fails."""
    def keep_all(p_rows, q_rows, drafts, rng):
        return list(drafts) + [speculative.draw(p_rows[-1], rng.random())]

    assert pair_statistic(keep_all, 3) > 10 * CHI2_999[15]


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    """P(first draft kept) = Σ min(p, q) (after id 0: 0.1 + 0.2 + 0.2 + 0.1 = 0.6)."""
    rng, kept, rounds = random.Random(3), 0, 20000
    for _ in range(rounds):
        d = speculative.draw(list(Q[0]), rng.random())
        ids = speculative.accept([list(P[0]), list(P[d])], [list(Q[0])], [d], rng)
        kept += len(ids) == 2
    want = float(np.minimum(P[0], Q[0]).sum())
    assert abs(kept / rounds - want) < 4 * math.sqrt(want * (1 - want) / rounds)


def test_pure_python_rule_equals_the_numpy_definition():
    rng = np.random.default_rng(0)
    for trial in range(300):
        rows = 7
        k = int(rng.integers(1, 5))
        p_rows = rng.dirichlet(np.ones(rows) * 0.5, size=k + 1)
        q_rows = rng.dirichlet(np.ones(rows) * 0.5, size=k)
        drafts = [int(rng.choice(rows, p=q)) for q in q_rows]
        recorder = Recorder(trial)
        got = speculative.accept(p_rows.tolist(), q_rows.tolist(), drafts, recorder)
        assert got == reference.accept(p_rows, q_rows, drafts, recorder.draws), trial


def test_distribution_follows_the_sampling_settings():
    logits = [1.0, 3.0, 2.0, float("nan"), 3.0]
    assert speculative.distribution(logits, Sampling()) == [0, 1.0, 0, 0, 0]  # lowest index on ties
    p = np.array(speculative.distribution(logits, Sampling(temperature=2.0)))
    z = np.exp((np.array([1.0, 3.0, 2.0, -np.inf, 3.0]) - 3.0) / 2.0)
    np.testing.assert_allclose(p, z / z.sum(), rtol=1e-12)
    top2 = speculative.distribution(logits, Sampling(temperature=1.0, top_k=2))
    assert top2[1] == top2[4] == 0.5 and sum(top2) == 1.0
    nucleus = speculative.distribution([0.0, 2.0, 1.0], Sampling(temperature=1.0, top_p=0.6))
    assert nucleus[0] == nucleus[2] == 0.0 and nucleus[1] == 1.0  # 2.0 alone holds 0.67 of the mass
    assert speculative.distribution([float("-inf")] * 3, Sampling(temperature=1.0)) == [1.0, 0, 0]


@pytest.mark.parametrize("bad, error", [((20, 2), InputError), ((1, 2), DepthError), ("24", InputError),
                                        ((2, 3, 4), InputError), ((None, 3), DepthError)])
def test_speculative_option(bad, error):
    with pytest.raises(error):
        speculative.speculative_option(bad, 20)
    assert speculative.speculative_option((4, 1e9), 20) == (4, speculative.MAX_DRAFT)
    assert speculative.speculative_option((4, float("nan")), 20) == (4, 4)
    assert speculative.speculative_option(None, 20) is None


def test_bench_pairs():
    from needle_wgpu.cli.bench import speculative_pairs

    assert speculative_pairs(["2,4", "10,2"], 20) == [(2, 4), (10, 2)]
    assert speculative_pairs([], 20) == [(d, k) for d in (2, 5, 10) for k in (3, 7)]
    assert speculative_pairs([], 4) == [(2, 3), (2, 7)]
    with pytest.raises(InputError):
        speculative_pairs(["2;4"], 20)
