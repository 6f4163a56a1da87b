"""A bounded load: 16 concurrent streaming clients, 48 requests (greedy and seeded sampling, each
its own prompt), against 4 sequences decoded together (batched) and a queue that holds 8. Every request either streams exactly the answer
it gets alone (the server's non-streamed answer, asked one at a time beforehand) or is refused
with a typed 429; nothing is lost, and afterwards nothing is queued, running or holding KV."""

import asyncio
import re

import httpx
import pytest

openai = pytest.importorskip("openai")

from .conftest import live_server, models, run_async  # noqa: E402
from needle_wgpu.server import Limits, ServerConfig  # noqa: E402

pytestmark = pytest.mark.gpu

CLIENTS, REQUESTS, MAX_TOKENS = 16, 48, 12


def request(i: int) -> dict:
    sampled = i % 2 == 1
    return {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
            "max_tokens": MAX_TOKENS, "temperature": 0.8 if sampled else 0.0, "seed": 1000 + i}


def test_concurrent_streams_get_their_own_answers_or_a_typed_error(tiny_gguf):
    config = ServerConfig(models=models(tiny_gguf, context=128)[:1], limits=Limits(max_queue=8, max_sequences=4))
    with live_server(config) as (url, runner):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            alone = [client.chat.completions.create(**request(i)).choices[0] for i in range(REQUESTS)]

        async def load():
            outcomes = [None] * REQUESTS
            todo = asyncio.Queue()
            for i in range(REQUESTS):
                todo.put_nowait(i)
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
                async def client_loop():
                    while not todo.empty():
                        i = todo.get_nowait()
                        try:
                            stream = await c.chat.completions.create(**request(i), stream=True)
                            text, finish = "", None
                            async for chunk in stream:
                                if chunk.choices:
                                    text += chunk.choices[0].delta.content or ""
                                    finish = chunk.choices[0].finish_reason or finish
                            outcomes[i] = ("answer", text, finish)
                        except openai.RateLimitError as exc:
                            retry_after = exc.response.headers.get("retry-after")
                            outcomes[i] = ("refused", exc.status_code, exc.body["code"], retry_after)
                            await asyncio.sleep(min(float(retry_after), 1.0))  # as a polite client does

                await asyncio.gather(*[client_loop() for _ in range(CLIENTS)])
            return outcomes

        outcomes = run_async(load(), 300)
        health, metrics = httpx.get(url + "/health").json(), httpx.get(url + "/metrics").text
        stepper = runner.config.app.state.host.schedulers["tiny"].stepper
    answered = [i for i, o in enumerate(outcomes) if o and o[0] == "answer"]
    refused = [i for i, o in enumerate(outcomes) if o and o[0] == "refused"]
    assert len(answered) + len(refused) == REQUESTS  # nothing lost
    assert len(answered) >= CLIENTS // 2 and refused  # both outcomes happen: 16 clients, room for 12
    print(f"{len(answered)} answered, {len(refused)} refused")
    for i in answered:
        assert outcomes[i][1:] == (alone[i].message.content, alone[i].finish_reason), i
    for i in refused:
        status, code, retry_after = outcomes[i][1:]
        assert status == 429 and code == "queue_full" and int(retry_after) >= 1
    assert stepper.rows > stepper.steps  # decode steps advanced several requests at once
    gauges = health["models"]["tiny"]
    assert gauges["kv_pool_sequences"] == 4 and 0 < stepper.pool.size <= 4  # the pool's sessions, reused
    # the KV memory held: the pool's sessions, and the free slots of the slab page they are in
    # (one page of the pool's 4 sequences, made at the first request)
    kv_bytes = runner.config.app.state.host.schedulers["tiny"].kv_bytes
    assert stepper.batch.idle_slots() == 4 - stepper.pool.size
    assert 4 * kv_bytes <= gauges["kv_pool_bytes"] <= 4 * kv_bytes + 4 * 16 * stepper.model.gpu.geometry.num_layers
    assert {k: gauges[k] for k in ("queue_depth", "active_sequences", "kv_bytes_in_use")} == \
        {"queue_depth": 0, "active_sequences": 0, "kv_bytes_in_use": 0}
    assert 0 < gauges["prefix_cache_bytes"] <= Limits().prefix_cache_bytes  # kept for later prefixes, bounded
    assert _count(metrics, 'outcome="ok"') == REQUESTS + len(answered)
    assert _count(metrics, 'outcome="queue_full"') == 0  # refused before a job existed: only the HTTP count
    assert _count(metrics, 'path="/v1/chat/completions",status="429"') == len(refused)


def _count(metrics: str, labels: str) -> int:
    return sum(int(v) for v in re.findall(r"\{[^}]*" + re.escape(labels) + r"[^}]*\} (\d+)", metrics))
