"""Prompt builder, tools JSON compaction and the completion parser (§9)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needle_wgpu.errors import InputError
from needle_wgpu.formats.needle3_tokenizer import synthetic_tokenizer
from needle_wgpu.chat.needle3 import (Completion, build_prompt, compact_tools_json, parse_completion,
                                prompt_ids)

WEATHER_TOOL = {"name": "get_weather", "description": "Current weather",
                "parameters": {"city": {"type": "string", "description": "Ville é"}}}
WEATHER_COMPACT = ('[{"name":"get_weather","description":"Current weather","parameters":'
                   '{"city":{"type":"string","description":"Ville é"}}}]')


# ----------------------------------------------------------------------------- prompt


def test_prompt_exact_text():
    assert build_prompt("hi", []) == (
        "<|im_start|>user\n<tools>[]</tools>\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_with_tools_and_system():
    assert build_prompt("Weather in Paris?", [WEATHER_TOOL], system="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n<tools>{WEATHER_COMPACT}</tools>\n"
        "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("system", [None, "", "  \n "])
def test_empty_system_is_left_out(system):
    assert build_prompt("q", None, system=system) == build_prompt("q", [])
    assert "system" not in build_prompt("q", None, system=system)


def test_prompt_ids_are_bos_then_the_encoded_prompt():
    tok = synthetic_tokenizer(512, add_dummy_prefix=False)
    ids = prompt_ids(tok, "hi", "[]")
    assert ids[0] == tok.bos_id
    assert ids[1:] == tok.encode(build_prompt("hi", []))
    markers = [i for i in ids if 4 <= i < 28]
    assert markers == [tok.im_start_id, tok.tools_start_id, tok.tools_end_id, tok.im_end_id,
                       tok.im_start_id]
    assert tok.decode(ids) == build_prompt("hi", [])


# ----------------------------------------------------------------------------- tools JSON


def test_compact_from_python_objects_keeps_order_and_unicode():
    assert compact_tools_json([WEATHER_TOOL]) == WEATHER_COMPACT


def test_compact_from_a_pretty_printed_string():
    pretty = json.dumps([WEATHER_TOOL], indent=2)  # also escapes 'é' as \u00e9
    assert "\n" in pretty and "\\u00e9" in pretty
    assert compact_tools_json(pretty) == WEATHER_COMPACT


def test_compact_is_idempotent():
    assert compact_tools_json(WEATHER_COMPACT) == WEATHER_COMPACT


def test_compact_keeps_spaces_inside_strings():
    assert compact_tools_json('[ {"name" : "a b ,c : d"} ]') == '[{"name":"a b ,c : d"}]'


def test_a_single_tool_object_is_wrapped_in_a_list():
    assert compact_tools_json(WEATHER_TOOL) == WEATHER_COMPACT
    assert compact_tools_json(json.dumps(WEATHER_TOOL)) == WEATHER_COMPACT


def test_no_tools_is_an_empty_list():
    assert compact_tools_json(None) == "[]"
    assert compact_tools_json([]) == "[]"


def test_invalid_tools_json_reports_its_position():
    with pytest.raises(InputError, match=r"line 2 column 12"):
        compact_tools_json('[\n  {"name": }\n]')


@pytest.mark.parametrize("tools", ['"a string"', "42", "null", "true", 42, 3.5, "", "[1, 2",
                                   "{'single': 'quotes'}", "[NaN]", [float("nan")], [{1, 2}],
                                   "[" * 100_000])
def test_bad_tools_raise_input_error(tools):
    with pytest.raises(InputError, match=r"^tools: "):
        compact_tools_json(tools)


# ----------------------------------------------------------------------------- completions


def test_parse_full_completion():
    text = ('<think>\nThe user wants the weather in Paris.\n</think>\n<tool_call>[{"name":'
            '"get_weather","arguments":{"city":"Paris"}}]</tool_call><|im_end|>')
    c = parse_completion(text)
    assert c == Completion(thinking="The user wants the weather in Paris.",
                           tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}],
                           raw=text, problems=[], abstained=False)


def test_parse_abstention():
    c = parse_completion("<think>\nNo tool fits.\n</think>\n<tool_call>[]</tool_call>")
    assert c.abstained and c.tool_calls == [] and c.problems == []
    assert c.thinking == "No tool fits."


def test_parse_without_thinking_and_with_several_calls():
    c = parse_completion('<tool_call>[{"name":"a","arguments":{}},'
                         '{"name":"b","arguments":{"x":[1,2]}}]</tool_call></s>')
    assert c.thinking is None and c.problems == [] and not c.abstained
    assert c.tool_calls == [{"name": "a", "arguments": {}},
                            {"name": "b", "arguments": {"x": [1, 2]}}]


def test_arguments_given_as_a_json_string_are_decoded():
    c = parse_completion('<tool_call>[{"name":"a","arguments":"{\\"k\\": 1}"}]</tool_call>')
    assert c.tool_calls == [{"name": "a", "arguments": {"k": 1}}]
    assert len(c.problems) == 1 and "JSON string" in c.problems[0]


def test_invalid_calls_are_dropped_and_reported():
    c = parse_completion('<tool_call>[{"name":"ok","arguments":{}}, 7, {"arguments":{}},'
                         '{"name":"bad","arguments":[1]}]</tool_call>')
    assert c.tool_calls == [{"name": "ok", "arguments": {}}]
    assert not c.abstained
    assert [p.split(" ")[1] for p in c.problems] == ["1", "2", "3"]


GARBAGE = {
    "empty": ("", None),
    "plain text": ("I cannot help with that.", None),
    "unterminated think": ("<think>\nthinking forever", None),
    "unterminated tool_call": ('<think>x</think><tool_call>[{"name":"a","argu', None),
    "invalid JSON": ("<tool_call>[{name: a}]</tool_call>", None),
    "JSON string": ('<tool_call>"get_weather"</tool_call>', None),
    "JSON number": ("<tool_call>42</tool_call>", None),
    "JSON null": ("<tool_call>null</tool_call>", None),
    "list of junk": ("<tool_call>[1, \"a\", null, []]</tool_call>", []),
    "deep nesting": ("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>", None),
    "huge integer": ("<tool_call>[" + "9" * 10_000 + "]</tool_call>", None),
    "close tags only": ("</think></tool_call></think>", None),
    "tags reversed": ("</tool_call>[]<tool_call>", None),
    "nested tool_call": ("<tool_call><tool_call>[]</tool_call></tool_call>", None),
    "markers inside JSON": ('<tool_call>[{"name":"<think>","arguments":</tool_call>', None),
    "control characters": ("\x00\x01<tool_call>\x00[]\x00</tool_call>", None),
    "lone surrogate": ("<think>\ud800</think><tool_call>[\"\ud800\"]</tool_call>", []),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_completions_never_raise_and_report_problems(name):
    text, expected_calls = GARBAGE[name]
    c = parse_completion(text)
    assert isinstance(c, Completion) and c.raw == text
    assert c.tool_calls == expected_calls
    assert c.problems, "garbage must be reported"
    assert not c.abstained


@pytest.mark.parametrize("value", [None, 17, b"<tool_call>[]</tool_call>", ["<tool_call>"]])
def test_non_text_input_never_raises(value):
    c = parse_completion(value)
    assert isinstance(c, Completion)
    if isinstance(value, bytes):
        assert c.abstained and c.raw == "<tool_call>[]</tool_call>"
    else:
        assert c.problems and c.tool_calls is None


completion_soup = st.lists(
    st.one_of(st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>",
                               "</s>", "[", "]", "{", "}", '"name"', '"arguments"', ":", ",",
                               '"a"', "1", "null", "\n", " ", "\\", '"']),
              st.text(max_size=4)),
    max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=completion_soup)
def test_property_parser_never_raises(text):
    c = parse_completion(text)
    assert c.raw == text
    for call in c.tool_calls or []:
        assert isinstance(call["name"], str) and isinstance(call["arguments"], dict)
    if c.abstained:
        assert c.tool_calls == []
    if c.tool_calls is None:
        assert c.problems
