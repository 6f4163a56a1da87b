"""The request-validation layer (``needle_wgpu.request_limits``, docs/api.md "Limits"): whichever
surface a request comes through (``Model.chat``, ``Conversation.send``, ``generate(query=,
tools=)``), a value outside the limits or not JSON is one ``InputError`` naming the field, and
the engine serves the next request. A bounded property fuzzer sends hostile chat requests
through ``Model.chat`` on a scripted model."""

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from needle_wgpu.api import Model
from needle_wgpu.errors import InputError, NeedleError
from needle_wgpu.request_limits import LIMITS, check_json
from test_contract import engine
from test_conversation import ScriptedGpu, ScriptedSession


class MaskedSession(ScriptedSession):
    """Takes the grammar's mask: samples EOS where it is allowed, else the lowest allowed id."""

    def prefill(self, ids, sampling=None, should_stop=None, mask=None):
        if mask is None:
            return super().prefill(ids, sampling, should_stop)
        assert self.position + len(ids) <= self.context
        self.position += len(ids)
        return self._pick(mask)

    def step(self, sampling, mask=None):
        if mask is None:
            return super().step(sampling)
        self.position += 1
        return self._pick(mask)

    def _pick(self, mask):
        eos = self.gpu.tokenizer.eos_id
        if mask[eos // 8] >> (eos % 8) & 1:
            return eos
        at = next(i for i, byte in enumerate(mask) if byte)
        return at * 8 + (mask[at] & -mask[at]).bit_length() - 1


class MaskedGpu(ScriptedGpu):
    def session(self, context=None, kv="f32"):
        self.sessions.append(MaskedSession(self, context))
        return self.sessions[-1]


def _cycle():
    value = {"type": "object"}
    value["properties"] = {"self": value}
    return value


def _deep(levels: int):
    value = {}
    for _ in range(levels):
        value = {"a": value}
    return value


HOSTILE_VALUES = {
    "a cycle": _cycle(),
    "a set": {"type": "object", "enum": {1, 2}},
    "10,000 levels": _deep(10_000),
    "NaN": {"type": "number", "maximum": float("nan")},
    "10**400": {"type": "integer", "maximum": 10 ** 400},
    "10**5000": {"type": "integer", "maximum": 10 ** 5000},
    "bytes": {"type": b"object"},
    "an object key": {("a",): 1},
    "too many values": {"enum": list(range(LIMITS.json_values + 1))},
}


def _tool(parameters):
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _call_message(arguments):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


@pytest.fixture(scope="module")
def chat_model():
    return Model(MaskedGpu(["ok"] * 1000))


@pytest.mark.parametrize("kind", list(HOSTILE_VALUES))
def test_hostile_tool_parameters_are_input_errors_on_every_surface(kind, chat_model):
    value = HOSTILE_VALUES[kind]
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(InputError, match=r"^tools: "):
        chat_model.chat(user, tools=_tool(value), max_tokens=2)
    with pytest.raises(InputError, match=r"^tools: "):
        chat_model.conversation(tools=_tool(value))
    with pytest.raises(InputError, match=r"^tools: "):
        engine().generate(query="hi", tools=_tool(value))
    with pytest.raises(InputError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        chat_model.chat(user + [_call_message(value), {"role": "tool", "content": "1"}], max_tokens=2)
    conversation = chat_model.conversation()
    with pytest.raises(InputError, match=r"^messages\[0\]\.tool_calls\[0\]"):
        conversation.add([_call_message(value)])
    with pytest.raises(InputError, match=r"^response_format\.json_schema\.schema"):
        chat_model.chat(user, response_format={"type": "json_schema", "json_schema": {"schema": value}})
    assert chat_model.chat(user, max_tokens=2)["choices"][0]["message"]["content"] == "ok"


@pytest.mark.parametrize("schema", [
    {"type": "number", "maximum": 1e300},
    {"type": "array", "items": {"type": ["array", "array"], "items": {"type": ["array", "array"]}}},
    {"enum": ["x" * 100_000]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": [{}]},
])
def test_hostile_response_formats_end_fast_in_a_reply_or_a_grammar_error(schema, chat_model):
    started = time.perf_counter()
    try:
        reply = chat_model.chat([{"role": "user", "content": "hi"}], max_tokens=4,
                                response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    except InputError:
        pass
    assert time.perf_counter() - started < 10.0


def test_a_needle3_tool_schema_with_a_huge_integer_bound_is_an_input_error():
    tools = _tool({"type": "object", "properties": {"n": {"type": "integer", "maximum": 10 ** 400}}})
    with pytest.raises(InputError, match=r"tools: at \[0\]\.function\.parameters\.properties\.n\.maximum"):
        engine().generate(query="hi", tools=tools, constrained=True)


def test_texts_messages_and_stop_strings_are_bounded(chat_model, monkeypatch):
    import needle_wgpu.request_limits as limits

    monkeypatch.setattr(limits, "LIMITS", limits.RequestLimits(text_chars=100, messages=3, stop_strings=2,
                                                              message_chars=150, tools=1, tool_calls=1))
    for module in ("needle_wgpu.inputs", "needle_wgpu.chat.tools", "needle_wgpu.chat.template"):
        monkeypatch.setattr(f"{module}.LIMITS", limits.LIMITS)
    user = {"role": "user", "content": "hi"}
    cases = [
        (dict(messages=[{"role": "user", "content": "x" * 101}]), r"messages\[0\]\.content: 101 characters"),
        (dict(messages=[user] * 4), "more than 3 messages"),
        (dict(messages=[{"role": "user", "content": "x" * 80}] * 2), "more than 150 characters"),
        (dict(messages=[user], stop=["a", "b", "c"]), "more than 2 stop strings"),
        (dict(messages=[user], tools=[{"name": "f"}, {"name": "g"}]), "2 tools, more than the limit of 1"),
        (dict(messages=[user, dict(_call_message({}), tool_calls=[{"function": {"name": "f"}}] * 2), user]),
         "more than 1 calls"),
    ]
    for request, problem in cases:
        with pytest.raises(InputError, match=problem):
            chat_model.chat(**request)
    with pytest.raises(InputError, match="prompt: 101 characters"):
        engine().generate("y" * 101)


def test_check_json_walks_without_recursion_and_names_the_path():
    assert check_json({"a": [1, 2.5, "x", None, True, {"k": ()}]}, "v")
    with pytest.raises(InputError, match=r"^v: at \.a\[2\]: a set is not a JSON value"):
        check_json({"a": [1, 2, {3}]}, "v")
    with pytest.raises(InputError, match="nested deeper than 64"):
        check_json(_deep(100_000), "v")


# ------------------------------------------------------------------------------ the fuzzer

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10 ** 400), max_value=10 ** 400),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                       st.sampled_from([b"x", {1}, object(), 1j]))
_json = st.recursive(_json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=20)
_schema = st.recursive(
    st.fixed_dictionaries({}, optional={
        "type": st.one_of(st.sampled_from(["object", "array", "string", "number", "integer", "boolean", "null",
                                           "nope"]), st.lists(st.sampled_from(["array", "number", "string"]),
                                                              max_size=4)),
        "minimum": st.one_of(st.integers(), st.floats(), st.just(10 ** 400)),
        "maximum": st.one_of(st.integers(), st.floats(), st.just(-(10 ** 400))),
        "minLength": st.one_of(st.integers(-2, 10 ** 12), st.floats()), "maxItems": st.integers(-1, 10 ** 9),
        "enum": st.lists(_json, max_size=3), "required": st.lists(_json, max_size=2)}),
    lambda inner: st.one_of(st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
                            st.fixed_dictionaries({"type": st.just("object"),
                                                   "properties": st.dictionaries(st.text(max_size=5), inner,
                                                                                 max_size=3)}),
                            st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)})),
    max_leaves=8)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot", None])},
                                 optional={"content": st.one_of(st.text(max_size=40), st.none(), st.integers(),
                                                                st.binary(max_size=10)),
                                           "tool_calls": st.one_of(st.lists(st.fixed_dictionaries(
                                               {"function": st.fixed_dictionaries(
                                                   {"name": st.one_of(st.text(max_size=5), st.integers())},
                                                   optional={"arguments": st.one_of(_json, st.text(max_size=30))})}),
                                               max_size=2), _json),
                                           "name": _json})
