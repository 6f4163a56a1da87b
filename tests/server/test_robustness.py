"""What no client may do to the server: malformed and hostile bodies (never a 500, and the
server keeps answering), the key, CORS, the body limit, a full queue (429 + Retry-After), the
time limit, and clients that leave mid-stream or while they wait (their sequence is cancelled
at the next step and its session goes back to the KV pool)."""

import json
import threading

import pytest

import httpx

from .conftest import COUNTING, live_server, models, paced_model, wait_until
from needle_wgpu.server import Limits, ModelSpec, ServerConfig

pytestmark = pytest.mark.gpu

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": USER, "max_tokens": 2, "temperature": 0, **fields}


# (name, request body (a dict is sent as JSON, bytes as they are), path, expected status)
HOSTILE = [
    ("empty body", b"", CHAT, 422),
    ("null", b"null", CHAT, 422),
    ("a list", b"[]", CHAT, 422),
    ("not JSON", b"{model: tiny", CHAT, 400),
    ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, CHAT, 400),
    ("NaN and Infinity", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN,'
                         b' "top_p": Infinity, "max_tokens": 2}', CHAT, 200),
    ("max_tokens 1e400", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
     CHAT, 422),
    ("negative max_tokens", chat(max_tokens=-5), CHAT, 200),
    ("a lone surrogate", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800 x"}], "max_tokens": 2}',
     CHAT, 200),
    ("NUL bytes", chat(messages=[{"role": "user", "content": "a\u0000b"}]), CHAT, 200),
    ("a huge seed", chat(seed=2 ** 70, temperature=1.0), CHAT, 200),
    ("top_logprobs 1000", chat(logprobs=True, top_logprobs=1000), CHAT, 200),
    ("a model that is a number", chat(model=5), CHAT, 422),
    ("no messages", chat(messages=[]), CHAT, 400),
    ("an unknown role", chat(messages=[{"role": "wizard", "content": "x"}]), CHAT, 422),
    ("ends with the assistant", chat(messages=[{"role": "assistant", "content": "x"}]), CHAT, 400),
    ("image content", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     CHAT, 400),
    ("too many messages", chat(messages=USER * 2000), CHAT, 400),
    ("a prompt longer than the context", chat(messages=[{"role": "user", "content": "word " * 4000}]), CHAT, 400),
    ("tools that are text", chat(tools="get_weather"), CHAT, 422),
    ("a tool without a name", chat(tools=[{"type": "function", "function": {"name": 5}}]), CHAT, 400),
    ("required without tools", chat(tool_choice="required"), CHAT, 400),
    ("a tool_choice of another kind", chat(tool_choice="sometimes"), CHAT, 422),
    ("a schema outside the subset", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wat"}}}), CHAT, 400),
    ("an unknown response format", chat(response_format={"type": "yaml"}), CHAT, 400),
    ("logit_bias with a word", chat(logit_bias={"abc": 1}), CHAT, 400),
    ("logit_bias past the vocabulary", chat(logit_bias={"99999999999999999999": 5}), CHAT, 200),
    ("stop that is a number", chat(stop=5), CHAT, 422),
    ("n = 3", chat(n=3), CHAT, 400),
    ("stream_options that are text", chat(stream_options="yes"), CHAT, 422),
    ("two prompts", {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2}, "/v1/completions", 400),
    ("no prompt ids", {"model": "tiny", "prompt": [], "max_tokens": 2}, "/v1/completions", 200),
    ("ids past the vocabulary", {"model": "tiny", "prompt": [99_999_999_999, -4], "max_tokens": 2},
     "/v1/completions", 200),
    ("echo", {"model": "tiny", "prompt": "a", "echo": True}, "/v1/completions", 400),
    ("no inputs", {"model": "needle", "input": []}, "/v1/embeddings", 400),
    ("an empty id list", {"model": "needle", "input": [[]]}, "/v1/embeddings", 400),
    ("negative ids", {"model": "needle", "input": [[2, -5, 2 ** 40]]}, "/v1/embeddings", 200),
    ("dimensions", {"model": "needle", "input": "x", "dimensions": 8}, "/v1/embeddings", 400),
    ("dense ids past the vocabulary", {"model": "tiny", "input": [[2, -5, 2 ** 40]]}, "/v1/embeddings", 200),
    ("a dense input past the context", {"model": "tiny", "input": [[7] * 600]}, "/v1/embeddings", 400),
    ("an unknown path", {}, "/v1/assistants", 404),
]


