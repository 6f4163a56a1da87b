"""The real ``openai`` client, unchanged, against a live server on 127.0.0.1: every answer is
the one the engine gives in-process for the same request (the same file loaded here)."""

import asyncio
import json
import math

import pytest

openai = pytest.importorskip("openai")

import needle_wgpu  # noqa: E402

from .conftest import NEEDLE_WITH_HEADS, run_async  # noqa: E402

pytestmark = pytest.mark.gpu

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"]}


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def local(tiny_gguf):
    """The same tiny file, loaded in this process: what the server must answer."""
    return needle_wgpu.load(tiny_gguf)


def test_models_are_listed_and_found(client):
    assert {m.id for m in client.models.list()} == {"tiny", "needle"}
    assert client.models.retrieve("needle").id == "needle"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_a_chat_completion_is_the_engines_answer(client, local):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    want = local.chat(MESSAGES, max_tokens=8, temperature=0, context=512)
    assert answer.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert answer.choices[0].finish_reason == want["choices"][0]["finish_reason"] == "length"
    assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert answer.model == "tiny" and answer.object == "chat.completion"


def test_a_seeded_sampled_answer_is_reproduced(client, local):
    options = dict(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234)
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, **options)
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, **options)
    want = local.chat(MESSAGES, context=512, **options)["choices"][0]["message"]["content"]
    assert first.choices[0].message.content == again.choices[0].message.content == want


def test_the_stream_adds_up_to_the_answer_and_ends_with_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1
    plain = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                                stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_required_tool_calls_come_back_as_openai_tool_calls(client):
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER,
        tool_choice="required", max_tokens=160, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    streamed = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=160, temperature=0,
        stream=True))
    calls = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_json_schema_reply_parses_and_fits(client):
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A city, as JSON."}], max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    assert answer.choices[0].finish_reason == "stop"
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert isinstance(value["city"], str)


def test_logprobs_come_back_in_openais_shape(client):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    assert all(entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.logprob for entry in content)


def test_a_raw_completion_is_the_engines_and_streams_the_same(client, local):
    answer = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    want = local.generate("Once upon a time", max_tokens=6, temperature=0, context=512)
    assert answer.choices[0].text == want.text and answer.usage.completion_tokens == len(want.ids)
    assert answer.choices[0].finish_reason == "length" and answer.object == "text_completion"
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 6
    by_ids = client.completions.create(model="tiny", prompt=local.encode_request("Once upon a time"), max_tokens=6,
                                       temperature=0)
    assert by_ids.choices[0].text == want.text


def test_embeddings_are_the_heads_vectors(client):
    ids = [[2, 17, 40, 5], [2, 9]]
    answer = client.embeddings.create(model="needle", input=ids)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model="needle", input=ids, encoding_format="float")
    want = needle_wgpu.load(NEEDLE_WITH_HEADS)
    assert [d.index for d in answer.data] == [0, 1] and answer.usage.prompt_tokens == 6
    for got, as_float, seq in zip(answer.data, floats.data, ids):
        vector = want.embed(ids=seq)
        assert len(got.embedding) == len(vector) == 32
        assert max(abs(a - b) for a, b in zip(as_float.embedding, vector)) <= 1e-6
        assert max(abs(a - b) for a, b in zip(got.embedding, vector)) <= 1e-6  # float32 on the wire
        assert abs(math.sqrt(sum(v * v for v in as_float.embedding)) - 1) < 1e-5


def test_embeddings_of_a_dense_model_are_its_pooled_hidden_states(client, tiny_gguf):
    """A dense file's embeddings: ``Model.embed`` (mean pooling of the final hidden states,
    L2-normalised), the text encoded as a raw prompt (BOS as the file says)."""
    answer = client.embeddings.create(model="tiny", input=["hello there", "a longer text to embed"],
                                      encoding_format="float")
    local = needle_wgpu.load(str(tiny_gguf))
    assert [d.index for d in answer.data] == [0, 1]
    assert answer.usage.prompt_tokens == sum(len(local.embedding_ids(t)) for t in ("hello there", "a longer text to embed"))
    for got, text in zip(answer.data, ("hello there", "a longer text to embed")):
        vector = local.embed(text)
        assert len(got.embedding) == local.geometry.d_model
        assert max(abs(a - b) for a, b in zip(got.embedding, vector)) <= 1e-6
    assert answer.data[0].embedding != answer.data[1].embedding


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_the_async_client_streams_and_answers_concurrently(served):
    async def run():
        async with openai.AsyncOpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            async def streamed(i):
                stream = await c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=6,
                    temperature=0, stream=True)
                return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

            async def whole(i):
                answer = await c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=6, temperature=0)
                return answer.choices[0].message.content

            return await asyncio.gather(*[streamed(i) for i in range(3)], *[whole(i) for i in range(3)])

    results = run_async(run(), 120)
    assert results[:3] == results[3:] and all(results)


def test_a_shared_prefix_comes_from_the_cache_and_changes_nothing(client, local):
    """Two chats that share their system turn: the second prefills only what follows it (the
    prefix cache keeps the first's KV), reports the cached tokens as OpenAI does, and answers
    exactly as a fresh conversation does."""
    system = {"role": "system", "content": "You answer in one short sentence about geography and nothing else."}
    first = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                           messages=[system, {"role": "user", "content": "Capital of Peru?"}])
    second = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                            messages=[system, {"role": "user", "content": "Capital of Chile?"}])
    want = local.chat([system, {"role": "user", "content": "Capital of Chile?"}], max_tokens=4, temperature=0,
                      context=512)
    assert second.choices[0].message.content == want["choices"][0]["message"]["content"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 10 < cached < second.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and first.usage.prompt_tokens > cached
