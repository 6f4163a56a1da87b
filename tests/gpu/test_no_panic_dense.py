"""The no-panic contract (docs/api.md) on the dense family's new paths: a synthetic MoE file
(qwen3moe, 8 experts, top-2) and a synthetic gemma3 file (sliding window 4, a global layer).
Random ids (out of range and not numbers included), prompts from empty to past the context,
random sampling values: every call returns a well-formed result or raises a NeedleError, and
memory stays flat across calls. The strategies and rules are test_no_panic.py's."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

import needle_wgpu
from needle_wgpu.errors import ContextFullError, NeedleError
from needle_wgpu.sampling import clamp_budget
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

from .test_no_panic import (assert_ids_in_range, budgets, check, clamped, effective_context, native_live_objects,
                            odd_numbers, prompts_and_contexts, resident_bytes, small_contexts, texts, token_ids)

pytestmark = pytest.mark.gpu

CALLS = 40  # examples per property and file

FILES = {
    "qwen3moe": SynthDense(arch="qwen3moe", layer_gain=2.0, seed=5),
    "gemma3": SynthDense(arch="gemma3", n_layers=7, head_dim=32, sliding_window=4, seed=5),
}


@pytest.fixture(scope="module", params=list(FILES))
def model(request, device, tmp_path_factory):
    path = write_dense_gguf(tmp_path_factory.mktemp("no_panic_dense") / f"{request.param}.gguf",
                            FILES[request.param], tokenizer="bytes")
    return needle_wgpu.load(str(path), device=device)


@check(CALLS)
@given(request=prompts_and_contexts(), max_tokens=budgets, temperature=odd_numbers, top_k=odd_numbers,
       top_p=odd_numbers, seed=odd_numbers, kv=st.sampled_from(["f32", "f16", "int8", None, 3]))
def test_generate_from_ids(model, request, max_tokens, temperature, top_k, top_p, seed, kv):
    ids, context = request
    try:
        result = model.generate(ids=ids, context=context, max_tokens=max_tokens, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, kv=kv)
    except NeedleError:
        assert kv not in ("f32", "f16", None)  # only a KV mode the family lacks is refused
        return
    limit = effective_context(context, model.geometry.max_seq_len)
    assert result.prompt_tokens == len(ids)
    assert result.clamped_ids == sum(clamped(raw, model.geometry.vocab) for raw in ids)
    assert_ids_in_range(model, result.ids)
    assert len(result.ids) <= max(0, limit - len(ids))
    if not ids:
        assert result.finish_reason == "empty"
    elif result.finish_reason == "length":
        assert len(result.ids) == clamp_budget(max_tokens, limit - len(ids))


@check(CALLS)
@given(ids=st.lists(token_ids, max_size=14), context=small_contexts)
def test_logits_are_finite_rows(model, ids, context):
    import math

    if len(ids) > effective_context(context, model.geometry.max_seq_len):  # reported, never cut
        with pytest.raises(ContextFullError):
            model.logits(ids, context=context)
        return
    rows = model.logits(ids, context=context)
    assert len(rows) == len(ids)
    assert all(len(row) == model.geometry.head_rows and all(math.isfinite(x) for x in row) for row in rows)


@check(CALLS)
@given(prompt=texts, max_tokens=budgets, stop=st.one_of(texts, st.lists(texts, max_size=2)))
def test_generate_from_text(model, prompt, max_tokens, stop):
    result = model.generate(prompt, max_tokens=max_tokens, context=24, stop=stop)
    assert result.finish_reason in ("empty", "length", "eos", "stop")
    assert_ids_in_range(model, result.ids)


def test_repeated_requests_leave_memory_flat(model):
    """As for Needle 3: after a warm-up, 20 requests leave Python's heap, the resident memory
    and wgpu-native's live buffers and bind groups where they were."""
    def request():
        return model.generate(ids=[1, 17, 300, 70000, 5, 6], max_tokens=3, context=16, temperature=0.8, seed=1)

    for _ in range(3):
        request()
    gc.collect()
    live, rss = native_live_objects(), resident_bytes()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            result = request()
        gc.collect()
        heap_growth = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert len(result.ids) == 3
    assert heap_growth < 256 * 1024, f"Python heap grew by {heap_growth} bytes over 20 requests"
    assert native_live_objects() == live
    assert resident_bytes() - rss < 24 * 1024 * 1024
