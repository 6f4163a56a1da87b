"""The no-panic contract (docs/api.md) as property tests on the tiny synthetic model on the GPU.

Many random calls through the public API: ids including negative, huge and non-integer ones,
lengths from 0 past the context, sampling settings including NaN and infinities. Each must
return a well-formed result (finite logits, ids in [0, head_rows), a documented finish reason)
or raise a ``NeedleError``; nothing else may escape. Cheap calls (tokenizer, prompts, sampling,
sessions without a forward pass) are many; calls that run the model use small contexts and
budgets so the file stays within a few minutes on lavapipe. Hypothesis is derandomized, so a
CI run always tries the same cases.

Then: repeated identical requests leave Python's heap, the process and the GPU's live objects
flat; a device destroyed mid-generation surfaces as ``DeviceLostError`` on every path and a new
device serves again; out-of-memory and device limits are their own ``NeedleError`` subclasses
and leave the engine usable.
"""

import gc
import json
import math
import struct
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from needle_wgpu.engine import GenerationResult, Needle3
from needle_wgpu.errors import (ContextFullError, DeviceLimitError, DeviceLostError, InputError, NeedleError, OutOfMemoryError,
                                UnsupportedModelError)
from needle_wgpu.formats import cact
from needle_wgpu.gpu import KernelKey, open_device
from needle_wgpu.models.session import PlanKey
from needle_wgpu.chat.needle3 import build_prompt, compact_tools_json, parse_completion
from needle_wgpu.sampling import U32_MAX, Sampling, clamp_budget, saturate_ids
from needle_wgpu.synth import synthesize

pytestmark = pytest.mark.gpu

VALID = synthesize("tiny", seed=0)  # confidence head + tokenizer
NO_HEADS = synthesize("tiny", seed=0, heads=False)

# Examples per property (the sum is the number of random API calls per CI run).
CHEAP = 300
MODEL_CALLS = 120
FINISH_REASONS = {"empty", "length", "eos", "stop"}
NAN, INF = float("nan"), float("inf")


def check(max_examples):
    # No "explain" phase: on a failure it reruns the model hundreds of times for a nicer report.
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def model(device):
    return Needle3.load(VALID, device=device)


# ----------------------------------------------------------------------------------- strategies

token_ids = st.one_of(
    st.integers(0, 511),  # the tiny vocabulary (weighted: most ids are ordinary)
    st.integers(0, 511),
    st.integers(512, U32_MAX),  # u32 but past the vocabulary: clamped for the embedding only
    st.integers(-(2 ** 70), -1),
    st.integers(U32_MAX + 1, 2 ** 80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([None, "7", True, 7.0, 2.5]),
)
odd_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2 ** 70), 2 ** 70),
    st.sampled_from([NAN, INF, -INF, 0, -1, 1, 0.5, 1e-300, None, "x", "0.7", "inf", [1]]),
)
small_contexts = st.one_of(st.integers(6, 12), st.integers(6, 12), st.integers(-3, 5),
                           st.sampled_from([4.9, "6", True]))
budgets = st.one_of(st.integers(1, 4), st.integers(1, 4), st.integers(-2, 0),
                    st.sampled_from([NAN, INF, -INF, None, 10 ** 30, 2.7, "3"]))


@st.composite
def prompts_and_contexts(draw):
    """(ids, context): mostly a context with room for a few tokens after the prompt, sometimes
    one the prompt fills or overflows, sometimes an odd context value."""
    ids = draw(st.lists(token_ids, max_size=10))
    if draw(st.sampled_from(["fitted", "fitted", "fitted", "odd"])) == "odd":
        return ids, draw(small_contexts)
    return ids, len(ids) + draw(st.sampled_from([3, 1, 2, 4, 5, 0, -3]))


texts = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\ud800", "▁", "<|im_end|>", "<tools>", "\x00"]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
tools_values = st.one_of(
    st.none(),
    json_values.map(json.dumps),  # valid JSON of any shape (a scalar is an InputError)
    st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=3), max_size=3),
    texts,  # mostly invalid JSON
    st.sampled_from(["[{", "[]", '[{"name":"f"}]', '[{"x": NaN}]', "{}", 42, b"[]"]),
)


def effective_context(context, limit):
    """The documented context rule (docs/api.md, stream): the number, truncated and clamped;
    None, NaN, ±inf and what is not a number give the limit."""
    try:
        value = float(context)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past the float range
        return limit
    return max(1, min(int(value), limit)) if math.isfinite(value) else limit


