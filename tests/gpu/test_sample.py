"""The GPU sampler vs the reference sampler (needle_wgpu/reference/sampling.py), id for id."""

import struct

import numpy as np
import pytest

from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.gpu import Plan, UniformArena
from needle_wgpu.kernels import sample as sample_ops
from needle_wgpu.kernels.sample import SampleResult
from needle_wgpu.reference import sampling as ref
from needle_wgpu.sampling import Sampling

pytestmark = pytest.mark.gpu
F32 = np.float32
CONTEXT = 64


class Sampler:
    """One logits buffer of up to 4 rows of 8192, a token buffer and a result buffer."""

    def __init__(self, device):
        self.device = device
        self.logits = device.buffer(4 * 4 * 8192, label="logits")
        self.tokens = device.buffer(4 * CONTEXT, label="tokens")
        self.result = device.buffer(16, label="result")
        self.step = device.buffer(16, label="step", usage="uniform")
        self.arena = UniformArena(device, capacity=1 << 20)

    def load(self, logits):
        """Upload [T, rows] logits (the sampler reads the last row)."""
        logits = np.atleast_2d(np.asarray(logits, F32))
        self.device.write(self.logits, logits.tobytes())
        self.shape = logits.shape

    def draw(self, sampling, pos0=10, context=CONTEXT) -> SampleResult:
        T, rows = self.shape
        plan = Plan(self.device, "sample")
        sample_ops.sample(plan, self.arena, self.step, logits=self.logits, logits_offset=(T - 1) * rows, rows=rows,
                          tokens=self.tokens, result=self.result, context=context, positions=T, sampling=sampling)
        self.device.write(self.step, struct.pack("<4I", pos0, 0, 0, 0))
        self.device.write(self.tokens, b"\xff" * (4 * CONTEXT))
        self.device.run(plan)
        return SampleResult.parse(self.device.read(self.result, 16))

    def token_at(self, position):
        return struct.unpack("<I", self.device.read(self.tokens, 4, 4 * position))[0]


@pytest.fixture(scope="module")
def sampler(device):
    return Sampler(device)


def logits_of(rows, seed, scale=3.0):
    return np.random.default_rng(seed).normal(scale=scale, size=rows).astype(F32)


def reference_id(logits, s: Sampling, position):
    return ref.sample(logits, s.temperature, s.top_k, s.top_p, s.seed, position)


# ---------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("rows", [512, 1000, 8192])
def test_greedy_is_argmax(sampler, rows):
    for seed in range(3):
        x = logits_of(rows, seed)
        sampler.load(x)
        got = sampler.draw(Sampling.saturate(0.0))
        assert got.id == int(np.argmax(x)) == ref.greedy(x)
        assert got.greedy and got.written and got.position == 11
        assert got.logit == x[got.id]
        assert sampler.token_at(11) == got.id


def test_greedy_ties_lowest_index(sampler):
    x = logits_of(8192, 1)
    x[[5000, 300, 7000, 301]] = 50.0  # ties spread over several threads
    sampler.load(x)
    assert sampler.draw(Sampling.saturate(0.0)).id == 300 == int(np.argmax(x))
    assert sampler.draw(Sampling.saturate(1.0, top_k=1, seed=9)).id == 300  # top_k 1 is greedy
    sampler.load(np.zeros(777, F32))
    assert sampler.draw(Sampling.saturate(0.0)).id == 0


def test_top_k_one_equals_greedy(sampler):
    for seed in range(5):
        x = logits_of(512, 40 + seed)
        sampler.load(x)
        got = sampler.draw(Sampling.saturate(2.0, top_k=1, seed=seed))
        assert got.id == int(np.argmax(x)) and got.greedy


def test_tiny_top_p_equals_greedy(sampler):
    for seed in range(8):
        x = logits_of(8192, 60 + seed, scale=1.0)
        sampler.load(x)
        got = sampler.draw(Sampling.saturate(1.5, top_p=1e-6, seed=seed))
        assert got.id == int(np.argmax(x)) and not got.greedy


# ---------------------------------------------------------------------------------- sampling


CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=40),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.9, top_k=300, top_p=0.75),
]


