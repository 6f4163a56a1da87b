"""Self-speculative decoding on the GPU: the verify plan, bounded rewinds over sliding-window
rings and conv tails, and greedy output identical to plain decoding (random and fixture models)."""

import random
import sys
from pathlib import Path

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu.errors import DepthError, InputError, NeedleError
from needle_wgpu.sampling import Sampling
from needle_wgpu.synth import synthesize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from upstream_fixtures import oracle, upstream_file  # noqa: E402

pytestmark = pytest.mark.gpu
GREEDY = Sampling()


@pytest.fixture(scope="module")
def tiny(device):
    return needle_wgpu.load(synthesize("tiny", 0), device=device)  # window 16, global layer 2, sites 1, 3


@pytest.fixture(scope="module")
def small(device):
    return needle_wgpu.load(upstream_file("small"), device=device)


@pytest.mark.slow  # ~10 s on lavapipe: 130 positions, two sessions, many chunk lengths
def test_verify_and_rewind_match_a_fresh_prefill(tiny):
    """Random chunks verified, a random prefix kept, the rest rewound, far past the sliding
    window (16) and the conv rings: every id the session gives after a kept prefix is the
    argmax a fresh prefill of that prefix gives. The draft session (depth 2) does the same
    with draft() and rewind()."""
    rng = random.Random(5)
    vocab = tiny.geometry.vocab
    full = tiny.gpu.session(context=160)
    draft = tiny.gpu.at_depth(2).session(context=160)
    prompt = [2] + [rng.randrange(4, vocab) for _ in range(20)]
    x = full.prefill(prompt, GREEDY)
    draft.prefill(prompt)
    seq, checks, draft_checks = list(prompt), [], []
    while len(seq) < 130:
        k = rng.randint(1, 7)
        chunk = [x] + [rng.randrange(vocab) for _ in range(k)]
        start = full.position
        got = full.verify(chunk)
        n = rng.randint(0, k)
        full.rewind(start + n + 1)
        seq += chunk[: n + 1]
        checks.append((len(seq), got[n]))
        x = got[n]
        # the draft session: steps from seq[-1], then back to the same kept prefix
        draft.prefill(seq[draft.position : len(seq) - 1])
        draft_start = draft.position
        tiny.gpu.device.write(draft.tokens, seq[-1].to_bytes(4, "little"), 4 * draft_start)
        drafted = draft.draft(k, GREEDY)
        draft_checks.append((len(seq), drafted[0]))
        draft.rewind(draft_start)
    want = np.array(tiny.gpu.session(context=160).all_logits(seq)).argmax(-1)
    want_draft = np.array(tiny.gpu.at_depth(2).session(context=160).all_logits(seq)).argmax(-1)
    assert [g for _, g in checks] == [int(want[n - 1]) for n, _ in checks]
    assert [g for _, g in draft_checks] == [int(want_draft[n - 1]) for n, _ in draft_checks]
    assert len(set(g for _, g in checks)) > 3  # the ids checked are not one repeated token


def test_rewinds_beyond_the_rings_are_refused(tiny):
    session = tiny.gpu.session(context=160)
    session.prefill(list(range(2, 120)))
    with pytest.raises(NeedleError, match="cannot rewind that far"):
        session.rewind(118 - session.max_rewind - 1)
    session.rewind(118 - session.max_rewind)
    assert session.position == 118 - session.max_rewind
    pooled = tiny.gpu.session(context=32, confidence=True)
    pooled.prefill([2, 5, 6])
    with pytest.raises(NeedleError):
        pooled.rewind(2)  # the probe pools cannot forget a position


def test_a_sliding_window_session_starts_over_at_zero_as_a_fresh_one(tiny, tmp_path, device):
    """``rewind(0)`` past ``max_rewind`` (its rings are read by position, nothing before 0):
    after 118 positions of another sequence, a Needle 3 session (window 16) and a gemma3 one
    (window 4) give a new prompt the logits of a fresh session, bit for bit; the server's KV pool
    reuses sessions so. A session running probe pools still cannot start over."""
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    gemma = needle_wgpu.load(str(write_dense_gguf(tmp_path / "gemma3.gguf", SynthDense(arch="gemma3", n_layers=6),
                                                  tokenizer="bytes")), device=device)
    prompt = [2, 9, 14, 33, 7, 81, 5, 60, 12, 3, 44, 17, 23, 8, 91, 70, 6, 31, 29, 11]
    for gpu in (tiny.gpu, gemma.gpu):
        used = gpu.session(context=160)
        assert not used.rewindable and used.restartable
        used.prefill(list(range(3, 121)))
        used.rewind(0)
        assert used.position == 0
        again = np.array(used.all_logits(prompt))
        fresh = np.array(gpu.session(context=160).all_logits(prompt))
        assert again.tobytes() == fresh.tobytes()
    pooled = tiny.gpu.session(context=32, confidence=True)
    pooled.prefill([2, 5, 6])
    assert not pooled.restartable
    with pytest.raises(NeedleError, match="cannot rewind that far"):
        pooled.rewind(0)


@pytest.mark.slow  # ~8 s each on lavapipe
@pytest.mark.parametrize("seed, depth, k", [(0, 2, 3), (1, 3, 5)])
def test_speculative_greedy_equals_plain_greedy_on_random_models(device, seed, depth, k):
    model = needle_wgpu.load(synthesize("tiny", seed), device=device)
    rng = random.Random(seed)
    for trial in range(2):
        ids = [2] + [rng.randrange(4, 500) for _ in range(20)]
        plain = model.generate(ids=ids, max_tokens=20)
        fast = model.generate(ids=ids, max_tokens=20, speculative=(depth, k))
        assert fast.ids == plain.ids and fast.finish_reason == plain.finish_reason, trial
        stats = fast.timings["speculative"]
        assert stats["accepted"] <= stats["drafted"] and stats["rounds"] > 0


