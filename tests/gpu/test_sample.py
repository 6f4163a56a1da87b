"""The GPU samplers vs the reference sampler (needle_wgpu/reference/sampling.py), id for id.

Both variants (one workgroup up to 16,384 rows, staged for any size) run the same cases where
both apply; the large vocabularies (49,152 SmolLM2, 262,144 Gemma 3) run a few cases each.
"""

import struct

import numpy as np
import pytest

from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.gpu import Plan, UniformArena
from needle_wgpu.kernels import sample as sample_ops
from needle_wgpu.kernels.sample import ONE_WORKGROUP, STAGED, SampleResult
from needle_wgpu.reference import sampling as ref
from needle_wgpu.sampling import Sampling, sampler_constants

pytestmark = pytest.mark.gpu
F32 = np.float32
CONTEXT = 64
CAPACITY = 4 * 8192 + 262144  # floats: four rows of 8192, or one of 262,144 and a bit
VARIANTS = [ONE_WORKGROUP, STAGED]


class Sampler:
    """One logits buffer, a token buffer and a result buffer; each draw builds a fresh plan."""

    def __init__(self, device):
        self.device = device
        self.logits = device.buffer(4 * CAPACITY, label="logits")
        self.tokens = device.buffer(4 * CONTEXT, label="tokens")
        self.result = device.buffer(16, label="result")
        self.step = device.buffer(16, label="step", usage="uniform")
        self.arena = UniformArena(device, capacity=1 << 16)

    def load(self, logits):
        """Upload [T, rows] logits (the sampler reads the last row)."""
        logits = np.atleast_2d(np.asarray(logits, F32))
        self.device.write(self.logits, logits.tobytes())
        self.shape = logits.shape

    def plan(self, sampling, variant=None, context=CONTEXT) -> Plan:
        T, rows = self.shape
        self.arena.used = 0  # each plan runs once, before the next one is built
        plan = Plan(self.device, "sample")
        sample_ops.sample(plan, self.arena, self.step, logits=self.logits, logits_offset=(T - 1) * rows,
                          rows=rows, tokens=self.tokens, result=self.result, context=context, positions=T,
                          sampling=sampling, variant=variant)
        return plan

    def run(self, plan, pos0=10) -> SampleResult:
        self.device.write(self.step, struct.pack("<4I", pos0, 0, 0, 0))
        self.device.write(self.tokens, b"\xff" * (4 * CONTEXT))
        self.device.run(plan)
        return SampleResult.parse(self.device.read(self.result, 16))

    def draw(self, sampling, variant=None, pos0=10, context=CONTEXT) -> SampleResult:
        return self.run(self.plan(sampling, variant, context), pos0)

    def token_at(self, position):
        return struct.unpack("<I", self.device.read(self.tokens, 4, 4 * position))[0]


@pytest.fixture(scope="module")
def sampler(device):
    return Sampler(device)


def logits_of(rows, seed, scale=3.0):
    return np.random.default_rng(seed).normal(scale=scale, size=rows).astype(F32)


def reference_id(logits, s: Sampling, position):
    return ref.sample(logits, s.temperature, s.top_k, s.top_p, s.seed, position)


def assert_matches(sampler, x, s: Sampling, variant=None, pos0=10):
    got = sampler.draw(s, variant, pos0=pos0)
    assert got.id == reference_id(x, s, pos0 + 1), (s, variant)
    assert got.position == pos0 + 1 and got.logit == x[got.id]
    return got