@pytest.mark.parametrize("rows", [512, 8192])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_matches_reference_id_for_id(sampler, rows, config):
    x = logits_of(rows, rows, scale=2.0)
    sampler.load(x)
    picks = []
    for seed in range(40):
        s = Sampling.saturate(**config, seed=seed * 7919 + 1)
        got = sampler.draw(s, pos0=seed % 20)
        assert got.id == reference_id(x, s, seed % 20 + 1), seed
        assert got.position == seed % 20 + 1 and not got.greedy
        picks.append(got.id)
    assert len(set(picks)) > 3  # it does sample
    if "top_k" in config:
        allowed = set(np.argsort(-x, kind="stable")[: config["top_k"]].tolist())
        assert set(picks) <= allowed


def test_top_k_cut_through_ties(sampler):
    """K ends inside a group of equal logits: the lowest indices of the group are kept."""
    x = np.full(1000, -5.0, F32)
    x[[10, 20, 999]] = 3.0
    x[[7, 400, 500, 600, 950]] = 2.0  # K = 5 keeps 7 and 400 of these
    sampler.load(x)
    picks = set()
    for seed in range(60):
        s = Sampling.saturate(3.0, top_k=5, seed=seed)
        got = sampler.draw(s)
        assert got.id == reference_id(x, s, 11)
        picks.add(got.id)
    assert picks <= {10, 20, 999, 7, 400} and {7, 400} & picks


def test_last_row_and_context_end(sampler):
    rows = 512
    x = np.stack([logits_of(rows, 1), logits_of(rows, 2), logits_of(rows, 3)])
    sampler.load(x)
    s = Sampling.saturate(0.8, seed=123)
    got = sampler.draw(s, pos0=20)  # rows are positions 20, 21, 22: the draw is for position 23
    assert got.position == 23 and got.id == reference_id(x[2], s, 23)
    assert sampler.token_at(23) == got.id
    end = sampler.draw(s, pos0=CONTEXT - 3)  # position CONTEXT does not exist
    assert not end.written and end.position == CONTEXT
    assert sampler.draw(s, pos0=20).id == got.id  # reproducible: no hidden state


def test_non_finite_logits(sampler):
    rows = 600
    sampler.load(np.full(rows, -np.inf, F32))
    for s in (Sampling.saturate(0.0), Sampling.saturate(1.0, seed=3)):
        got = sampler.draw(s)
        assert got.id == 0 and got.no_finite
    sampler.load(np.full(rows, np.nan, F32))
    assert sampler.draw(Sampling.saturate(1.0, seed=3)).id == 0
    x = logits_of(rows, 8)
    x[::3] = np.nan
    x[1::7] = -np.inf
    x[np.argmax(np.nan_to_num(x, nan=-1e30))] = np.nan  # the largest finite one becomes NaN
    sampler.load(x)
    assert sampler.draw(Sampling.saturate(0.0)).id == ref.greedy(x)
    for seed in range(20):
        s = Sampling.saturate(1.0, top_p=0.95, seed=seed)
        got = sampler.draw(s)
        assert np.isfinite(x[got.id]) and got.id == reference_id(x, s, 11)
    x[[100, 40]] = np.inf
    sampler.load(x)
    got = sampler.draw(Sampling.saturate(1.0, seed=1))
    assert got.id == 40 and got.greedy


def test_too_many_rows(device):
    arena, plan = UniformArena(device), Plan(device, "x")
    scratch = device.buffer(64, label="scratch")
    with pytest.raises(UnsupportedModelError):
        sample_ops.sample(plan, arena, scratch, logits=scratch, logits_offset=0, rows=256 * 64 + 1, tokens=scratch,
                          result=scratch, context=4, positions=1, sampling=Sampling.saturate(1.0))


# ---------------------------------------------------------------------------------- the reference


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


def test_reference_rng_is_position_keyed():
    assert ref.uniform(1, 2) != ref.uniform(1, 3) and ref.uniform(1, 2) != ref.uniform(2, 2)
    values = np.array([ref.uniform(42, p) for p in range(4000)])
    assert 0.0 <= values.min() and values.max() < 1.0 and abs(values.mean() - 0.5) < 0.02
