"""The reply grammars of ``Model.chat`` (needle_wgpu/grammar/tagged_calls.py, schema.py's generic
JSON value): any JSON object, maps, and Hermes/Qwen ``<tool_call>`` blocks. Random vocabularies
and random-logit models run through the reference sampler with the mask and a token budget:
every output parses (json.loads, ``parse_reply``) and validates (jsonschema)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from needle_wgpu.chat.tool_calls import parse_reply
from needle_wgpu.grammar import Automaton, Constraint, GrammarError, Limits, compile_json_object, compile_schema
from needle_wgpu.grammar.tagged_calls import reply_grammar
from needle_wgpu.reference.sampling import sample
from test_grammar import SETTINGS, RandomModel, random_schema, random_vocabulary, text_of

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}},
         {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                         "b": {"type": "number", "minimum": 0}},
                                        "required": ["a", "b"], "additionalProperties": False}},
         {"name": "ping"}]
PARAMETERS = {"get_weather": TOOLS[0]["function"]["parameters"], "add": TOOLS[1]["parameters"],
              "ping": {"type": "object", "properties": {}}}


def decode_within(constraint, model, budget, temperature, top_k, top_p, seed) -> bytes:
    """Ids sampled under the constraint's masks with ``budget`` ids in all (EOS included);
    the text must have ended (EOS) within it."""
    matcher, ids = constraint.matcher(), []
    for position in range(1, budget + 1):
        left = budget - position + 1
        assert matcher.fits(left) and matcher.allowed_ids(left), "an empty mask"
        token = sample(model.logits(ids), temperature, top_k, top_p, seed, position, mask=matcher.mask(left))
        matcher.accept(token)
        if token == 0:
            break
        ids.append(token)
    assert matcher.ended, text_of(constraint.vocabulary, ids)
    return text_of(constraint.vocabulary, ids)


def test_any_json_object():
    a = Automaton(compile_json_object())
    for text in (b"{}", b'{"a":1}', b'{"a":{"b":[1,"x",null,-2.5]},"c":true,"a":false}', b'{"":""}'):
        assert a.matches(text), text
    for text in (b"[]", b"1", b'"x"', b'{"a":}', b'{"a":1,}', b"{a:1}", b'{"a":1 }', b"{", b'{"a":{"b":{"c":{}}}}'):
        assert not a.matches(text), text  # the last: nested past Limits.depth (3)
    assert Automaton(compile_json_object(Limits(depth=4))).matches(b'{"a":{"b":{"c":{}}}}')


def test_objects_without_properties_but_with_additional_properties_are_maps():
    ints = Automaton(compile_schema({"type": "object", "additionalProperties": {"type": "integer"}}))
    assert ints.matches(b'{"x":3,"y":-4}') and ints.matches(b"{}")
    assert not ints.matches(b'{"x":"3"}') and not ints.matches(b'{"x":1.5}')
    anything = Automaton(compile_schema({"type": "object", "additionalProperties": True}))
    assert anything.matches(b'{"x":[1,{"y":null}]}')
    closed = Automaton(compile_schema({"type": "object"}))  # additionalProperties absent: declared ones only
    assert closed.matches(b"{}") and not closed.matches(b'{"x":1}')


def test_random_json_objects_always_parse():
    rng = random.Random(7)
    vocabularies = [random_vocabulary(rng) for _ in range(4)]
    for trial in range(60):
        vocabulary = vocabularies[trial % len(vocabularies)]
        constraint = Constraint(Automaton(compile_json_object(Limits(string=24, items=4))), vocabulary)
        temperature, top_k, top_p = SETTINGS[trial % len(SETTINGS)]
        budget = 2 + rng.randint(1, 60)
        text = decode_within(constraint, RandomModel(trial, vocabulary.rows), budget, temperature, top_k, top_p, trial)
        assert isinstance(json.loads(text.decode("utf-8")), dict)


def check_calls(text: bytes, names, max_calls: int) -> list:
    reply = parse_reply(text.decode("utf-8"), bare_json=False)
    assert not reply.problems and reply.content == "" and 1 <= len(reply.tool_calls) <= max_calls, text
    for call in reply.tool_calls:
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])
    return [c["function"]["name"] for c in reply.tool_calls]


@pytest.mark.parametrize("names,max_calls", [(None, 4), (["add"], 1)])
def test_random_tool_call_replies_parse_and_validate(names, max_calls):
    rng = random.Random(11)
    vocabulary = random_vocabulary(rng)
    constraint = Constraint(Automaton(reply_grammar(tools=TOOLS, names=names, max_calls=max_calls)), vocabulary)
    allowed = names or list(PARAMETERS)
    seen = set()
    for trial in range(30):
        temperature, top_k, top_p = SETTINGS[trial % len(SETTINGS)]
        budget = constraint.automaton.finish(constraint.automaton.initial) + 1 + rng.randint(0, 150)
        text = decode_within(constraint, RandomModel(trial, vocabulary.rows), budget, temperature, top_k, top_p, trial)
        seen.update(check_calls(text, allowed, max_calls))
    assert seen == set(allowed)  # every tool was called somewhere: the choice is the model's


def test_json_or_calls_and_random_schemas():
    rng = random.Random(3)
    vocabulary = random_vocabulary(rng)
    kinds = set()
    for trial in range(40):
        schema = random_schema(rng)
        constraint = Constraint(Automaton(reply_grammar(schema=schema, tools=TOOLS, max_calls=2)), vocabulary)
        budget = constraint.automaton.finish(constraint.automaton.initial) + 1 + rng.randint(0, 120)
        text = decode_within(constraint, RandomModel(trial, vocabulary.rows), budget, 1.0, 0, 1.0, trial)
        if text.startswith(b"<tool_call>"):
            check_calls(text, list(PARAMETERS), 2)
            kinds.add("calls")
        else:
            jsonschema.Draft7Validator(schema).validate(json.loads(text.decode("utf-8")))
            kinds.add("json")
    assert kinds == {"calls", "json"}


def test_reply_grammars_refuse_what_they_cannot_build():
    with pytest.raises(GrammarError, match="no tool to call"):
        reply_grammar(tools=TOOLS, names=["missing"])
    with pytest.raises(GrammarError, match="'bad'"):
        reply_grammar(tools=[{"name": "bad", "parameters": {"type": "string", "pattern": "x+"}}])
    with pytest.raises(GrammarError):
        reply_grammar()
    with pytest.raises(GrammarError):
        reply_grammar(schema={"type": "object", "properties": {}, "$ref": "#/x"})