def clamped(raw, vocab: int) -> bool:
    """The documented rule, written out: is this prompt id reported in ``clamped_ids``?"""
    if isinstance(raw, int):  # bool included
        value = int(raw)
    elif isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        value = int(raw)
    else:
        return True
    return not 0 <= value < vocab


def assert_ids_in_range(model, ids):
    assert all(isinstance(i, int) and 0 <= i < model.geometry.head_rows for i in ids), ids


# ----------------------------------------------------------------------------------- cheap calls


@check(CHEAP)
@given(prompt=texts, query=st.one_of(st.none(), texts), tools=tools_values, system=st.one_of(st.none(), texts, st.integers()))
def test_encode_request_returns_vocabulary_ids_or_an_input_error(model, prompt, query, tools, system):
    tool_calling = query is not None or tools is not None
    try:
        ids = model.encode_request(prompt, query=query, tools=tools, system=system)
    except InputError as exc:
        if tool_calling and not isinstance(system, (str, type(None))):
            assert str(exc) == f"system must be text (str), got {type(system).__name__}"
        else:
            assert str(exc).startswith("tools: ")
        return
    assert not tool_calling or isinstance(system, (str, type(None)))
    assert all(isinstance(i, int) and 0 <= i < model.geometry.vocab for i in ids)
    if query is None and tools is None:
        assert ids == ([] if prompt == "" else [model.tokenizer.bos_id] + model.tokenizer.encode(prompt))


@check(CHEAP)
@given(text=st.text(max_size=60).filter(lambda t: "▁" not in t))
def test_tokenizer_round_trips_any_text(model, text):
    ids = model.tokenizer.encode(text)
    assert all(0 <= i < model.tokenizer.vocab_size for i in ids)
    assert model.tokenizer.decode(ids) == text


@check(CHEAP)
@given(ids=st.lists(token_ids, max_size=20))
def test_tokenizer_decode_takes_any_ids(model, ids):
    assert isinstance(model.tokenizer.decode(ids), str)
    decoder = model.tokenizer.stream_decoder()
    assert isinstance("".join(decoder.push(i) for i in ids) + decoder.finish(), str)


@check(CHEAP)
@given(text=st.one_of(texts, st.builds(lambda a, b, c: f"{a}<think>{b}</think><tool_call>{c}</tool_call>",
                                      texts, texts, json_values.map(json.dumps))))
def test_parse_completion_never_raises(text):
    completion = parse_completion(text)
    assert completion.raw == text
    assert completion.tool_calls is None or all(
        isinstance(c["name"], str) and isinstance(c["arguments"], dict) for c in completion.tool_calls)


@check(CHEAP)
@given(query=texts, tools=tools_values, system=st.one_of(st.none(), texts))
def test_prompt_building_is_text_or_an_input_error(query, tools, system):
    try:
        text = build_prompt(query, tools, system)
    except InputError as exc:
        assert str(exc).startswith("tools: ")
        with pytest.raises(InputError):
            compact_tools_json(tools)
        return
    assert text.endswith("<|im_start|>assistant\n") and compact_tools_json(tools) in text


@check(CHEAP)
@given(temperature=odd_numbers, top_k=odd_numbers, top_p=odd_numbers, seed=odd_numbers,
       max_tokens=odd_numbers, remaining=st.integers(-5, 300))
def test_sampling_settings_saturate(temperature, top_k, top_p, seed, max_tokens, remaining):
    s = Sampling.saturate(temperature, top_k, top_p, seed, vocab=512)
    assert 0.0 <= s.temperature <= 100.0 and 0 <= s.top_k <= 512 and 1e-6 <= s.top_p <= 1.0
    assert isinstance(s.seed, int) and 0 <= s.seed <= U32_MAX
    assert 0 <= clamp_budget(max_tokens, remaining) <= max(remaining, 0)


@check(CHEAP)
@given(ids=st.lists(token_ids, max_size=30))
def test_ids_saturate_to_u32(ids):
    out, changed = saturate_ids(ids, vocab=512)
    assert len(out) == len(ids) and all(isinstance(i, int) and 0 <= i <= U32_MAX for i in out)
    assert changed == sum(clamped(raw, 512) for raw in ids)