@pytest.fixture(scope="module")
def tiny_server(tiny_gguf):
    with live_server(ServerConfig(models=models(tiny_gguf, context=128))) as (url, _):
        yield url


@pytest.mark.parametrize("name,body,path,status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_body_gets_its_status_and_never_a_500(tiny_server, name, body, path, status):
    with httpx.Client(base_url=tiny_server, timeout=60) as client:
        if isinstance(body, bytes):
            response = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = client.post(path, json=body)
        assert response.status_code == status, response.text
        if status != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert client.get("/health").status_code == 200


def test_the_body_limit_is_a_413_with_or_without_a_length(tiny_gguf):
    config = ServerConfig(models=models(tiny_gguf)[:1], limits=Limits(max_body_bytes=4096))
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 5000}])).encode()
    with live_server(config) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        response = client.post(CHAT, content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
        chunked = client.post(CHAT, content=iter([big[:3000], big[3000:]]), headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert client.post(CHAT, json=chat()).status_code == 200


def test_the_key_guards_every_endpoint_but_health(tiny_gguf):
    openai = pytest.importorskip("openai")
    config = ServerConfig(models=models(tiny_gguf)[:1], api_key="s3cret")
    with live_server(config) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", CHAT), ("POST", "/v1/embeddings"),
                             ("GET", "/docs"), ("GET", "/openapi.json")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                response = client.request(method, path, headers=headers, json=chat())
                assert response.status_code == 401, (path, headers)
                assert response.json()["error"]["type"] == "authentication_error"
        assert client.get("/health").status_code == 200
        assert client.post(CHAT, json=chat(), headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0) as right:
            assert [m.id for m in right.models.list()] == ["tiny"]


def test_cors_is_off_unless_an_origin_is_given(tiny_gguf):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with live_server(ServerConfig(models=models(tiny_gguf)[:1])) as (url, _):
        response = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in response.headers
        assert "access-control-allow-origin" not in httpx.options(url + CHAT, headers=preflight).headers
    with live_server(ServerConfig(models=models(tiny_gguf)[:1], cors=("https://app.example",), api_key="k")) as (url, _):
        response = httpx.options(url + CHAT, headers={**preflight, "Access-Control-Request-Headers": "authorization"})
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(url + CHAT, headers={**preflight, "Origin": "https://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"
        ok = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"


# ------------------------------------------------------------------------ the queue and the clock


def gauges(client, name="paced") -> dict:
    return client.get("/health").json()["models"][name]


def released(runner, name: str, session) -> bool:
    """The session is closed, or back in its model's KV pool (free for the next request)."""
    pool = runner.config.app.state.host.schedulers[name].stepper.pool
    return session.closed or session not in pool.in_use


def test_a_full_queue_is_a_429_with_retry_after(tiny_gguf):
    model = paced_model("one two three", pace_s=30)
    config = ServerConfig(models=(ModelSpec("paced", lambda: model),), limits=Limits(max_queue=1, max_sequences=1))
    results = {}

    def ask(key, stream):
        with httpx.Client(base_url=url, timeout=60) as c:
            response = c.post(CHAT, json={"model": "paced", "messages": USER, "stream": stream})
            results[key] = (response.status_code, response.text)

    with live_server(config) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        running = threading.Thread(target=ask, args=("running", True))
        running.start()
        wait_until(lambda: gauges(client)["active_sequences"] == 1, what="the first request running")
        waiting = threading.Thread(target=ask, args=("waiting", False))
        waiting.start()
        wait_until(lambda: gauges(client)["queue_depth"] == 1, what="the second request queued")
        refused = client.post(CHAT, json={"model": "paced", "messages": USER})
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        model.gpu.gate.release(100)
        running.join(60)
        waiting.join(60)
        assert results["running"][0] == results["waiting"][0] == 200
        assert results["running"][1].rstrip().endswith("data: [DONE]")
        assert json.loads(results["waiting"][1])["choices"][0]["message"]["content"] == "one two three"


def test_the_time_limit_ends_a_request_with_a_504_or_an_error_chunk(tiny_gguf):
    slow = paced_model(COUNTING, pace_s=0.01)  # 400 tokens: 4 s, past the 0.5 s limit
    config = ServerConfig(models=(ModelSpec("slow", lambda: slow),), limits=Limits(time_limit_s=0.5))
    with live_server(config) as (url, runner), httpx.Client(base_url=url, timeout=60) as client:
        whole = client.post(CHAT, json={"model": "slow", "messages": USER})
        assert whole.status_code == 504 and whole.json()["error"]["code"] == "timeout"
        with client.stream("POST", CHAT, json={"model": "slow", "messages": USER, "stream": True}) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "timeout"
        assert slow.gpu.steps < 300 and all(released(runner, "slow", s) for s in slow.gpu.sessions)
        metrics = client.get("/metrics").text
        assert 'needle_wgpu_requests_total{model="slow",endpoint="chat",outcome="timeout"} 2' in metrics


def test_a_client_that_leaves_mid_stream_cancels_its_sequence_at_the_next_step(tiny_gguf):
    model = paced_model(COUNTING, pace_s=30)
    config = ServerConfig(models=(ModelSpec("paced", lambda: model),))
    with live_server(config) as (url, runner), httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", CHAT, json={"model": "paced", "messages": USER, "stream": True}) as response:
            lines = response.iter_lines()
            contents = []
            model.gpu.gate.release(2)
            for line in lines:
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content"):
                        contents.append(delta["content"])
                if len(contents) == 3:  # the prefill's token and two steps
                    break
        assert COUNTING.startswith("".join(contents))
        session = model.gpu.sessions[-1]

        def cancelled(count):  # a step lets the worker see the cancellation: one token per look
            model.gpu.gate.release()
            return client.get("/metrics").text.count(f'outcome="cancelled"}} {count}') == 1

        wait_until(lambda: cancelled(1), what="the cancellation")
        wait_until(lambda: released(runner, "paced", session), what="the session going back to the pool")
        assert model.gpu.steps < 20 and gauges(client)["active_sequences"] == 0
        # A client that leaves while its whole (not streamed) answer is computed: cancelled too.
        with pytest.raises(httpx.ReadTimeout):
            client.post(CHAT, json={"model": "paced", "messages": USER}, timeout=0.5)
        wait_until(lambda: cancelled(2), what="the second cancellation")
        assert all(released(runner, "paced", s) for s in model.gpu.sessions)
        assert gauges(client)["active_sequences"] == 0
        model.gpu.gate.release(1000)
        again = client.post(CHAT, json={"model": "paced", "messages": USER, "max_tokens": 3})
        content = again.json()["choices"][0]["message"]["content"]
        assert again.status_code == 200 and content and COUNTING.startswith(content)


def test_a_lost_device_is_a_503_and_the_model_is_loaded_again():
    loads = []

    def load():
        loads.append(paced_model("fine", pace_s=0))
        return loads[-1]

    with live_server(ServerConfig(models=(ModelSpec("paced", load),))) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as client:
        loads[-1].gpu.fail_next = True  # the next prefill raises DeviceLostError
        lost = client.post(CHAT, json={"model": "paced", "messages": USER})
        assert lost.status_code == 503 and lost.json()["error"]["code"] == "device_error"
        assert lost.headers["Retry-After"] == "5"
        again = client.post(CHAT, json={"model": "paced", "messages": USER})
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == "fine"
        assert len(loads) == 2
