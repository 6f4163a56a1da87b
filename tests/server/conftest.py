"""Live servers for the server's tests: uvicorn on 127.0.0.1 (a free port) in a thread of the
test process, stopped by the fixture (bounded waits both ways).

The models: a tiny synthetic dense GGUF (``synth_gguf``, SmolLM2's tokenizer and chat template
when installed), whose numbers mean nothing but run in milliseconds on lavapipe, and the
upstream Needle 3 fixture with an embedding head (``tests/fixtures/upstream``). The real
SmolLM2 only where its answers matter."""

import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from needle_wgpu.server import Limits, ModelSpec, ServerConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NEEDLE_WITH_HEADS = ROOT / "tests" / "fixtures" / "upstream" / "small-allheads.cact"
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30


def run_async(coroutine, timeout_s: float):
    """``asyncio.run(coroutine)`` bounded by ``timeout_s``, on a thread of its own: the session's
    Playwright page (tests/browser) keeps an event loop running on the main thread, where
    ``asyncio.run`` refuses to start another."""
    import asyncio

    outcome = {}

    def target():
        try:
            outcome["value"] = asyncio.run(asyncio.wait_for(coroutine, timeout_s))
        except BaseException as exc:  # noqa: BLE001  raised again on the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="test event loop", daemon=True)
    thread.start()
    thread.join(timeout_s + STOP_TIMEOUT_S)
    assert not thread.is_alive(), "the event loop did not finish"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(config: ServerConfig):
    """A running server for ``config``: yields (base URL, the uvicorn server)."""
    from needle_wgpu.server.run import server

    runner = server(config, host="127.0.0.1", port=free_port(), log_level="warning")
    thread = threading.Thread(target=runner.run, name="test server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not runner.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not runner.started:
        runner.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        pytest.fail("the server did not start")
    port = runner.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", runner
    finally:
        runner.config.app.state.host.begin_shutdown()
        runner.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    return write_dense_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf", SynthDense(context=512))


def models(tiny_gguf, context=512) -> tuple:
    return (ModelSpec("tiny", str(tiny_gguf), context=context), ModelSpec("needle", str(NEEDLE_WITH_HEADS)))


@pytest.fixture(scope="module")
def served(tiny_gguf):
    """The shared server: "tiny" (dense, context 512) and "needle" (Needle 3 with heads)."""
    with live_server(ServerConfig(models=models(tiny_gguf))) as (url, _):
        yield url


def limits(**changes) -> Limits:
    return Limits(**changes)


# ------------------------------------------------------------------------ a GPU-free paced model


def paced_model(script: str, pace_s: float):
    """A ``Model`` over ``test_conversation.ScriptedGpu`` (SmolLM2's tokenizer and template, no
    GPU) that answers every request with ``script``; each decode step waits for a token from
    ``model.gpu.gate`` (a semaphore the test releases) or ``pace_s``, whichever comes first:
    a gated model with a long pace, a slow one with a short pace."""
    from needle_wgpu.api import Model
    from tests.test_conversation import ScriptedGpu, ScriptedSession

    class PacedSession(ScriptedSession):
        def prefill(self, ids, sampling=None, should_stop=None):
            self.gpu.replies = [self.gpu.script]
            return super().prefill(ids, sampling, should_stop)

        def step(self, sampling):
            self.gpu.gate.acquire(timeout=self.gpu.pace_s)
            self.gpu.steps += 1
            return super().step(sampling)

    class PacedGpu(ScriptedGpu):
        def __init__(self):
            super().__init__()
            self.script, self.pace_s, self.gate, self.steps = script, pace_s, threading.Semaphore(0), 0

        def session(self, context=None, kv="f32"):
            self.sessions.append(PacedSession(self, context))
            return self.sessions[-1]

    return Model(PacedGpu())


COUNTING = " ".join(f"w{i}" for i in range(400))  # 400+ tokens of reply


def wait_until(condition, timeout_s: float = 30.0, what: str = "the condition"):
    """Poll ``condition()`` (bounded: ``timeout_s``), for state another thread changes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        threading.Event().wait(0.01)
    pytest.fail(f"{what} did not happen within {timeout_s} s")
