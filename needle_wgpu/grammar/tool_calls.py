"""The grammar of a Needle 3 answer (spec §9): ``[<think>…</think>]<tool_call>[…]</tool_call>``,
each call ``{"name":…,"arguments":…}`` with the name one of the tools' and the arguments matching
that tool's ``parameters`` schema (schema.py's subset); ``[]`` (the model's refusal) is always
allowed. Then only EOS (or the end-of-turn token) may follow.
"""

from __future__ import annotations

import json

from ..chat.tools import tool_function, tools_json
from .automaton import Choice, FreeText, GrammarError, JsonArray, Sequence
from .schema import Limits, SchemaCompiler

THINK_START, THINK_END = b"<think>", b"</think>"
TOOL_CALL_START, TOOL_CALL_END = b"<tool_call>", b"</tool_call>"


def tool_definitions(tools) -> list:
    """(name, parameters schema) of each tool: ``{"name", "parameters"}`` or the OpenAI form
    ``{"type": "function", "function": {...}}``; parameters default to an empty object."""
    out = []
    for i, tool in enumerate(json.loads(tools_json(tools))):
        tool = tool_function(tool)
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise GrammarError(f"tools: tool {i} has no name")
        parameters = tool.get("parameters", {"type": "object", "properties": {}})
        out.append((tool["name"], parameters))
    return out


def call_objects(compiler: SchemaCompiler, tools, names=None) -> list:
    """One node per tool (only those in ``names`` when given): the object
    ``{"name": <its name>, "arguments": <its parameters>}``; a schema outside the subset is a
    ``GrammarError`` naming the tool."""
    calls = []
    for name, parameters in tool_definitions(tools):
        if names is not None and name not in names:
            continue
        try:
            calls.append(compiler.schema({"type": "object", "properties": {"name": {"const": name},
                                                                           "arguments": parameters},
                                          "required": ["name", "arguments"]}))
        except GrammarError as exc:
            raise GrammarError(f"tool {name!r}: {exc}") from None
    return calls


def tool_call_grammar(tools, limits: Limits = Limits(), think_bytes: int = 1024, max_calls: int = 8,
                      min_calls: int = 0) -> list:
    """The nodes of the answer grammar for ``tools`` (a JSON string or list, as the prompt takes).
    ``think_bytes`` bounds the reasoning (markers included), ``max_calls`` the calls;
    ``min_calls`` > 0 takes the refusal ``[]`` away (it needs at least one tool)."""
    compiler = SchemaCompiler(limits)
    root = compiler.reserve()
    calls = call_objects(compiler, tools)
    if calls:
        item = calls[0] if len(calls) == 1 else compiler.add(Choice(calls))
        array = compiler.add(JsonArray(item, min(min_calls, max_calls), max_calls))
    elif min_calls > 0:
        raise GrammarError("tools: a call is required but there are no tools")
    else:
        array = compiler.literal(b"[]")
    think = compiler.add(Sequence([compiler.literal(THINK_START),
                                   compiler.add(FreeText(THINK_END, max(think_bytes - len(THINK_START),
                                                                        len(THINK_END))))]))
    optional_think = compiler.add(Choice([think, compiler.literal(b"")]))
    compiler.nodes[root] = Sequence([optional_think, compiler.literal(TOOL_CALL_START), array,
                                     compiler.literal(TOOL_CALL_END)])
    return compiler.nodes
