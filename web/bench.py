"""Browser benchmark: boot, model load and generation speed of the demo in headless Chromium.

    python build.py && python web/bench.py [--prompt 16] [--decode 8] [--model PATH]

The generation part includes the host cost per token (encode+submit, readback CPU and wall, as
``needle-wgpu bench`` reports it on the desktop) and the adapter kind. For a GGUF model the same
free prompt then runs through the page's form on both engines: WebGPU, then the CPU engine
(llama.cpp in WebAssembly, wllama), each with its time to first token and decode speed
(``--no-cpu-engine`` skips it). Prints one JSON object and writes it to
test-artifacts/browser-bench.json. On a machine without a GPU, Chromium's
WebGPU is SwiftShader (a CPU rasteriser): the numbers then say how the engine behaves (boot,
compile, dispatches per step), not how fast a real GPU is.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "web" / "dist"
CHROMIUM_ARGS = ["--no-sandbox", "--enable-unsafe-webgpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


FORM_PROMPT = "The capital city of France is Paris. The capital city of Italy is"  # 15 tokens (SmolLM2)


def form_run(page, prompt: str, decode: int) -> dict:
    """One greedy free prompt through the page's form, as a visitor runs it: the result's speed."""
    page.click("#tab-prompt")
    for selector, value in (("#prompt-input", prompt), ("#max-tokens", str(decode)), ("#temperature", "0")):
        page.fill(selector, value)
    page.evaluate("() => { window.needle.lastResult = null; }")
    started = time.perf_counter()
    page.click("#generate-button")
    page.wait_for_function("() => window.needle.lastResult !== null", timeout=0)
    seconds = time.perf_counter() - started
    reply = page.evaluate("() => window.needle.lastResult")
    if not reply["ok"]:
        raise SystemExit(f"the form's request failed: {reply['error']['message']}")
    r = reply["result"]
    return {"engine": r.get("engine", "webgpu"), "promptTokens": r["promptTokens"], "tokens": r["tokens"],
            "text": r["text"], "seconds": round(seconds, 2), "timeToFirstTokenSeconds": r["timeToFirstTokenSeconds"],
            "prefillTokensPerSecond": r.get("prefillTokensPerSecond"),
            "decodeTokensPerSecond": r["decodeTokensPerSecond"], "host": r.get("host")}


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--decode", type=int, default=8, help="tokens to generate")
    parser.add_argument("--model", help="a .gguf or .cact file to load instead of the default model")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--no-cpu-engine", action="store_true", help="skip the two engines' form runs")
    args = parser.parse_args(argv)
    if not (DIST / "build.json").exists():
        raise SystemExit("web/dist is missing: run python build.py first")
    from playwright.sync_api import sync_playwright

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(DIST)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    report = {}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page()
            started = time.perf_counter()
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            page.wait_for_function("() => window.needle && window.needle.ready")
            page.evaluate("() => window.needle.ready")
            report["pageReadySeconds"] = round(time.perf_counter() - started, 2)
            report["bootSeconds"] = page.evaluate("() => window.needle.bootSeconds")
            report["bootStages"] = page.evaluate("() => window.needle.bootStages")
            if args.model:
                page.evaluate("() => { window.needle.lastLoad = null; }")
                page.set_input_files("#file-input", args.model)
                page.wait_for_function("() => window.needle.lastLoad !== null", timeout=0)
            model = page.evaluate("() => window.needle.model")
            if model is None:
                raise SystemExit(f"no model loaded: {page.evaluate('() => window.needle.errorText()')}")
            report["model"] = model
            reply = page.evaluate("([p, d]) => window.needle.request('bench', {prompt: p, decode: d})",
                                  [args.prompt, args.decode])
            if not reply["ok"]:
                raise SystemExit(f"bench failed: {reply['error']['message']}")
            report["generation"] = reply["result"]
            if model["family"] == "dense" and not args.no_cpu_engine:
                page.set_default_timeout(0)
                report["form"] = {"webgpu": form_run(page, FORM_PROMPT, args.decode)}
                started = time.perf_counter()
                load = page.evaluate("() => window.needle.switchEngine('cpu')")
                if not load or not load["ok"]:
                    raise SystemExit(f"the CPU engine did not load the model: {load}")
                report["cpuEngineLoadSeconds"] = round(time.perf_counter() - started, 2)
                # Its first request (llama.cpp's warm-up) out of the figures, on another prompt: llama.cpp
                # keeps the last prompt's cache, and the figures are for a prompt read from scratch.
                form_run(page, "Hello.", 2)
                report["form"]["cpu"] = form_run(page, FORM_PROMPT, args.decode)
            browser.close()
    finally:
        server.shutdown()
    text = json.dumps(report, indent=2)
    print(text)
    out = ROOT / "test-artifacts" / "browser-bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
