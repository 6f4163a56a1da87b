"""Multi-token decoding (generation.Steps, ChunkedSession.decode_round): k decode steps in one
submit and one 4k-byte readback give exactly the ids of one step at a time, for every k, greedy
and sampled, with penalties, stop strings that land inside a round, budgets that are not a
multiple of k, and a conversation whose cache must hold exactly what one step at a time leaves."""

import pytest

import needle_wgpu

pytestmark = pytest.mark.gpu
ROUNDS = (1, 2, 3, 8)
OPTIONS = [
    dict(),
    dict(temperature=0.9, top_k=40, seed=7),
    dict(temperature=0.7, top_p=0.9, seed=3, repetition_penalty=1.3, frequency_penalty=0.5),
]


def run(model, k, **options):
    result = needle_wgpu.api.GenerationResult("", [], "empty", 0)
    events = list(model.stream(ids=[2, 40, 41, 42, 43], max_tokens=19, context=64, tokens_per_round=k,
                               result=result, **options))
    return result, events


@pytest.mark.parametrize("options", OPTIONS, ids=["greedy", "top-k", "penalties"])
@pytest.mark.parametrize("family", ["synthetic_llama", "needle3_tiny"])
def test_every_round_length_gives_the_same_ids(request, family, options):
    model = request.getfixturevalue(family)
    plain, _ = run(model, 1, **options)
    assert plain.ids
    for k in ROUNDS[1:]:
        result, events = run(model, k, **options)
        assert (result.ids, result.text, result.finish_reason) == (plain.ids, plain.text, plain.finish_reason), k
        assert [e.id for e in events if e.id is not None] == result.ids


