"""GPU memory that stays flat: a closed session frees what it made (its caches, scratch and
plan uniforms), never the weights or the device's shared scratch, so repeated requests of
every kind leave the device's live bytes where the first one left them. And a device's
``prefill_chunk`` shortens the chunks without changing a single logit or id."""

from __future__ import annotations

import gc

import pytest

import needle_wgpu
from needle_wgpu.engine import Needle3
from needle_wgpu.errors import NeedleError
from needle_wgpu.sampling import Sampling
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

pytestmark = pytest.mark.gpu

TOOLS = '[{"name":"off"}]'


@pytest.fixture(scope="module")
def dense(tmp_path_factory, device):
    path = write_dense_gguf(tmp_path_factory.mktemp("memory") / "llama.gguf", SynthDense(arch="llama", seed=3),
                            tokenizer="bytes")
    return needle_wgpu.load(str(path), device=device)


@pytest.fixture(scope="module")
def needle3(fixture_dir, device):
    return needle_wgpu.load(str(fixture_dir / "tiny.cact"), device=device)


def live(model) -> int:
    """The device's live bytes once every unreachable object is collected (an earlier test's
    session, say, whose buffers go when the collector next runs), so a level never drops later."""
    gc.collect()
    return model.gpu.device.counters.live_bytes


def repeated(run, model, times: int = 4) -> list:
    levels = []
    for i in range(times):
        run(i)
        levels.append(live(model))
    return levels


def test_free_prompts_chats_and_logits_leave_live_bytes_flat(dense):
    def prompt(i):
        dense.generate("Hello there " * (i + 1), max_tokens=3, context=64 + 32 * i, logit_bias={"5": 1.0},
                       repetition_penalty=1.2)

    def chat(i):
        conversation = dense.conversation("Be brief.", context=128)
        try:
            conversation.send("Hi!", max_tokens=2)
            conversation.send("More.", max_tokens=2)
        finally:
            conversation.close()

    for run in (prompt, chat, lambda i: dense.logits([1, 2, 3, 4 + i])):
        levels = repeated(run, dense)
        assert levels == [levels[0]] * len(levels), levels


def test_tool_calls_with_confidence_leave_live_bytes_flat(needle3):
    levels = repeated(lambda i: needle3.generate(query="Off", tools=TOOLS, max_tokens=6, seed=i, temperature=1.0),
                      needle3)
    assert levels == [levels[0]] * len(levels), levels


def test_close_frees_the_session_but_not_the_weights(needle3):
    def run():
        session = needle3.gpu.session(context=64)
        session.prefill([2, 5, 7], Sampling())
        return session

    run().close()  # the first makes the device's shared scratch (kind "shared"), which stays
    before = live(needle3)
    session = run()
    assert live(needle3) > before
    session.close()
    assert live(needle3) == before
    session.close()  # twice is harmless
    with pytest.raises(NeedleError, match="closed"):
        session.step(Sampling())
    # The weights and the shared sampler scratch still serve the next session.
    assert needle3.generate(ids=[2, 5, 7], max_tokens=2).ids == needle3.generate(ids=[2, 5, 7], max_tokens=2).ids


def test_a_shorter_prefill_chunk_gives_the_same_logits_and_ids(device, fixture_dir):
    model = Needle3.load(fixture_dir / "tiny.cact", device=device)
    ids = [2] + [4 + (7 * i) % 500 for i in range(99)]
    full = model.generate(ids=ids, max_tokens=4)
    submits = device.counters.submits
    device.prefill_chunk = 8
    try:
        short = model.generate(ids=ids, max_tokens=4)
        assert device.counters.submits - submits >= 100 // 8
    finally:
        device.prefill_chunk = None
    assert short.ids == full.ids


def test_wait_idle_returns_after_the_work(device):
    device.wait_idle("nothing submitted")  # also with an empty queue
    before = device.counters.bytes_read
    device.wait_idle("again")
    assert device.counters.bytes_read == before  # a sync point, not a counted readback


def test_buffers_written_then_freed_without_a_submit_release_their_memory(device):
    """A session that writes its buffers and is closed before it runs anything (a request with
    no room) must not leave its memory with the queue's pending writes: 40 rounds of two 4 MB
    buffers, written and freed with no submit in between, grew this process by 320 MB before
    ``free`` ended with an empty submit (wgpu-native on lavapipe keeps a destroyed buffer's memory
    while a write to it waits for the queue's next submit; Dawn in Chromium does the same)."""
    from pathlib import Path

    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("reads the resident size from /proc")

    def resident() -> int:
        return int(status.read_text().split("VmRSS:")[1].split()[0]) * 1024

    size = 4 << 20
    payload = bytes(size)

    def round_trip():
        device.free([device.buffer(size, label="scratch", kind="session", data=payload) for _ in range(2)])

    round_trip()  # the allocator's first pages
    before = resident()
    for _ in range(40):
        round_trip()
    assert resident() - before < 64 << 20, (before, resident())  # 40 rounds hold 320 MB if kept


def test_a_long_lived_session_keeps_a_bounded_number_of_plans(dense):
    """A pooled session or a conversation meets a new sampling (its values baked into the plans)
    at every request: the session keeps at most MAX_PLANS plans, freeing the least recently used
    one's buffers, so its memory stops growing; a plan dropped and needed again is rebuilt alike."""
    from needle_wgpu.models.session import MAX_PLANS

    session = dense.gpu.session(context=64)
    try:
        levels, first = [], None
        for seed in range(MAX_PLANS + 12):
            sampling = Sampling.saturate(temperature=0.8, seed=seed, logit_bias={5: 1.0})
            session.rewind(0)
            ids = [session.prefill([1, 2, 3], sampling), session.step(sampling)]
            first = ids if first is None else first
            levels.append(live(dense))
        assert len(session._plans) <= MAX_PLANS
        assert levels[-1] == levels[MAX_PLANS // 2 + 2]  # flat once the cache is full (2 plans a request)
        session.rewind(0)
        sampling = Sampling.saturate(temperature=0.8, seed=0, logit_bias={5: 1.0})
        assert [session.prefill([1, 2, 3], sampling), session.step(sampling)] == first  # rebuilt, same ids
    finally:
        session.close()
