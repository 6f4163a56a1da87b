"""``Model.chat`` under a grammar on small random synthetic models (the mask applied on the GPU
sampler): every ``response_format`` reply parses and validates, ``tool_choice`` "required" and a
named function give parsed calls with schema-valid arguments and finish "tool_calls", and the
streamed chunks add up to the same completion. One test on the real SmolLM2 file (slow)."""

from __future__ import annotations

import json

import jsonschema
import pytest

import needle_wgpu
from needle_wgpu.chat.template import ChatTemplate
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

pytestmark = pytest.mark.gpu

QUESTION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                             "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SETTINGS = [(0.0, 0), (0.8, 1), (1.5, 2), (3.0, 3)]  # (temperature, seed)


# A short template that names the <tool_call> format itself (the Qwen-style system text that a
# template without tools gets is ~800 ids in the byte vocabulary: slow to prefill on lavapipe).
COMPACT_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}"
                    "{{ t.function.parameters | tojson }}\n{% endfor %}Call: <tool_call>\n"
                    "{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
                    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model(tmp_path_factory, device):
    path = write_dense_gguf(tmp_path_factory.mktemp("chat") / "llama.gguf",
                            SynthDense(arch="llama", seed=5, context=1024), tokenizer="bytes")
    loaded = needle_wgpu.load(str(path), device=device)
    loaded.chat_format.template = ChatTemplate(COMPACT_TEMPLATE)
    assert loaded.chat_format.template.kind == "jinja" and loaded.chat_format.template.tool_call_format == "tagged"
    return loaded


def valid_calls(choice, names) -> list:
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
    return calls


def test_json_schema_replies_parse_and_validate(model):
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for temperature, seed in SETTINGS:
        answer = model.chat(QUESTION, response_format=response_format, max_tokens=80, temperature=temperature,
                            seed=seed, top_p=0.95, context=512)
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", answer["stats"]
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_json_object_replies_are_objects(model):
    for temperature, seed in SETTINGS:
        answer = model.chat(QUESTION, response_format={"type": "json_object"}, max_tokens=48,
                            temperature=temperature, seed=seed, context=512)
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict)


def test_required_and_named_tool_choices_give_valid_calls(model):
    for temperature, seed in SETTINGS[:3]:
        answer = model.chat(QUESTION, TOOLS, tool_choice="required", max_tokens=160, temperature=temperature,
                            seed=seed)
        assert 1 <= len(valid_calls(answer["choices"][0], PARAMETERS)) <= 4
        named = model.chat(QUESTION, TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                           max_tokens=120, temperature=temperature, seed=seed)
        assert len(valid_calls(named["choices"][0], ["add"])) == 1


def test_stop_strings_do_not_cut_a_constrained_reply(model):
    answer = model.chat(QUESTION, response_format={"type": "json_object"}, stop=["{", ":"], max_tokens=40,
                        temperature=1.0, seed=4, context=512)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict)
    assert any("stop strings are not applied" in n for n in answer["stats"]["notices"])


def test_a_budget_no_reply_fits_finishes_length_at_once(model):
    answer = model.chat(QUESTION, TOOLS, tool_choice="required", max_tokens=10)
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("options", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}},
     "max_tokens": 80, "temperature": 0.8, "seed": 1, "context": 512},
    {"tools": TOOLS, "tool_choice": "required", "max_tokens": 160, "temperature": 1.5, "seed": 2},
])
def test_stream_chunks_add_up_to_the_completion(model, options):
    whole = model.chat(QUESTION, **options)
    chunks = list(model.chat(QUESTION, stream=True, **options))
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    calls = [call for c in chunks if c["choices"] for call in c["choices"][0]["delta"].get("tool_calls", [])]
    message = whole["choices"][0]["message"]
    assert content == (message["content"] or "")
    assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls", [])]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_cli_generate_and_chat_with_a_json_schema(model, tmp_path, capsys, monkeypatch):
    from needle_wgpu import cli

    monkeypatch.setattr(cli, "_load", lambda path, progress, numerics="float": model)
    schema_file = tmp_path / "trip.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for temperature in ("0", "1.5"):
        assert cli.main(["generate", "unused.gguf", "--prompt", "Trip:", "--json-schema", str(schema_file),
                         "--max-tokens", "80", "--temperature", temperature, "--json", "--quiet"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["finish_reason"] == "eos"
        jsonschema.validate(json.loads(result["text"]), SCHEMA)
    assert cli.main(["chat", "unused.gguf", "--message", "Plan a trip.", "--message", "Another.", "--json-schema",
                     str(schema_file), "--max-tokens", "80", "--temperature", "1", "--context", "512", "--json",
                     "--quiet"]) == 0
    turns = json.loads(capsys.readouterr().out)["turns"]
    for turn in turns:
        assert turn["finish_reason"] == "eos"
        jsonschema.validate(json.loads(turn["message"]["content"]), SCHEMA)


@pytest.mark.slow
def test_smollm2_json_schema_reply_is_valid_json(smollm2):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"]}
    answer = smollm2.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
                          response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
                          max_tokens=24, context=256)
    assert answer["choices"][0]["finish_reason"] == "stop"
    reply = json.loads(answer["choices"][0]["message"]["content"])
    jsonschema.validate(reply, schema)
    assert "Paris" in reply["capital"]



def test_sampling_extras_and_logprobs_reach_the_gpu_through_chat(model):
    """chat's penalties, bias and logprobs are the session's: the same ids and logprobs as
    ``generate`` over the rendered prompt, and OpenAI's logprobs field per completion token."""
    ids = model.chat_format.render_ids(model.tokenizer, QUESTION)
    options = dict(max_tokens=10, temperature=0.0, repetition_penalty=1.8, presence_penalty=0.5,
                   penalty_last_n=-1, logit_bias={"120": 3.5})
    plain = model.generate(ids=ids, **options, logprobs=True, top_logprobs=2)
    answer = model.chat(QUESTION, **options, logprobs=True, top_logprobs=2)
    choice = answer["choices"][0]
    assert choice["message"]["content"] == plain.text and answer["usage"]["completion_tokens"] == len(plain.ids)
    content = choice["logprobs"]["content"]
    assert len(content) == len(plain.ids) == len(plain.logprobs)
    for entry, ours, token in zip(content, plain.logprobs, plain.ids):
        assert entry["logprob"] == ours["logprob"] and ours["token"] == token
        assert bytes(entry["bytes"]) == model.tokenizer.token_bytes(token)
        assert [t["logprob"] for t in entry["top_logprobs"]] == [t["logprob"] for t in ours["top_logprobs"]]
    unpenalised = model.chat(QUESTION, max_tokens=10)
    assert unpenalised["choices"][0]["logprobs"] is None
    assert unpenalised["choices"][0]["message"]["content"] != plain.text  # the options changed the reply
