"""Requests decoded together (server/batching.py) keep every feature of the one generation loop:
a JSON-schema reply, logprobs, a stop string, a token budget, a seeded and a penalised request,
tools, a raw completion and a Needle 3 request all answer exactly as they do alone, while a
client that leaves mid-stream ends its own sequence and nobody else's."""

import asyncio
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from .conftest import live_server, models, run_async, wait_until  # noqa: E402
from needle_wgpu.server import Limits, ServerConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"]}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Tell me about cities."}]
CHATS = [
    {"model": "tiny", "messages": USER, "max_tokens": 40, "temperature": 0,
     "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}},
    {"model": "tiny", "messages": USER, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    {"model": "tiny", "messages": USER, "max_tokens": 24, "temperature": 0.9, "seed": 7, "stop": ["e"]},
    {"model": "tiny", "messages": USER, "max_tokens": 9, "temperature": 0.7, "seed": 3, "frequency_penalty": 1.5,
     "logit_bias": {"70": 4}},
    {"model": "tiny", "messages": USER, "max_tokens": 24, "temperature": 0, "tools": WEATHER,
     "tool_choice": "required"},
    {"model": "needle", "messages": USER, "max_tokens": 12, "temperature": 0.8, "seed": 5},
]
COMPLETION = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}


def answer_of(response) -> tuple:
    choice = response.choices[0]
    if hasattr(choice, "message"):
        message = choice.message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        logprobs = [(e.token, e.logprob) for e in choice.logprobs.content] if choice.logprobs else None
        return message.content, calls, choice.finish_reason, logprobs
    return choice.text, choice.finish_reason


def test_features_of_concurrent_requests_are_those_alone_and_a_leaver_leaves_alone(tiny_gguf):
    config = ServerConfig(models=models(tiny_gguf), limits=Limits(max_sequences=8, prefix_cache_bytes=0))
    with live_server(config) as (url, runner):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            client.embeddings.create(model="tiny", input="first of all")  # a session sized to its input, first
            alone = [answer_of(client.chat.completions.create(**body)) for body in CHATS]
            alone.append(answer_of(client.completions.create(**COMPLETION)))
        stepper = runner.config.app.state.host.schedulers["tiny"].stepper
        before = (stepper.steps, stepper.rows)
        # the served kind's sessions are the batch's (its slab: one attention dispatch a layer), the
        # embedding's its own (once the worker has taken every session back into the pool)
        wait_until(lambda: not stepper.pool.in_use and len(stepper.pool.free) >= 2, what="the sessions given back")
        kinds = {key: session.slab for key, session in list(stepper.pool.free)}
        assert kinds[(512, None)] is not None and kinds[(512, None)] is stepper.batch._slab
        assert [slab for key, slab in kinds.items() if key != (512, None)] == [None]

        async def together():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
                async def leaver():  # streams a long reply and leaves after three chunks
                    stream = await c.chat.completions.create(model="tiny", messages=USER, max_tokens=400,
                                                             temperature=0, stream=True)
                    seen = 0
                    async for _ in stream:
                        seen += 1
                        if seen == 3:
                            break
                    await stream.close()
                    return seen

                answers = await asyncio.gather(*[c.chat.completions.create(**body) for body in CHATS],
                                               c.completions.create(**COMPLETION), leaver())
                return [answer_of(a) for a in answers[:-1]], answers[-1]

        got, left_after = run_async(together(), 300)
        assert got == alone
        assert left_after == 3
        steps, rows = stepper.steps - before[0], stepper.rows - before[1]
        assert rows > steps  # the requests shared decode steps
        wait_until(lambda: 'endpoint="chat",outcome="cancelled"} 1' in httpx.get(url + "/metrics").text,
                   what="the leaving client's request cancelled")
        wait_until(lambda: httpx.get(url + "/health").json()["models"]["tiny"]["active_sequences"] == 0,
                   what="every sequence gone")
    assert json.loads(got[0][0]).keys() == {"city", "population"}
    assert len(got[1][3]) == 6  # the logprobs request kept its logprobs


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])
def test_mixture_of_experts_requests_decoded_together_answer_as_alone(tmp_path, arch):
    """A MoE file's routes (top-k experts per row, chosen on the GPU) stay each row's own through
    the server's batch: greedy, seeded and penalised requests sent at once over HTTP get the
    answers they get one at a time, and they share decode steps."""
    from needle_wgpu.server import ModelSpec
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    path = write_dense_gguf(tmp_path / f"{arch}.gguf", SynthDense(arch=arch, layer_gain=2.0, context=512))
    config = ServerConfig(models=(ModelSpec(arch, str(path), context=512),),
                          limits=Limits(max_sequences=4, prefix_cache_bytes=0))
    bodies = [{"model": arch, "messages": [{"role": "user", "content": text}], "max_tokens": 12, **sampling}
              for text, sampling in [("Tell me about cities.", {"temperature": 0}),
                                     ("A story, please", {"temperature": 0.9, "seed": 11}),
                                     ("Hi", {"temperature": 0.7, "seed": 2, "presence_penalty": 1.0}),
                                     ("What is a river?", {"temperature": 0})]]
    with live_server(config) as (url, runner):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            alone = [answer_of(client.chat.completions.create(**body)) for body in bodies]
        stepper = runner.config.app.state.host.schedulers[arch].stepper
        before = (stepper.steps, stepper.rows)

        async def together():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
                return [answer_of(a) for a in await asyncio.gather(*[c.chat.completions.create(**b) for b in bodies])]

        got = run_async(together(), 300)
        assert stepper.rows - before[1] > stepper.steps - before[0]  # the requests shared decode steps
    assert got == alone
    assert all(content for content, *_ in got)