_tools = st.one_of(st.none(), st.text(max_size=30), _json,
                   st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                       {"name": st.one_of(st.sampled_from(["f", "g"]), _json)},
                       optional={"parameters": st.one_of(_schema, _json)})}), max_size=3))
_tool_choice = st.one_of(st.sampled_from(["none", "auto", "required", "any", None]), _json,
                         st.fixed_dictionaries({"type": st.just("function"),
                                                "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})}))
_response_format = st.one_of(st.none(), _json, st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                             st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                                       st.one_of(_schema, _json)))


@settings(max_examples=int(__import__("os").environ.get("NEEDLE_FUZZ_EXAMPLES", 120)), deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(_message, max_size=4), tools=_tools, tool_choice=_tool_choice,
       response_format=_response_format, logit_bias=_json, stop=st.one_of(_json, st.text(max_size=5)))
def test_fuzz_chat_requests_end_in_a_reply_or_a_needle_error(chat_model, messages, tools, tool_choice,
                                                            response_format, logit_bias, stop):
    started = time.perf_counter()
    try:
        reply = chat_model.chat(messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                                logit_bias=logit_bias, stop=stop, max_tokens=3)
        assert reply["object"] == "chat.completion"
        json.dumps(reply["choices"])
    except NeedleError:
        pass
    assert time.perf_counter() - started < 10.0