@pytest.mark.slow  # ~12 s on lavapipe
def test_speculative_greedy_equals_plain_greedy_on_the_fixture(small):
    z = oracle("small")
    for seq, depth, k in (("len7", 2, 4), ("len100", 3, 8)):
        ids = z[f"{seq}.ids"].tolist()
        plain = small.generate(ids=ids, max_tokens=30)
        assert small.generate(ids=ids, max_tokens=30, speculative=(depth, k)).ids == plain.ids, (seq, depth, k)


def test_speculative_at_the_end_of_the_context(small):
    """Rounds shrink as the context fills; the last ids come from plain steps."""
    ids = oracle("small")["len40.ids"].tolist()
    plain = small.generate(ids=ids, max_tokens=100, context=50)
    fast = small.generate(ids=ids, max_tokens=100, context=50, speculative=(2, 6))
    assert fast.ids == plain.ids and len(plain.ids) == 10


def test_sampled_speculative_decoding_runs_and_repeats_with_its_seed(small):
    ids = oracle("small")["len7.ids"].tolist()
    a = small.generate(ids=ids, max_tokens=20, temperature=1.5, seed=3, speculative=(2, 4))
    b = small.generate(ids=ids, max_tokens=20, temperature=1.5, seed=3, speculative=(2, 4))
    assert a.ids == b.ids and len(a.ids) == 20 and all(0 <= i < small.geometry.head_rows for i in a.ids)
    assert 0.0 <= a.timings["speculative"]["acceptance"] <= 1.0


@pytest.mark.parametrize("bad, error", [((4, 2), InputError), ((1, 2), DepthError), ((5, 2), DepthError),
                                        ("2,4", InputError), ((2,), InputError), ((2.5, 4), DepthError)])
def test_bad_speculative_options_are_typed_errors(small, bad, error):
    with pytest.raises(error):
        small.generate(ids=[2, 5], max_tokens=4, speculative=bad)
    assert small.generate(ids=[2, 5], max_tokens=2).finish_reason in ("eos", "length")  # still usable


def test_k_saturates(small):
    ids = oracle("small")["len7.ids"].tolist()
    for k in (0, -5, 1e9, float("nan")):
        out = small.generate(ids=ids, max_tokens=8, speculative=(2, k))
        assert 1 <= out.timings["speculative"]["k"] <= 16


@pytest.mark.slow  # ~10 s on lavapipe
def test_rejected_drafts_leave_greedy_output_unchanged(tiny):
    """A draft session whose ids are half of the time replaced by random ones (after it ran
    them): many rejections at every offset, corrections, rewinds of both sessions and the
    draft's catch-up still give exactly the full model's greedy ids."""
    from needle_wgpu.speculative import SpeculativeDecoder

    rng = random.Random(2)
    device = tiny.gpu.device
    drafted = accepted = 0
    for trial in range(3):
        ids = [2] + [rng.randrange(4, 500) for _ in range(20)]
        plain = tiny.gpu.session(context=80)
        want = [plain.prefill(ids, GREEDY)] + [plain.step(GREEDY) for _ in range(40)]
        draft = tiny.gpu.at_depth(2).session(context=80)
        run_draft = draft.draft

        def corrupted(count, sampling, read=True, run_draft=run_draft, draft=draft):
            start = draft.position
            out = run_draft(count, sampling, read)
            for i in range(count):
                if rng.random() < 0.5:
                    device.write(draft.tokens, rng.randrange(500).to_bytes(4, "little"), 4 * (start + 1 + i))
            return out

        draft.draft = corrupted
        decoder = SpeculativeDecoder(tiny.gpu.session(context=80), draft, 2 + trial, GREEDY)
        got = [decoder.start(ids)]
        while len(got) < len(want):
            got += decoder.round()
        assert got[: len(want)] == want, trial
        drafted, accepted = drafted + decoder.drafted, accepted + decoder.accepted
    assert 0 < accepted < drafted / 2  # rejections and acceptances both happened


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_should_stop_is_asked_during_a_speculative_prefill(small, temperature):
    asked = []

    def stop(done, total):
        asked.append((done, total))
        return True

    out = small.generate(ids=[2] + list(range(10, 40)), max_tokens=8, temperature=temperature,
                         speculative=(2, 3), should_stop=stop)
    assert out.finish_reason == "stopped" and out.ids == [] and len(asked) == 1 and asked[0][0] == 0
    with pytest.raises(needle_wgpu.errors.InputError, match="speculative"):
        small.generate(ids=[2, 5], max_tokens=4, speculative=(2, 3), logprobs=True)


def test_bench_speculative_defaults_draft_below_the_depth_it_runs_at(device):
    """``bench --depth N --speculative``: the default pairs come from the depth the model runs
    at, not the file's own layer count (the 4-layer fixture's default draft, depth 2, is below
    its 3-block rung and is no draft at all for its 2-block one)."""
    from needle_wgpu.cli.bench import _speculative_speeds

    for depth, drafts in ((3, {2}), (2, set())):
        model = needle_wgpu.load(upstream_file("small"), device=device, depth=depth)
        out = _speculative_speeds(model.gpu, [], list(range(2, 12)), 4)
        assert {run["depth"] for run in out["runs"]} == drafts
        assert all(run["ids_equal_plain"] for run in out["runs"]) and out["plain_decode_tok_s"] > 0