def test_a_stop_inside_a_round_ends_where_one_step_ends(synthetic_llama):
    plain, _ = run(synthetic_llama, 1)
    stop = plain.text[len(plain.text) // 2:][:2]  # text that first appears mid-generation
    assume = stop and stop in plain.text
    assert assume
    expected, _ = run(synthetic_llama, 1, stop=[stop])
    for k in (4, 8):
        result, _ = run(synthetic_llama, k, stop=[stop])
        assert (result.ids, result.text, result.finish_reason) == (expected.ids, expected.text, "stop")


def test_a_round_is_one_submit_and_reads_four_bytes_an_id(synthetic_llama, device):
    session = synthetic_llama.gpu.session(context=64)
    try:
        greedy = needle_wgpu.sampling.Sampling()
        session.prefill([2, 40, 41], greedy)
        c = device.counters
        before = (c.submits, c.bytes_read, c.dispatches)
        ids = session.decode_round(6, greedy)
        submits, read, dispatches = (a - b for a, b in zip((c.submits, c.bytes_read, c.dispatches), before))
        one = session._plan(needle_wgpu.models.session.PlanKey(1, greedy)).dispatches
        assert (len(ids), submits, read, dispatches, session.position) == (6, 1, 24, 6 * len(one), 9)
        assert session.decode_round(100, greedy) and session.position == 64  # no step past the context
    finally:
        session.close()


def test_a_conversation_keeps_the_cache_one_step_at_a_time_would(synthetic_llama):
    replies = {}
    for k in (1, 5):
        conversation = synthetic_llama.conversation(context=256)
        first = conversation.send("ab", max_tokens=7, tokens_per_round=k)
        second = conversation.send("cd", max_tokens=9, tokens_per_round=k)
        replies[k] = (first["content"], second["content"], conversation.turns[1].reused,
                      conversation.turns[1].prefilled, conversation.session.position)
        conversation.close()
    assert replies[5] == replies[1]


@pytest.mark.parametrize("family", ["synthetic_llama", "needle3_tiny"])
def test_the_context_end_inside_a_round_ends_where_one_step_ends(request, family):
    """A round that reaches the context's last position keeps every id one step at a time
    gives there (the ids sampled at the last positions are still the generation's)."""
    model = request.getfixturevalue(family)
    want = model.generate(ids=[2, 40, 41, 42, 43], max_tokens=40, context=16, tokens_per_round=1)
    assert want.finish_reason == "length" and len(want.ids) == 16 - 5
    for k in (3, 4, 8):
        got = model.generate(ids=[2, 40, 41, 42, 43], max_tokens=40, context=16, tokens_per_round=k)
        assert (got.ids, got.finish_reason) == (want.ids, want.finish_reason), k


def test_two_rounds_in_flight_read_what_one_round_at_a_time_reads(synthetic_llama, device):
    """Pipelining at the session level: the second round is submitted before the first is
    read; each readback is staged inside its own submit on the native back end (waiting for
    that submit alone) and the ids are those of rounds run one after the other."""
    greedy = needle_wgpu.sampling.Sampling()
    plain = synthetic_llama.gpu.session(context=64)
    piped = synthetic_llama.gpu.session(context=64)
    try:
        plain.prefill([2, 40, 41], greedy)
        want = plain.decode_round(5, greedy) + plain.decode_round(7, greedy)
        piped.prefill([2, 40, 41], greedy)
        before = device.counters.bytes_read
        first = piped.submit_round(5, greedy)
        second = piped.submit_round(7, greedy)
        assert first.staged is not None and second.staged is not None  # wgpu-native's submit-for-index path
        got = piped.collect_round(first) + piped.collect_round(second)
        assert got == want and piped.position == plain.position == 15
        assert device.counters.bytes_read - before == 4 * 12
        assert piped.submit_round(100, greedy) is not None and piped.submit_round(1, greedy) is None  # context full
    finally:
        plain.close()
        piped.close()


def test_rounds_are_pipelined_where_the_rings_reach_back_over_two(needle3_tiny, synthetic_llama):
    """The next round goes in before this one is read where the session can take back a round's
    unused steps and the round ahead: every length on a dense session that rewinds anywhere, and
    on a Needle 3 session (its rings step back over a chunk, 64) up to 32; longer rounds, and a
    session running probe pools, are read one at a time."""
    from needle_wgpu.generation import Steps

    dense, needle = synthetic_llama.gpu.session(context=64), needle3_tiny.gpu.session(context=64)
    pooled = needle3_tiny.gpu.session(context=64, confidence=True)
    try:
        assert Steps(dense, round_tokens=64).pipelined
        assert Steps(needle, round_tokens=32).pipelined and not Steps(needle, round_tokens=33).pipelined
        assert not Steps(pooled, round_tokens=4).pipelined
    finally:
        for session in (dense, needle, pooled):
            session.close()


@pytest.mark.parametrize("k, pipeline", [(1, True), (4, True), (4, False), (3, True)])
def test_the_host_cost_counts_every_step_it_ran(synthetic_llama, k, pipeline):
    """``bench``'s host-cost row: dispatches, submits and bytes read per decoded id are counted
    over every id after the prompt's (the round run ahead included), so a step's dispatches are
    the plan's and a round of k is one submit of 4k bytes; 20 ids after the first (with k = 3 the
    last round has 2 steps)."""
    from needle_wgpu.cli.bench import host_cost
    from needle_wgpu.models.session import PlanKey
    from needle_wgpu.sampling import Sampling

    session = synthetic_llama.gpu.session(context=64)
    plan = len(session._plan(PlanKey(1, Sampling())).dispatches)
    session.close()
    row = host_cost(synthetic_llama, [2, 40, 41, 42], 21, k, pipeline)
    assert row["decoded"] == 21 and row["pipelined"] == (pipeline and k > 1)
    assert row["dispatches_per_token"] == plan and row["bytes_read_per_token"] == 4
    assert row["submits_per_token"] == round(-(-20 // k) / 20, 3)
    assert row["host_cpu_ms_per_token"] > 0 and row["encode_submit_ms"] > 0