@check(MODEL_CALLS)
@given(context=st.one_of(small_contexts, odd_numbers), kv=st.sampled_from(["f32", "int8", "INT8", None, 8]))
def test_sessions_take_any_context(model, context, kv):
    """Session creation alone (allocation, no forward pass) follows the documented rule."""
    session = model.gpu.session(context=context, kv=kv)
    try:
        assert session.context == effective_context(context, model.geometry.max_seq_len)
        assert session.int8 == (str(kv).lower() == "int8")
    finally:
        session.close()


def test_the_session_api_saturates_ids_and_checks_sampling(model):
    """The low-level session reads ids and sampling as the engine does (docs/api.md, Sessions)."""
    odd = [-1, 2 ** 32, 5.0, None, 2.5, True]
    saturated = [0, U32_MAX, 5, 0, 0, 1]
    sessions = [model.gpu.session(context=8) for _ in range(3)]
    try:
        assert sessions[0].all_logits(odd) == sessions[1].all_logits(saturated)
        assert sessions[2].prefill(iter(odd[:4])) is None and sessions[2].position == 4
        sampled = sessions[2].prefill([2], Sampling(temperature=NAN, top_k=10 ** 9, seed=-1))
        assert 0 <= sampled < model.geometry.head_rows
        for bad in (0.7, "greedy", {}):
            with pytest.raises(InputError, match="sampling must be a Sampling"):
                sessions[2].step(bad)
        assert sessions[2].position == 5 and 0 <= sessions[2].step(Sampling()) < model.geometry.head_rows
        with pytest.raises(InputError, match=r"unknown keyword 'sample' \(did you mean 'sampling'\?\)"):
            sessions[2].prefill([2], sample=None)
    finally:
        for session in sessions:
            session.close()
    scorer = model.gpu.session(context=4, confidence=1)
    try:
        assert scorer.confidence_logit([]) == 0.0
        assert math.isfinite(scorer.confidence_logit([2, -1, 2 ** 40]))
    finally:
        scorer.close()
    with pytest.raises(InputError, match="confidence must be True or False"):
        model.gpu.session(context=4, confidence=[1, 2])


# ----------------------------------------------------------------------------------- calls that run the model


@check(MODEL_CALLS)
@given(ids=st.lists(token_ids, max_size=14), context=small_contexts)
def test_logits_are_finite_rows_of_head_rows(model, ids, context):
    if len(ids) > effective_context(context, model.geometry.max_seq_len):  # reported, never cut
        with pytest.raises(ContextFullError):
            model.logits(ids, context=context)
        return
    rows = model.logits(ids, context=context)
    assert len(rows) == len(ids)
    assert all(len(row) == model.geometry.head_rows for row in rows)
    assert all(math.isfinite(x) for row in rows for x in row)


@check(2 * MODEL_CALLS)
@given(request=prompts_and_contexts(), max_tokens=budgets,
       temperature=odd_numbers, top_k=odd_numbers, top_p=odd_numbers, seed=odd_numbers,
       kv=st.sampled_from(["f32", "int8"]))
def test_generate_from_ids(model, request, max_tokens, temperature, top_k, top_p, seed, kv):
    ids, context = request
    result = model.generate(ids=ids, context=context, max_tokens=max_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, kv=kv)
    limit = effective_context(context, model.geometry.max_seq_len)
    budget = clamp_budget(max_tokens, limit - len(ids))
    assert result.prompt_tokens == len(ids)
    assert result.clamped_ids == sum(clamped(raw, model.geometry.vocab) for raw in ids)
    assert_ids_in_range(model, result.ids)
    assert len(result.ids) <= max(0, limit - len(ids))  # prompt + completion <= context
    event(f"{result.finish_reason}, {'some' if result.ids else 'no'} tokens")
    if not ids:
        assert result.finish_reason == "empty"
    elif result.finish_reason == "length":
        assert len(result.ids) == budget
    else:
        assert result.finish_reason == "eos" and len(result.ids) < budget


@check(MODEL_CALLS)
@given(prompt=texts, query=st.one_of(st.none(), texts), tools=tools_values, max_tokens=budgets,
       context=st.one_of(st.integers(1, 48), st.sampled_from([None])), stop=st.one_of(texts, st.lists(texts, max_size=2)))