# ---------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [512, 1000, 8192])
def test_greedy_is_argmax(sampler, rows, variant):
    for seed in range(3):
        x = logits_of(rows, seed)
        sampler.load(x)
        got = sampler.draw(Sampling.saturate(0.0), variant)
        assert got.id == int(np.argmax(x)) == ref.greedy(x)
        assert got.greedy and got.written and got.position == 11
        assert got.logit == x[got.id]
        assert sampler.token_at(11) == got.id


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_ties_lowest_index(sampler, variant):
    x = logits_of(8192, 1)
    x[[5000, 300, 7000, 301, 4097]] = 50.0  # ties spread over several threads and slices
    sampler.load(x)
    assert sampler.draw(Sampling.saturate(0.0), variant).id == 300 == int(np.argmax(x))
    assert sampler.draw(Sampling.saturate(1.0, top_k=1, seed=9), variant).id == 300  # top_k 1 is greedy
    sampler.load(np.zeros(777, F32))
    assert sampler.draw(Sampling.saturate(0.0), variant).id == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_top_k_one_equals_greedy(sampler, variant):
    for seed in range(5):
        x = logits_of(512, 40 + seed)
        sampler.load(x)
        got = sampler.draw(Sampling.saturate(2.0, top_k=1, seed=seed), variant)
        assert got.id == int(np.argmax(x)) and got.greedy


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_top_p_equals_greedy(sampler, variant):
    for seed in range(8):
        x = logits_of(8192, 60 + seed, scale=1.0)
        sampler.load(x)
        got = sampler.draw(Sampling.saturate(1.5, top_p=1e-6, seed=seed), variant)
        assert got.id == int(np.argmax(x)) and not got.greedy


# ---------------------------------------------------------------------------------- sampling


CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=40),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.9, top_k=300, top_p=0.75),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [512, 8192])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_matches_reference_id_for_id(sampler, rows, config, variant):
    x = logits_of(rows, rows, scale=2.0)
    sampler.load(x)
    picks = []
    for seed in range(30):
        s = Sampling.saturate(**config, seed=seed * 7919 + 1)
        got = assert_matches(sampler, x, s, variant, pos0=seed % 20)
        assert not got.greedy
        picks.append(got.id)
    assert len(set(picks)) > 3  # it does sample
    if "top_k" in config:
        allowed = set(np.argsort(-x, kind="stable")[: config["top_k"]].tolist())
        assert set(picks) <= allowed


