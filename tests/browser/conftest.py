"""Browser fixtures: build web/dist, serve it, launch Chromium once and boot the page once.

The system Chromium (Debian package) runs headless with WebGPU on SwiftShader; Playwright drives
it without downloading a browser. Booting Pyodide and compiling the pipelines takes ~15-20 s on
a 2-core machine, so one page is shared by the whole session and tests leave it usable.
"""

from __future__ import annotations

import functools
import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from .pages import BUNDLED, CHROMIUM, DIST, ROOT, SLOW_PAGE_MS, banner, launch



class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def site() -> str:
    """``python build.py`` (seconds when cached), then web/dist on a free 127.0.0.1 port."""
    built = subprocess.run([sys.executable, str(ROOT / "build.py")], cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, f"build.py failed:\n{built.stdout}\n{built.stderr}"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(DIST)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def playwright():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} not found: the browser tests need the Debian chromium package (bash setup.sh --dev)")
    with sync_api.sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="session")
def browser(playwright):
    launched = launch(playwright)
    yield launched
    launched.close()


@pytest.fixture(scope="session")
def console_lines() -> list:
    return []


@pytest.fixture(scope="session")
def app(browser, site, console_lines):
    """The demo page, booted, with the bundled model loaded (what a visitor sees first)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(SLOW_PAGE_MS)
    page.on("console", lambda message: console_lines.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: console_lines.append(f"pageerror: {error}"))
    page.goto(f"{site}?model={BUNDLED.name}")  # the tiny model first: most tests need only the machinery
    page.wait_for_function("() => window.needle && window.needle.ready")
    page.evaluate("() => window.needle.ready")
    model = page.evaluate("() => window.needle.model")
    assert model is not None, f"the bundled model did not load: {banner(page)!r}\n" + "\n".join(console_lines[-20:])
    yield page
    context.close()
