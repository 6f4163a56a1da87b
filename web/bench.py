"""Browser benchmark: boot, model load and generation speed of the demo in headless Chromium.

    python build.py && python web/bench.py [--prompt 16] [--decode 8] [--model PATH]

The generation part includes the host cost per token (encode+submit, readback CPU and wall, as
``needle-wgpu bench`` reports it on the desktop) and the adapter kind. Prints one JSON object
and writes it to test-artifacts/browser-bench.json. On a machine without a GPU, Chromium's
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


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--decode", type=int, default=8, help="tokens to generate")
    parser.add_argument("--model", help="a .gguf or .cact file to load instead of the default model")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
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
