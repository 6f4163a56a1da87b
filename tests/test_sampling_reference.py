"""The sampler's definition (needle_wgpu/reference/sampling.py) and its host-side constants
(needle_wgpu/sampling.py), without a GPU; tests/gpu/test_sample.py holds the kernels to it."""

from decimal import ROUND_HALF_EVEN, Decimal, getcontext

import numpy as np

from needle_wgpu import sampling
from needle_wgpu.reference import sampling as ref
from needle_wgpu.sampling import WEIGHT_ONE, Sampling, sampler_constants

F32 = np.float32


def test_reference_distribution():
    """The reference sampler draws from softmax(l / T) restricted to top-k and top-p."""
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], F32)
    counts = np.zeros(len(x))
    draws = 6000
    for seed in range(draws):
        counts[ref.sample(x, 0.8, 0, 1.0, seed, 5)] += 1
    p = np.exp(x / 0.8)
    p /= p.sum()
    assert np.abs(counts / draws - p).max() < 4 * np.sqrt(p.max() / draws)
    nucleus = {ref.sample(x, 1.0, 0, 0.6, seed, 9) for seed in range(400)}
    assert nucleus == {0, 1}  # p = 0.53, 0.20, ...: the first two reach 0.6
    top2 = {ref.sample(x, 5.0, 2, 1.0, seed, 9) for seed in range(400)}
    assert top2 == {0, 1}


def test_reference_follows_its_definition_literally():
    """The vectorised reference against a plain loop over the six steps of its docstring."""
    rng = np.random.default_rng(3)
    for case in range(40):
        rows = int(rng.integers(1, 60))
        x = rng.integers(-4, 4, size=rows).astype(F32) * F32(rng.choice([0.5, 1.0, 3.0]))
        x[rng.random(rows) < 0.1] = -np.inf
        t, k, p = float(rng.choice([0.3, 1.0, 4.0])), int(rng.integers(0, rows + 2)), float(rng.choice([0.2, 0.7, 1.0]))
        seed, position = int(rng.integers(0, 1 << 32)), int(rng.integers(0, 1000))
        assert ref.sample(x, t, k, p, seed, position) == literal_sample(x, t, k, p, seed, position), case


def literal_sample(x, t, k, p, seed, position):
    greedy, scale, _, p_fixed = sampler_constants(Sampling(t, k, p, seed))
    if greedy or not np.isfinite(x).any() or np.isposinf(x).any():
        return int(np.argmax(np.where(np.isnan(x), -np.inf, x)))
    top = F32(np.nanmax(x))
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))  # by logit, ties by index
    candidates = set(order[: (k or len(x))])
    w = {}
    for i in range(len(x)):
        x24 = (x[i] - top) * F32(scale)  # no subnormal logits here
        inside = i in candidates and x24 >= -17 * WEIGHT_ONE
        w[i] = int(ref.fixed_exp(np.array([int(-x24)]))[0]) if inside else 0
    theta = -np.inf
    if p_fixed < WEIGHT_ONE:
        target = max(1, -(-(p_fixed * sum(w.values())) // WEIGHT_ONE))
        for value in sorted({x[i] for i in w if w[i] > 0}, reverse=True):
            if sum(w[i] for i in w if x[i] >= value) >= target:
                theta = value
                break
    kept = [i for i in range(len(x)) if w[i] > 0 and x[i] >= theta]
    goal = ref.draw24(seed, position) * sum(w[i] for i in kept) // WEIGHT_ONE
    running = 0
    for i in kept:
        running += w[i]
        if running > goal:
            return i
    raise AssertionError("the goal is below the kept mass")


def test_reference_rng_is_position_keyed():
    assert ref.uniform(1, 2) != ref.uniform(1, 3) and ref.uniform(1, 2) != ref.uniform(2, 2)
    values = np.array([ref.uniform(42, p) for p in range(4000)])
    assert 0.0 <= values.min() and values.max() < 1.0 and abs(values.mean() - 0.5) < 0.02


def test_sampler_constants():
    assert sampler_constants(Sampling.saturate(0.0)) == (True, 0.0, 0, WEIGHT_ONE)
    assert sampler_constants(Sampling(1e-300, 0, 1.0, 0))[0]  # rounds to 0 as a float32
    greedy, scale, _, p_fixed = sampler_constants(Sampling.saturate(1e-40, top_p=1e-9))
    assert not greedy and scale == 2.0 ** 124 and p_fixed == 16  # 1/T capped at 2^100; top_p 1e-6
    assert sampler_constants(Sampling.saturate(2.0, 7, top_p=0.5)) == (False, 2.0 ** 23, 7, WEIGHT_ONE // 2)
    # Unsaturated values still mean one thing on both sides: NaN temperature is greedy, NaN
    # top_p is off, a negative top_k is off.
    assert sampler_constants(Sampling(float("nan"), 0, 1.0, 0))[0]
    assert sampler_constants(Sampling(1.0, -3, float("nan"), 0)) == (False, 2.0 ** 24, 0, WEIGHT_ONE)


def test_fixed_exp_is_within_one_unit_of_exp():
    z = np.concatenate([np.arange(0, 4096), np.arange(0, 17 * WEIGHT_ONE + 1, 997)]).astype(np.uint64)
    got = ref.fixed_exp(z).astype(np.int64)
    want = np.exp(-z.astype(np.float64) / WEIGHT_ONE) * WEIGHT_ONE
    assert np.abs(got - want).max() < 1.0
    assert got[0] == WEIGHT_ONE and (np.diff(got[:4096]) <= 0).all()


def test_exp_constants_are_the_rounded_values():
    getcontext().prec = 60
    ln2 = Decimal(2).ln()
    near = lambda d: int(d.to_integral_value(rounding=ROUND_HALF_EVEN))  # noqa: E731
    assert sampling.LOG2E_Q30 == near(2 ** 30 / ln2) and sampling.LN2_Q31 == near(ln2 * 2 ** 31)
    assert (sampling.EXP_C3, sampling.EXP_C4) == (near(Decimal(2 ** 31) / 6), near(Decimal(2 ** 31) / 24))
    assert sampling.EXP2_SIXTEENTHS == tuple(near(2 ** 31 * (-(Decimal(a) / 16) * ln2).exp()) for a in range(16))
