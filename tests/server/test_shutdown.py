"""``needle-wgpu serve`` as a process: it starts on 127.0.0.1, and on SIGTERM a stream in flight
finishes or ends with an error chunk, then ``[DONE]``; the
process exits (by the signal, once it has shut down); nothing hangs."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .conftest import ROOT, free_port

pytestmark = pytest.mark.gpu

BOUND_S = 60


def test_sigterm_ends_in_flight_streams_and_the_process(tiny_gguf, tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "needle_wgpu", "serve", f"tiny={tiny_gguf}", "--port", str(port),
                                "--context", "512", "--shutdown-grace", "0.5", "--log-level", "warning"],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                threading.Event().wait(0.1)
        assert process.poll() is None, (tmp_path / "server.log").read_text()
        lines, first_token = [], threading.Event()

        def stream():
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Go"}], "max_tokens": 480,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=BOUND_S) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                    if '"content": "' in line and '"content": ""' not in line:
                        first_token.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_token.wait(BOUND_S)
        process.send_signal(signal.SIGTERM)
        reader.join(BOUND_S)
        assert not reader.is_alive()
        # uvicorn re-raises the signal once it has shut down: the status of a process ended by SIGTERM
        assert process.wait(BOUND_S) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(BOUND_S)
        log.close()
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    if "error" in last:
        assert last["error"]["code"] == "shutting_down"
    else:  # it finished within the grace period
        assert any(json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines[1:-1]
                   if json.loads(line[6:]).get("choices"))


def test_a_model_that_cannot_load_is_one_line_and_status_2(tiny_gguf, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[:1000])
    for args in ([str(broken)], [str(tmp_path / "missing.gguf")], [f"a={tiny_gguf}", f"a={broken}"]):
        done = subprocess.run([sys.executable, "-m", "needle_wgpu", "serve", *args, "--port", str(free_port())],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                              timeout=BOUND_S)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("needle-wgpu: ") and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
