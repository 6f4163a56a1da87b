"""``Model.chat``'s OpenAI surface over a scripted session (no GPU; tests/test_conversation.py's
ScriptedGpu with SmolLM2's tokenizer and template): the completion dict, streamed chunks that add
up to it, tool_choice "none", the checks of tool_choice / response_format / the sampling extras,
and the logprobs hook. Constrained replies run on the GPU: tests/gpu/test_chat_completion.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from needle_wgpu.api import Model
from needle_wgpu.openai import (ContentStream, openai_logprobs, reply_shape, sampling_options,
                                         turn_logprobs)
from needle_wgpu.chat.dense import DenseChat
from needle_wgpu.errors import InputError, UnsupportedModelError
from test_conversation import ScriptedGpu

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(chunks: list) -> tuple:
    """(content, tool calls, finish reason, usage) as a client assembles them from chunks."""
    content, calls, finish, usage = "", [], None, None
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == chunks[0]["id"]
        if not chunk["choices"]:
            usage = chunk["usage"]
            continue
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        calls += delta.get("tool_calls", [])
        finish = chunk["choices"][0]["finish_reason"] or finish
    return content, calls, finish, usage


def test_a_completion_is_shaped_as_openai_returns_it():
    answer = Model(ScriptedGpu(["Sunny."])).chat(QUESTION)
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert isinstance(answer["created"], int) and answer["model"] == "needle-wgpu-scriptedgpu"
    assert answer["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Sunny."},
                                  "finish_reason": "stop", "logprobs": None}]
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["completion_tokens"] == 3
    assert answer["stats"]["prompt_tokens"] == usage["prompt_tokens"]


@pytest.mark.parametrize("reply,options", [
    ("Hello there, friend.", {}),
    ("Hello there, friend.", {"stop": ["there"]}),  # the stop text never shows in a delta
    ("Hello there, friend.", {"stop": [", fr"], "max_tokens": 4}),
    ("  Spaces first, and last.  ", {}),
    ("  " + CALL, {}),  # a reply with calls is stripped: the leading spaces never show
    (CALL + "\n" + CALL, {}),
    ("Sure. " + CALL + " Done.", {}),  # the text after the block comes once the reply ends
])
def test_stream_chunks_add_up_to_the_completion(reply, options):
    gpu = ScriptedGpu([reply, reply])
    model = Model(gpu)
    whole = model.chat(QUESTION, TOOLS, **options)
    chunks = list(model.chat(QUESTION, TOOLS, stream=True, **options))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content, calls, finish, usage = streamed(chunks)
    message = whole["choices"][0]["message"]
    assert content == (message["content"] or "") and finish == whole["choices"][0]["finish_reason"]
    assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert usage == whole["usage"] and chunks[-1]["choices"] == [] and "stats" in chunks[-1]
    assert chunks[-2]["choices"][0]["delta"] == {} and all(s.closed for s in gpu.sessions)


def test_a_stream_closed_early_releases_the_session():
    gpu = ScriptedGpu(["one two three four five"])
    stream = Model(gpu).chat(QUESTION, stream=True)
    next(stream), next(stream)
    stream.close()
    assert gpu.sessions[0].closed


def test_content_stream_holds_back_what_may_still_change():
    shown = ContentStream()
    assert [shown.push(p) for p in (" ", " a", "b ")] == ["", "  a", "b"]
    assert shown.finish("  ab ") == " "
    trailing = ContentStream()
    assert [trailing.push(p) for p in ("Hi ", "there  ")] == ["Hi", " there"]
    assert trailing.finish("Hi there  ") == "  "


def test_tool_choice_none_renders_no_tools_and_parses_no_calls():
    gpu = ScriptedGpu([CALL, "plain"])
    model = Model(gpu)
    answer = model.chat(QUESTION, TOOLS, tool_choice="none")
    plain = model.chat(QUESTION)
    assert answer["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]  # the tools are not shown
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert answer["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("options,problem", [
    ({"tool_choice": "always"}, "tool_choice must be one of"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "'get_time'.*not among the tools"),
    ({"tool_choice": {"type": "function"}}, "named function"),
    ({"tool_choice": 3}, "named function"),
    ({"response_format": {"type": "xml"}}, "response_format must be"),
    ({"response_format": {"type": "json_schema"}}, "json_schema needs"),
    ({"response_format": "json"}, "response_format must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "a+"}}}},
     "unsupported keywords"),  # GrammarError, an InputError
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"bogus": 1}, "unknown keyword"),
])
def test_bad_requests_are_input_errors_before_anything_runs(options, problem):
    gpu = ScriptedGpu(["fine"])
    model = Model(gpu)
    with pytest.raises(InputError, match=problem):
        model.chat(QUESTION, TOOLS, stream=options.pop("stream", True), **options)  # eager, even streamed
    assert gpu.prefills == []
    assert model.chat(QUESTION)["choices"][0]["message"]["content"] == "fine"


def test_required_needs_tools_and_a_template_whose_calls_can_be_constrained():
    with pytest.raises(InputError, match="needs tools"):
        Model(ScriptedGpu()).chat(QUESTION, tool_choice="required")
    gpu = ScriptedGpu()
    gpu.chat = DenseChat(gpu.tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}")
    model = Model(gpu)
    assert gpu.chat.template.tool_call_format is None  # shows tools its own way, names no <tool_call>
    with pytest.raises(UnsupportedModelError, match="format"):
        model.chat(QUESTION, TOOLS, tool_choice="required")
    shape = reply_shape(model, TOOLS, "auto", {"type": "json_object"})  # auto + JSON: the document only
    assert shape.grammar == {"schema": None, "json_object": True} and not shape.bare_json_calls


def test_reply_shapes():
    model = Model(ScriptedGpu())
    assert model.chat_format.template.tool_call_format == "tagged"  # SmolLM2: tools go Qwen-style in the system turn
    free = reply_shape(model, TOOLS, "auto", None)
    assert free.grammar is None and free.render_tools == TOOLS and free.bare_json_calls
    named = reply_shape(model, TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.grammar == {"tools": TOOLS, "names": ["get_weather"], "max_calls": 1}
    both = reply_shape(model, TOOLS, "auto", {"type": "json_schema", "json_schema": {"name": "w", "schema": {}}})
    assert both.grammar == {"schema": {}, "json_object": False, "tools": TOOLS, "max_calls": 4}
    none = reply_shape(model, TOOLS, "none", {"type": "json_object"})
    assert none.render_tools is None and none.grammar == {"schema": None, "json_object": True}
    assert reply_shape(model, None, "auto", {"type": "text"}).grammar is None
    assert named.grammar_key.startswith("chat:") and named.grammar_key != both.grammar_key


def test_sampling_extras_are_forwarded_only_when_set():
    plain = {"max_tokens": 5, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0,
             "penalty_last_n": None, "logit_bias": None, "logprobs": False, "top_logprobs": 0}
    assert sampling_options(plain) == {"max_tokens": 5}
    for name, value in (("min_p", 0.1), ("logit_bias", {"5": -100}), ("logprobs", True), ("penalty_last_n", 32)):
        assert sampling_options({name: value}) == {name: value}


def test_the_logprobs_hook_becomes_openais_field():
    model = Model(ScriptedGpu())
    stats = SimpleNamespace(logprobs=[{"token": "Hi", "logprob": -0.25,
                                       "top_logprobs": [{"token": "Hi", "logprob": -0.25},
                                                        {"token": 9906, "logprob": -2.0}]}])
    entries = turn_logprobs(stats, {"content": "Hi"})
    assert turn_logprobs(SimpleNamespace(logprobs=None), {"logprobs": entries}) is entries
    assert turn_logprobs(SimpleNamespace(logprobs=None), {"content": ""}) is None
    field = openai_logprobs(model, entries)
    first = field["content"][0]
    assert first["token"] == "Hi" and first["logprob"] == -0.25 and first["bytes"] == [72, 105]
    assert first["top_logprobs"][1]["token"] == model.decode([9906]) and field["refusal"] is None
    assert json.dumps(field)


@pytest.mark.parametrize("content,problem", [
    (None, "cannot read"), ("{not json", "is not JSON"), ('{"type": "string", "format": "email"}', "unsupported keywords"),
    ('{"type": "integer", "minimum": 5, "maximum": 1}', "no integer"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_json_schema_files_that_cannot_serve_are_one_line_exit_2(tmp_path, capsys, monkeypatch, content,
                                                                    problem, command):
    from needle_wgpu import cli

    monkeypatch.setattr(cli, "_load", lambda path, progress, numerics="float": pytest.fail("the model was loaded"))
    schema = tmp_path / "schema.json"
    if content is not None:
        schema.write_text(content)
    argv = [command, "unused.gguf", "--json-schema", str(schema)] + (["--prompt", "x"] if command == "generate" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("needle-wgpu: --json-schema") and problem in err


def test_cli_generate_json_schema_needs_a_raw_prompt(tmp_path, capsys, monkeypatch):
    from needle_wgpu import cli

    monkeypatch.setattr(cli, "_load", lambda path, progress, numerics="float": pytest.fail("the model was loaded"))
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "boolean"}')
    for extra in ([], ["--prompt", "x", "--stop", "}"], ["--query", "q"]):
        assert cli.main(["generate", "unused.gguf", "--json-schema", str(schema)] + extra) == 2
        assert "--json-schema constrains a raw completion" in capsys.readouterr().err
