"""logit_bias, the penalties (logits_process.wgsl) and min_p (inside both samplers) against the
reference (needle_wgpu/reference/sampling.py: process_logits, sample_with): the processed row
bit for bit, and the sampled id id for id, one-workgroup and staged."""

import struct

import numpy as np
import pytest

from needle_wgpu.gpu import Plan, UniformArena
from needle_wgpu.kernels import sample as sample_ops
from needle_wgpu.kernels.sample import ONE_WORKGROUP, STAGED, SampleResult
from needle_wgpu.reference import sampling as ref
from needle_wgpu.sampling import Sampling, min_weight, sampler_constants

pytestmark = pytest.mark.gpu
F32 = np.float32
CONTEXT = 64
VARIANTS = [ONE_WORKGROUP, STAGED]


class Harness:
    """[T, rows] logits, the session-like ``tokens`` (ids by absolute position) and one plan per draw."""

    def __init__(self, device, capacity=3 * 20000):
        self.device = device
        self.logits = device.buffer(4 * capacity, label="logits")
        self.tokens = device.buffer(4 * (CONTEXT + 1), label="tokens")
        self.result = device.buffer(16, label="result")
        self.step = device.buffer(16, label="step", usage="uniform")
        self.arena = UniformArena(device, capacity=1 << 16)

    def plan(self, s, rows, T, variant) -> Plan:
        self.arena.used = 0
        plan = Plan(self.device, "sample")
        sample_ops.sample(plan, self.arena, self.step, logits=self.logits, logits_offset=(T - 1) * rows, rows=rows,
                          tokens=self.tokens, result=self.result, context=CONTEXT, positions=T, sampling=s,
                          variant=variant)
        return plan

    def draw(self, x, s, tokens, pos0, variant):
        """Sample the last row of ``x`` ([T, rows]) at positions pos0 … pos0 + T - 1; returns
        (the result, the logits as the sampler left them)."""
        x = np.atleast_2d(np.asarray(x, F32))
        T, rows = x.shape
        self.device.write(self.logits, x.tobytes())
        self.device.write(self.tokens, np.asarray(tokens, np.uint32).tobytes())
        self.device.write(self.step, struct.pack("<4I", pos0, 0, 0, 0))
        self.device.run(self.plan(s, rows, T, variant))
        got = SampleResult.parse(self.device.read(self.result, 16))
        after = np.frombuffer(self.device.read(self.logits, 4 * x.size), F32).reshape(T, rows)
        return got, after


@pytest.fixture(scope="module")
def harness(device):
    return Harness(device)


def history(rows, rng, hot):
    """CONTEXT ids: mostly the ``hot`` ids (so counts > 1), some random, some at or above rows."""
    tokens = rng.choice(hot, size=CONTEXT + 1).astype(np.uint32)
    tokens[rng.random(CONTEXT + 1) < 0.2] = rng.integers(0, rows, size=1)[0]
    tokens[[5, 17]] = [rows, 0xFFFFFFFF]  # saturated prompt ids: no logit, skipped
    return tokens


PROCESSING = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.5, penalty_last_n=7),
    dict(presence_penalty=1.5, frequency_penalty=0.3, penalty_last_n=-1),
    dict(logit_bias={3: -100, 10: 7.5, 999: 2.0, 50000: 1.0}),
    dict(repetition_penalty=1.3, presence_penalty=-0.7, frequency_penalty=2.0, penalty_last_n=1000,
         logit_bias={0: 1.25, 11: -3.0}),
]


@pytest.mark.parametrize("rows", [1000, 20000])
@pytest.mark.parametrize("options", PROCESSING, ids=lambda o: "-".join(sorted(o)))
def test_processed_row_equals_the_reference_bit_for_bit(harness, device, rows, options):
    """Three rows per chunk (the last is processed, the others untouched), NaN and ±inf logits,
    ids out of the vocabulary in the window, windows past the context's start."""
    rng = np.random.default_rng(rows + len(options))
    x = rng.normal(scale=3.0, size=(3, rows)).astype(F32)
    hot = rng.integers(0, rows, size=12)
    x[2, hot[:2]] = [np.nan, -np.inf]
    x[2, hot[2]] = np.inf
    x[2, hot[3]] = 0.0
    tokens = history(rows, rng, hot)
    s = Sampling.saturate(**options, vocab=rows)
    for pos0 in (0, 9, CONTEXT - 3):
        _, after = harness.draw(x, s, tokens, pos0, None)
        last = pos0 + 2
        window = ref.penalty_window(tokens, last, s.penalty_last_n) if s.penalized else ()
        want = ref.process_logits(x[2], s, window)
        assert np.array_equal(after[2].view(np.uint32), want.view(np.uint32)), (pos0, options)
        assert np.array_equal(after[:2], x[:2])
        assert not np.array_equal(want, x[2], equal_nan=True)  # the case changes something
    counts = sample_ops.penalty_counts(device, rows)
    assert not np.frombuffer(device.read(counts, 4 * rows), np.uint32).any()  # left zero for the next plan