def test_generate_from_text(model, prompt, query, tools, max_tokens, context, stop):
    if context is None and max_tokens not in (0, 1, 2, 3, 4):
        max_tokens = 2  # the default context is 256: keep the run short
    events = []
    result = GenerationResult("", [], "empty", 0)
    try:
        for token in model.stream(prompt, query=query, tools=tools, max_tokens=max_tokens, context=context,
                                  stop=stop, result=result):
            events.append(token)
    except InputError as exc:
        assert str(exc).startswith("tools: ")
        return
    assert result.finish_reason in FINISH_REASONS
    event(f"{result.finish_reason}, {'some' if result.ids else 'no'} tokens")
    assert [e.id for e in events] == result.ids
    assert_ids_in_range(model, result.ids)
    assert len(result.ids) <= max(0, effective_context(context, model.geometry.max_seq_len) - result.prompt_tokens)
    if result.finish_reason != "stop":
        assert "".join(e.text for e in events) == result.text


@check(MODEL_CALLS // 2)
@given(ids=st.lists(token_ids, max_size=10))
def test_confidence_is_a_probability(model, ids):
    value = model.confidence(ids)
    assert 0.0 <= value <= 1.0
    assert value == 0.5 or ids


def test_confidence_without_a_head_is_unsupported_and_the_model_still_generates(device):
    model = Needle3.load(NO_HEADS, device=device)
    with pytest.raises(UnsupportedModelError, match="no confidence head"):
        model.confidence([2, 3])
    assert len(model.generate(ids=[2, 3], max_tokens=2, context=8).ids) == 2


# ----------------------------------------------------------------------------------- mutated model files


HEADER_WORDS_THAT_MAY_LOAD = (3, 4, 6, 13, 16, 17, 24, 25, 27, 28, 32, 48)  # found by trying every word
HEADER_VALUES = (0, 3, 7, 16, 63, 128, 256, 512, 4095, 65536, 1 << 20, (1 << 20) + 1, 1 << 31, (1 << 32) - 1)


def header_edits_that_load():
    """Files whose header word was edited yet still pass the reader: the geometry the GPU sees
    changes (KV window and bits, out_vocab, max_seq_len, sliding window, global mask, Engram
    dilation, seed heads, orders, sites, rope_theta)."""
    for word in HEADER_WORDS_THAT_MAY_LOAD:
        for value in HEADER_VALUES:
            data = bytearray(VALID)
            struct.pack_into("<I", data, 4 * word, value)
            try:
                cact.load(bytes(data))
            except NeedleError:
                continue
            if bytes(data) != VALID:
                yield word, value, bytes(data)


def test_files_that_load_run_or_raise_a_needle_error(device):
    """A file is refused at load or serves small requests: what no kernel can run is caught when
    the model is opened (docs/api.md, "What a model may use"), not at every request."""
    ran = refused = 0
    for word, value, data in list(header_edits_that_load())[::3]:
        try:
            model = Needle3.load(data, device=device)
        except NeedleError:
            refused += 1
            continue
        rows = model.logits([2, 600, 5], context=3)
        result = model.generate(ids=[2, 5, 70000], max_tokens=2, context=8)
        ran += 1
        assert len(rows) == 3, (word, value)
        assert_ids_in_range(model, result.ids)
    assert ran >= 15, (ran, refused)  # the cases are not all refused up front


# ----------------------------------------------------------------------------------- memory


def native_live_objects():
    import wgpu

    counts = wgpu.diagnostics.wgpu_native_counts.get_dict()
    return {kind: counts[kind]["count"] for kind in ("Buffer", "BindGroup")}


def resident_bytes():
    statm = Path("/proc/self/statm")
    return int(statm.read_text().split()[1]) * 4096 if statm.exists() else 0


def test_repeated_requests_leave_memory_flat(model):
    """30 identical requests after a warm-up: Python's heap, the process's resident memory and
    wgpu-native's live buffers and bind groups all come back to the same level. The cumulative
    allocation counter grows by the same amount each time (it counts traffic, not residency)."""
    def request():
        return model.generate(ids=[2, 17, 300, 70000], max_tokens=3, context=16, temperature=0.8, seed=1)

    for _ in range(3):
        request()
    gc.collect()
    live = native_live_objects()
    rss = resident_bytes()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        per_request = set()
        for _ in range(30):
            before = sum(model.gpu.device.counters.bytes_allocated.values())
            result = request()
            per_request.add(sum(model.gpu.device.counters.bytes_allocated.values()) - before)
        gc.collect()
        heap_growth = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert len(result.ids) == 3
    assert len(per_request) == 1 and per_request.pop() > 0
    assert heap_growth < 256 * 1024, f"Python heap grew by {heap_growth} bytes over 30 requests"
    assert native_live_objects() == live
    # Generous: lavapipe's allocator keeps some pages; a per-request leak of even 1 MB fails this.
    assert resident_bytes() - rss < 24 * 1024 * 1024


# ----------------------------------------------------------------------------------- device loss


def test_device_destroyed_mid_generation(device):
    """NativeDevice.destroy() after the first token: DeviceLostError on the next step, on every
    later call on that device, and a new device serves the same model with the same logits."""
    reference = Needle3.load(VALID, device=device).logits([2, 17, 300], context=3)
    lost_device = open_device()
    model = Needle3.load(VALID, device=lost_device)
    session_before = model.gpu.session(context=8)
    plan_before = session_before._plan(PlanKey(1))
    result = GenerationResult("", [], "empty", 0)
    with pytest.raises(DeviceLostError):
        for _ in model.stream(ids=[2, 17, 300], max_tokens=5, context=8, result=result):
            lost_device.destroy()
    assert len(result.ids) == 1

    calls = {
        "generate": lambda: model.generate(ids=[2, 3], max_tokens=2, context=8),
        "logits": lambda: model.logits([2, 3], context=4),
        "confidence": lambda: model.confidence([2, 3]),
        "load on the lost device": lambda: Needle3.load(VALID, device=lost_device),
        "session prefill": lambda: session_before.prefill([2, 3]),
        "buffer": lambda: lost_device.buffer(64, label="after"),
        "read": lambda: lost_device.read(session_before.result, 4),
        "write": lambda: lost_device.write(session_before.result, b"\0" * 16),
        "run": lambda: lost_device.run(plan_before),
        "new plan": lambda: session_before._plan(PlanKey(2)),
        "pipeline": lambda: lost_device.pipeline(KernelKey("sample", consts=(("ITEMS", 7),))),
    }
    for name, call in calls.items():
        with pytest.raises(DeviceLostError):
            call()
    session_before.close()

    fresh = Needle3.load(VALID)  # device=None: a new native device
    assert fresh.gpu.device is not lost_device
    assert fresh.logits([2, 17, 300], context=3) == reference
    assert len(fresh.generate(ids=[2, 17], max_tokens=2, context=8).ids) == 2


def test_a_loss_the_wrapper_did_not_see_is_still_a_device_lost_error():
    """The raw wgpu device destroyed behind NativeDevice's back (as a driver reset would): the
    wgpu exceptions that follow are translated, and the device then fails fast."""
    lost_device = open_device()
    model = Needle3.load(VALID, device=lost_device)
    session = model.gpu.session(context=8)
    lost_device._device.destroy()
    with pytest.raises(DeviceLostError):
        session.prefill([2, 3], Sampling())
    assert lost_device.lost
    with pytest.raises(DeviceLostError):
        model.generate(ids=[2, 3], max_tokens=1, context=4)
    session.close()


# ----------------------------------------------------------------------------------- memory and limits


class _RawDeviceWithBudget:
    """Forwards to a real wgpu device but refuses buffers past a byte budget with wgpu's own
    out-of-memory exception, so NativeDevice's translation is what is tested."""

    def __init__(self, raw, budget):
        self._raw, self.budget = raw, budget

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def create_buffer(self, *, size, **options):
        import wgpu

        if size > self.budget:
            raise wgpu.GPUOutOfMemoryError("Out of Memory (simulated)")
        self.budget -= size
        return self._raw.create_buffer(size=size, **options)


def test_out_of_memory_is_its_own_error_and_the_engine_stays_usable():
    device = open_device()
    device._device = _RawDeviceWithBudget(device._device, budget=100 * 1024)
    with pytest.raises(OutOfMemoryError):
        Needle3.load(VALID, device=device)
    device._device.budget = 64 * 1024 * 1024
    model = Needle3.load(VALID, device=device)
    # A session of 256 positions needs about 3.4 MB on the tiny model, one of 8 about 0.75 MB.
    device._device.budget = 2 * 1024 * 1024
    with pytest.raises(OutOfMemoryError):
        model.generate(ids=[2, 3], max_tokens=2)  # the default context does not fit
    device._device.budget = 2 * 1024 * 1024
    assert len(model.generate(ids=[2, 3], max_tokens=2, context=8).ids) == 2


def test_a_model_over_the_device_limits_is_a_device_limit_error(device):
    small = open_device(max_storage_binding=1024)
    with pytest.raises(DeviceLimitError):
        Needle3.load(VALID, device=small).generate(ids=[2, 3], max_tokens=1, context=4)
    model = Needle3.load(VALID, device=device)
    assert len(model.generate(ids=[2, 3], max_tokens=1, context=4).ids) == 1