def settings_for(rows):
    """Greedy, temperature, top-k small / large / >= rows, top-p small / large, and both."""
    return [
        Sampling.saturate(0.0),
        Sampling.saturate(1.0),
        Sampling.saturate(0.8, top_k=7),
        Sampling.saturate(1.2, top_k=max(2, rows // 3)),
        Sampling(1.1, rows, 1.0, 0),
        Sampling(1.1, rows + 5, 1.0, 0),  # not saturated to the vocabulary: still "all"
        Sampling.saturate(1.0, top_p=0.05),
        Sampling.saturate(2.0, top_p=0.98),
        Sampling.saturate(0.9, top_k=max(2, rows // 5), top_p=0.8),
    ]


def with_seed(s: Sampling, seed: int) -> Sampling:
    return Sampling(s.temperature, s.top_k, s.top_p, seed)


@pytest.mark.parametrize("rows,variants,seeds", [
    (100, VARIANTS, 12), (16384, VARIANTS, 3), (16385, [STAGED], 3), (49152, [STAGED], 2),
    (262144, [STAGED], 2)])
def test_sizes_and_settings(sampler, rows, variants, seeds):
    """Every setting at every size, across slice boundaries; the staged path past 16,384."""
    x = logits_of(rows, rows + 3, scale=2.5)
    x[rows // 2] = x[rows - 1] = x.max()  # ties at the top, in different slices
    sampler.load(x)
    for s in settings_for(rows):
        for seed in range(seeds):
            for variant in variants:
                assert_matches(sampler, x, with_seed(s, seed * 104729 + rows), variant, pos0=seed)


def test_size_bounds_of_each_variant(sampler, device):
    assert sample_ops.variant_for(16384) == ONE_WORKGROUP and sample_ops.variant_for(16385) == STAGED
    sampler.load(np.zeros(16385, F32))
    with pytest.raises(UnsupportedModelError):
        sampler.plan(Sampling.saturate(1.0), ONE_WORKGROUP)
    scratch = device.buffer(64, label="scratch")
    for rows in (0, sample_ops.MAX_ROWS + 1):
        with pytest.raises(UnsupportedModelError):
            sample_ops.sample(Plan(device, "x"), UniformArena(device), scratch, logits=scratch, logits_offset=0,
                              rows=rows, tokens=scratch, result=scratch, context=4, positions=1,
                              sampling=Sampling.saturate(1.0), variant=STAGED)


@pytest.mark.parametrize("variant,rows", [(ONE_WORKGROUP, 10000), (STAGED, 40000)])
def test_top_k_cut_through_ties(sampler, variant, rows):
    """K ends inside a group of equal logits: the lowest indices of the group are kept (for the
    staged sampler the group spans three slices)."""
    x = np.full(rows, -5.0, F32)
    top = [10, 20, rows - 1]
    group = [7, rows * 41 // 100, rows // 2, rows * 82 // 100, rows * 95 // 100]
    x[top] = 3.0
    x[group] = 2.0  # K = 5 keeps the first two of these
    sampler.load(x)
    picks = set()
    for seed in range(40):
        s = Sampling.saturate(3.0, top_k=5, seed=seed)
        picks.add(assert_matches(sampler, x, s, variant).id)
    assert picks <= set(top + group[:2]) and set(group[:2]) <= picks


@pytest.mark.parametrize("variant", VARIANTS)
def test_top_p_keeps_every_tie_at_the_threshold(sampler, variant):
    """Few distinct logits: the nucleus ends inside a tie group and keeps all of it."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 6, size=12000).astype(F32)
    sampler.load(x)
    picks = set()
    for seed in range(30):
        s = Sampling.saturate(0.5, top_p=0.5, seed=seed)
        picks.add(assert_matches(sampler, x, s, variant).id)
    assert {float(x[i]) for i in picks} == {5.0}  # the top group alone holds > half the mass
    assert len(picks) > 10


def test_sums_above_32_bits(sampler):
    """Near-flat logits: every weight is close to 2^24, so slice, histogram and row sums carry."""
    rows = 49152
    x = (np.random.default_rng(9).random(rows) * 1e-3).astype(F32)
    sampler.load(x)
    for s in (Sampling.saturate(1.0, seed=3), Sampling.saturate(1.0, top_p=0.5, seed=4),
              Sampling.saturate(1.0, top_k=30000, top_p=0.7, seed=5)):
        assert_matches(sampler, x, s, STAGED)
    sampler.load(x[:16384])
    assert_matches(sampler, x[:16384], Sampling.saturate(1.0, top_p=0.5, seed=6), ONE_WORKGROUP)


def test_weights_equal_the_reference_bit_for_bit(sampler, device):
    """The staged sampler's weights buffer against step 4 of the reference, for every logit:
    spread, near-flat and subnormal logits, -inf and NaN, over the temperature range."""
    rows = 40000
    rng = np.random.default_rng(21)
    spread = rng.normal(scale=3.0, size=rows).astype(F32)
    flat = (rng.random(rows) * 1e-3).astype(F32)
    tiny = (rng.normal(size=rows) * 1e-38).astype(F32)  # mostly subnormal
    for x in (spread, flat, tiny):
        x[rng.random(rows) < 0.02] = -np.inf
        x[rng.random(rows) < 0.02] = np.nan
        sampler.load(x)
        scratch = sample_ops.shared_scratch(device, rows)
        keys = ref.order_keys(x)
        for temperature in (0.01, 1e-35, 0.7, 3.0, 100.0):
            s = Sampling.saturate(temperature, seed=1)
            got = sampler.draw(s, STAGED)
            _, scale, _, _ = sampler_constants(s)
            weights = np.frombuffer(device.read(scratch.weights, 4 * rows), np.uint32)
            want = ref.weights(keys, int(keys.max()), scale)
            assert np.array_equal(weights, want), temperature
            assert got.id == reference_id(x, s, 11)
        assert (want > 0).sum() > rows // 2  # at T = 100 (the last), most logits weigh something


def test_last_row_and_context_end(sampler):
    rows = 512
    x = np.stack([logits_of(rows, 1), logits_of(rows, 2), logits_of(rows, 3)])
    sampler.load(x)
    s = Sampling.saturate(0.8, seed=123)
    for variant in VARIANTS:
        got = sampler.draw(s, variant, pos0=20)  # rows are positions 20, 21, 22: the draw is for 23
        assert got.position == 23 and got.id == reference_id(x[2], s, 23)
        assert sampler.token_at(23) == got.id
        end = sampler.draw(s, variant, pos0=CONTEXT - 3)  # position CONTEXT does not exist
        assert not end.written and end.position == CONTEXT
        assert sampler.draw(s, variant, pos0=20).id == got.id  # reproducible: no hidden state


@pytest.mark.parametrize("variant,rows", [(ONE_WORKGROUP, 600), (STAGED, 600), (STAGED, 20000)])
def test_non_finite_logits(sampler, variant, rows):
    sampler.load(np.full(rows, -np.inf, F32))
    for s in (Sampling.saturate(0.0), Sampling.saturate(1.0, seed=3), Sampling.saturate(1.0, top_k=5, top_p=0.5)):
        got = sampler.draw(s, variant)
        assert got.id == 0 and got.no_finite and got.greedy
    sampler.load(np.full(rows, np.nan, F32))
    assert sampler.draw(Sampling.saturate(1.0, seed=3), variant).id == 0
    x = logits_of(rows, 8)
    x[::3] = np.nan
    x[1::7] = -np.inf
    x[np.argmax(np.nan_to_num(x, nan=-1e30))] = np.nan  # the largest finite one becomes NaN
    sampler.load(x)
    assert sampler.draw(Sampling.saturate(0.0), variant).id == ref.greedy(x)
    for seed in range(8):
        for s in (Sampling.saturate(1.0, top_p=0.95, seed=seed), Sampling.saturate(1.0, top_k=rows // 2, seed=seed)):
            got = assert_matches(sampler, x, s, variant)
            assert np.isfinite(x[got.id])
    x[[rows - 100, 40]] = np.inf
    sampler.load(x)
    got = sampler.draw(Sampling.saturate(1.0, top_p=0.5, seed=1), variant)
    assert got.id == 40 and got.greedy


def test_one_finite_logit_among_minus_inf(sampler):
    rows = 30000
    x = np.full(rows, -np.inf, F32)
    x[rows - 3] = -7.0
    sampler.load(x)
    for s in (Sampling.saturate(1.0, seed=2), Sampling.saturate(1.0, top_k=100, top_p=0.3, seed=2)):
        got = sampler.draw(s, STAGED)
        assert got.id == rows - 3 and not got.greedy and not got.no_finite


def test_every_pass_in_the_plan_gives_the_same_ids(sampler, device):
    """Passes a setting does not need exit on their own: a plan holding all of them agrees."""
    x = logits_of(20000, 77)
    sampler.load(x)
    scratch = sample_ops.shared_scratch(device, 20000)
    for s in settings_for(20000)[:4]:
        s = with_seed(s, 17)
        greedy, scale, top_k, p_fixed = sampler_constants(s)
        settings = dict(rows=20000, logits_offset=0, positions=1, context=CONTEXT, weight_scale=scale, top_k=top_k,
                        top_p=p_fixed, seed=s.seed, greedy=int(greedy), min_weight=0)
        sampler.arena.used = 0
        plan = Plan(device, "all passes")
        sample_ops._staged(plan, sampler.arena, sampler.step, sampler.logits, sampler.tokens, sampler.result,
                           settings, scratch, use_top_k=False, use_top_p=False, every_pass=True)
        assert len(plan) == 12
        assert sampler.run(plan).id == reference_id(x, s, 11) == sampler.draw(s, STAGED).id


def test_plans_of_different_sizes_share_the_scratch(sampler, device):
    """The device's scratch grows for a larger row; a plan built before it still works."""
    small, large = logits_of(20000, 1), logits_of(40000, 2)
    s = Sampling.saturate(1.0, top_k=50, top_p=0.9, seed=8)
    sample_ops._shared_scratch.pop(device, None)
    sampler.load(small)
    plan_small = Plan(device, "small")
    sample_ops.sample(plan_small, UniformArena(device), sampler.step, logits=sampler.logits, logits_offset=0,
                      rows=20000, tokens=sampler.tokens, result=sampler.result, context=CONTEXT, positions=1,
                      sampling=s)
    assert sample_ops.shared_scratch(device, 1).rows == 20000
    sampler.load(large)
    large_id = assert_matches(sampler, large, s, STAGED).id
    assert sample_ops.shared_scratch(device, 1).rows == 40000
    sampler.load(small)
    assert sampler.run(plan_small).id == reference_id(small, s, 11)
    sampler.load(large)
    assert assert_matches(sampler, large, s, STAGED).id == large_id


def test_decode_step_is_one_submit_and_a_four_byte_read(sampler, device):
    """The staged sampler at Gemma 3's vocabulary: its passes go into the plan's one submit."""
    rows = 262144
    x = logits_of(rows, 4)
    sampler.load(x)
    s = Sampling.saturate(0.9, top_k=64, top_p=0.9, seed=11)
    plan = sampler.plan(s)
    assert len(plan) == 12
    device.write(sampler.step, struct.pack("<4I", 10, 0, 0, 0))
    before = (device.counters.submits, device.counters.bytes_read)
    device.run(plan)
    token = struct.unpack("<I", device.read(sampler.result, 4))[0]
    after = (device.counters.submits, device.counters.bytes_read)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4)
    assert token == reference_id(x, s, 11)


# ---------------------------------------------------------------------------------- masks


def masked_plan(sampler, mask_buffer, s, variant):
    T, rows = sampler.shape
    sampler.arena.used = 0
    plan = Plan(sampler.device, "sample")
    sample_ops.sample(plan, sampler.arena, sampler.step, logits=sampler.logits, logits_offset=(T - 1) * rows,
                      rows=rows, tokens=sampler.tokens, result=sampler.result, context=CONTEXT, positions=T,
                      sampling=s, variant=variant, mask=mask_buffer)
    return plan


def masks_for(rows, rng):
    """Dense, sparse, a single id, and the top half of the ids."""
    yield rng.random(rows) < 0.7
    yield rng.random(rows) < 0.01
    one = np.zeros(rows, bool)
    one[rng.integers(rows)] = True
    yield one
    yield np.arange(rows) >= rows // 2


@pytest.mark.parametrize("variant,rows", [(ONE_WORKGROUP, 1000), (STAGED, 20000)])
def test_masked_sampling_matches_the_reference(sampler, device, variant, rows):
    """Constrained decoding: disallowed ids never come out, the id is the reference's, and the
    mask is one queue write before the plan's one submit."""
    rng = np.random.default_rng(rows)
    mask_buffer = device.buffer(sample_ops.mask_bytes(rows), label="mask")
    x = logits_of(rows, 21)
    x[rng.integers(rows, size=20)] = -np.inf  # allowed -inf ids still beat disallowed ones
    sampler.load(x)
    settings = [Sampling(), Sampling(0.8, seed=3), Sampling(1.3, top_k=7, seed=5), Sampling(0.6, top_p=0.8, seed=9)]
    for case, allowed in enumerate(masks_for(rows, rng)):
        bits = np.packbits(allowed, bitorder="little").tobytes().ljust(sample_ops.mask_bytes(rows), b"\0")
        for s in settings:
            plan = masked_plan(sampler, mask_buffer, s, variant)
            device.write(sampler.step, struct.pack("<4I", 10, 0, 0, 0))
            submits = device.counters.submits
            device.write(mask_buffer, bits)
            device.run(plan)
            assert device.counters.submits - submits == 1
            got = SampleResult.parse(device.read(sampler.result, 16)).id
            assert allowed[got], (case, s)
            assert got == ref.sample(x, s.temperature, s.top_k, s.top_p, s.seed, 11, mask=bits), (case, s)


def test_all_allowed_logits_minus_inf_gives_the_lowest_allowed_id(sampler, device):
    rows = 600
    x = np.full(rows, -np.inf, F32)
    x[:100] = 5.0  # disallowed finite logits
    sampler.load(x)
    allowed = np.zeros(rows, bool)
    allowed[[321, 450]] = True
    mask_buffer = device.buffer(sample_ops.mask_bytes(rows), label="mask")
    device.write(mask_buffer, np.packbits(allowed, bitorder="little").tobytes().ljust(sample_ops.mask_bytes(rows), b"\0"))
    for variant in VARIANTS:
        got = sampler.run(masked_plan(sampler, mask_buffer, Sampling(0.9, seed=1), variant))
        assert got.id == 321 and ref.greedy(x, allowed) == 321