SAMPLED = [
    dict(temperature=0.0, repetition_penalty=3.0),
    dict(temperature=0.9, repetition_penalty=1.5, presence_penalty=0.5),
    dict(temperature=1.2, top_k=50, frequency_penalty=1.0, logit_bias={7: 5.0}),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=2.0, top_p=0.9, min_p=0.3),
    dict(temperature=0.8, top_k=400, top_p=0.95, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.2,
         logit_bias={1: -100, 2: 3.0}),
]


@pytest.mark.parametrize("variant,rows", [(ONE_WORKGROUP, 1000), (STAGED, 1000), (STAGED, 20000)])
@pytest.mark.parametrize("options", SAMPLED, ids=lambda o: "-".join(sorted(o)))
def test_ids_match_the_reference(harness, variant, rows, options):
    rng = np.random.default_rng(rows * 7 + len(options))
    x = rng.normal(scale=2.0, size=rows).astype(F32)
    hot = np.argsort(-x)[:6]  # the likely ids are the repeated ones: the penalties matter
    tokens = history(rows, rng, hot)
    picks = []
    for seed in range(10):
        s = Sampling.saturate(**options, seed=seed * 7919 + 3, vocab=rows)
        got, _ = harness.draw(x, s, tokens, 10 + seed, variant)
        assert got.id == ref.sample_with(x, s, 11 + seed, tokens), (seed, options, variant)
        picks.append(got.id)
    plain = [ref.sample_with(x, Sampling.saturate(options.get("temperature", 0.0), options.get("top_k", 0),
                                                  options.get("top_p", 1.0), seed * 7919 + 3), 11 + seed, tokens)
             for seed in range(10)]
    assert picks != plain  # the option changes the draws


@pytest.mark.parametrize("variant", VARIANTS)
def test_min_p_one_is_greedy_and_cuts_the_tail(harness, variant):
    rows = 3000
    rng = np.random.default_rng(4)
    x = rng.normal(scale=0.5, size=rows).astype(F32)  # flat: without min_p many ids are drawn
    tokens = np.zeros(CONTEXT + 1, np.uint32)
    top = int(np.argmax(x))
    wide, narrow = set(), set()
    for seed in range(20):
        assert harness.draw(x, Sampling(1.0, seed=seed, min_p=1.0), tokens, 3, variant)[0].id == top
        wide.add(harness.draw(x, Sampling(1.0, seed=seed), tokens, 3, variant)[0].id)
        narrow.add(harness.draw(x, Sampling(1.0, seed=seed, min_p=0.8), tokens, 3, variant)[0].id)
    keep = np.flatnonzero(x >= x.max() + np.log(0.8) - 1e-6)
    assert narrow <= set(keep.tolist()) and len(wide) > len(narrow)


def test_min_p_weights_equal_the_reference(harness, device):
    """The staged sampler's weights buffer with min_p: step 4 then 4b, bit for bit."""
    rows = 20000
    x = np.random.default_rng(8).normal(scale=2.0, size=rows).astype(F32)
    tokens = np.zeros(CONTEXT + 1, np.uint32)
    for s in (Sampling(0.7, seed=1, min_p=0.01), Sampling(3.0, seed=2, min_p=0.5)):
        got, _ = harness.draw(x, s, tokens, 3, STAGED)
        keys = ref.order_keys(x)
        want = ref.weights(keys, int(keys.max()), sampler_constants(s)[1])
        want[want < min_weight(s)] = 0
        weights = np.frombuffer(device.read(sample_ops.shared_scratch(device, rows).weights, 4 * rows), np.uint32)
        assert np.array_equal(weights, want) and 0 < (want > 0).sum() < rows // 2
        assert got.id == ref.sample_with(x, s, 4)


def test_plain_settings_build_the_same_dispatches(harness):
    """The logits pass is in the plan only when asked: none for the defaults or min_p, one for a
    bias alone, two with penalties (also with a bias)."""
    for variant, plain, sampled in ((ONE_WORKGROUP, 1, 1), (STAGED, 2, 12)):
        def count(**options):
            return len(harness.plan(Sampling.saturate(**options, vocab=1000), 1000, 1, variant))
        assert count() == count(penalty_last_n=0, repetition_penalty=2.0) == count(min_p=0.5) == plain
        assert count(temperature=1.0, top_k=5, top_p=0.5) == count(temperature=1.0, top_k=5, top_p=0.5,
                                                                   min_p=0.2) == sampled
        assert count(logit_bias={1: 2.0}) == plain + 1
        assert count(repetition_penalty=1.1) == count(frequency_penalty=1.0, logit_bias={1: 2.0}) == plain + 2
        assert count(logit_bias={5000: 1.0}) == plain  # past the vocabulary (saturate drops it)
