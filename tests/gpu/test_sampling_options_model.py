"""The sampling options end to end on a small synthetic dense model: a repetition penalty stops a
greedy loop, the session's ids equal a reference loop over the same logits (NumPy processing and
sampling), logprobs come from one row readback only when asked, and the plain decode step still
reads back 4 bytes."""

import math

import numpy as np
import pytest

from needle_wgpu.logprobs import log_softmax
from needle_wgpu.reference import sampling as ref
from needle_wgpu.sampling import Sampling

pytestmark = pytest.mark.gpu
F32 = np.float32
PROMPT = [1, 40, 41, 42, 43]
STEPS = 24
CONTEXT = 64


@pytest.fixture
def model(synthetic_llama):
    return synthetic_llama


@pytest.fixture
def needle3(needle3_tiny):
    return needle3_tiny


def session_ids(model, s, steps=STEPS):
    session = model.gpu.session(context=CONTEXT)
    try:
        ids = [session.prefill(PROMPT, s)]
        ids += [session.step(s) for _ in range(steps - 1)]
    finally:
        session.close()
    return ids


def reference_loop(model, s, steps=STEPS):
    """The same positions run without sampling (the prompt batched as prefill does, then one
    position per plan as the decode step does), each id picked by ``ref.sample_with``; also the
    log-softmax of each processed row."""
    session = model.gpu.session(context=CONTEXT)
    tokens, ids, logprobs = list(PROMPT), [], []
    try:
        logits = session.last_logits(PROMPT)
        for _ in range(steps):
            x = np.array(logits, F32)
            window = ref.penalty_window(tokens, len(tokens) - 1, s.penalty_last_n) if s.penalized else ()
            processed = ref.process_logits(x, s, window)
            ids.append(ref.sample_with(x, s, len(tokens), tokens))
            logprobs.append(log_softmax([v if v == v else -math.inf for v in processed.tolist()]))
            tokens.append(ids[-1])
            logits = session.last_logits([ids[-1]], tokenwise=True)
    finally:
        session.close()
    return ids, logprobs


def test_a_strong_repetition_penalty_never_repeats(model):
    plain = session_ids(model, Sampling())
    assert len(set(plain)) < len(plain) // 2  # this model loops when decoded greedily
    s = Sampling(repetition_penalty=50.0, presence_penalty=2.0, penalty_last_n=-1)
    ids = session_ids(model, s)
    assert len(set(ids)) == len(ids) and not set(ids) & set(PROMPT)
    assert ids == reference_loop(model, s)[0]


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.3, penalty_last_n=8),
    dict(temperature=0.9, seed=5, frequency_penalty=0.8, presence_penalty=0.4, min_p=0.05),
    dict(temperature=1.5, seed=11, top_k=40, logit_bias={150: 100, 161: -100, "184": -100}, penalty_last_n=0),
], ids=["repetition", "sampled-penalties-min_p", "bias"])
def test_session_equals_the_reference_loop(model, options):
    s = Sampling.saturate(**options, vocab=model.geometry.head_rows)
    ids = session_ids(model, s)
    assert ids == reference_loop(model, s)[0]
    assert ids != session_ids(model, Sampling.saturate(options.get("temperature", 0.0), options.get("top_k", 0),
                                                       seed=options.get("seed", 0)))


def test_needle3_sessions_take_the_options_too(needle3):
    """The other family's plans go through the same ``kernels.sample.sample``."""
    s = Sampling(0.8, seed=2, repetition_penalty=2.0, frequency_penalty=0.5, min_p=0.02, logit_bias={7: 3.0})
    ids = session_ids(needle3, s, steps=10)
    assert ids == reference_loop(needle3, s, steps=10)[0] != session_ids(needle3, Sampling(0.8, seed=2), steps=10)


def test_generate_logprobs_are_the_processed_rows_log_softmax(model):
    options = dict(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={3: 2.5})
    result = model.generate(ids=PROMPT, max_tokens=8, context=CONTEXT, logprobs=True, top_logprobs=3, **options)
    ids, logprobs = reference_loop(model, Sampling(**options), steps=len(result.ids))
    assert result.ids == ids and len(result.logprobs) == len(ids) >= 4
    for token, got, row in zip(ids, result.logprobs, logprobs):
        assert got["token"] == token and got["logprob"] == row[token]
        order = sorted(range(len(row)), key=lambda i: -row[i])[:3]
        assert [t["token"] for t in got["top_logprobs"]] == order
        assert [t["logprob"] for t in got["top_logprobs"]] == [row[i] for i in order]
        assert got["top_logprobs"][0]["token"] == token  # greedy: the chosen one is the most likely
    assert model.generate(ids=PROMPT, max_tokens=3, context=CONTEXT).logprobs is None
    plain = model.generate(ids=PROMPT, max_tokens=3, context=CONTEXT, logprobs=True, top_logprobs=float("nan"))
    assert all(entry["top_logprobs"] == [] and entry["logprob"] <= 0 for entry in plain.logprobs)


def test_the_plain_step_reads_back_four_bytes(model, device):
    """One submit per step; 4 bytes back with or without penalties; the logprobs row only when asked."""
    rows = model.geometry.head_rows
    session = model.gpu.session(context=CONTEXT)
    c = device.counters

    def step(s, **options):
        before = (c.dispatches, c.submits, c.bytes_read)
        session.step(s, **options)
        return tuple(a - b for a, b in zip((c.dispatches, c.submits, c.bytes_read), before))

    try:
        session.prefill(PROMPT, Sampling())
        plain = step(Sampling())
        assert plain[1:] == (1, 4)
        assert step(Sampling(repetition_penalty=1.2)) == (plain[0] + 2, 1, 4)
        assert step(Sampling(logit_bias={3: 1.0})) == (plain[0] + 1, 1, 4)
        assert step(Sampling(min_p=0.5)) == plain
        assert step(Sampling(), top_logprobs=2) == (plain[0], 1, 4 + 4 * rows)
        token, logprob = session.step(Sampling(), top_logprobs=0)
        assert logprob.token == token and logprob.top == () and logprob.logprob <= 0
    finally:
        session.close()
