"""The grammar of a dense model's constrained reply (``Model.chat``): Hermes/Qwen-style tool-call
blocks, a JSON document, or either.

A tool call is written as the templates that use this format show it and as
``chat.tool_calls.parse_reply`` reads it::

    <tool_call>\\n{"name":N,"arguments":A}\\n</tool_call>

with N one of the allowed tools' names and A matching that tool's ``parameters`` (compact JSON,
schema.py's subset); further calls follow, each after a newline. Then only EOS (or the
end-of-turn token) may follow.
"""

from __future__ import annotations

from .automaton import Choice, GrammarError, Sequence
from .schema import Limits, SchemaCompiler
from .tool_calls import call_objects

CALL_OPEN, CALL_CLOSE, CALL_SEPARATOR = b"<tool_call>\n", b"\n</tool_call>", b"\n"


def tagged_calls(compiler: SchemaCompiler, tools, names=None, max_calls: int = 4) -> int:
    """The node of 1 .. ``max_calls`` tool-call blocks, each calling one of ``tools`` (only
    those in ``names`` when given)."""
    calls = call_objects(compiler, tools, names)
    if not calls:
        raise GrammarError("no tool to call")
    call = calls[0] if len(calls) == 1 else compiler.add(Choice(calls))
    block = compiler.add(Sequence([compiler.literal(CALL_OPEN), call, compiler.literal(CALL_CLOSE)]))
    more = compiler.literal(b"")  # unrolled: the grammar stays finite
    for _ in range(max(max_calls, 1) - 1):
        more = compiler.add(Choice([compiler.add(Sequence([compiler.literal(CALL_SEPARATOR), block, more])),
                                    compiler.literal(b"")]))
    return compiler.add(Sequence([block, more]))


def reply_grammar(*, schema=None, json_object: bool = False, tools=None, names=None, max_calls: int = 4,
                  limits: Limits = Limits()) -> list:
    """The nodes of a reply that is a JSON document (``schema``: matching it; ``json_object``:
    any object), or tool calls (``tools``, restricted to ``names``), or either when both are
    given."""
    compiler = SchemaCompiler(limits)
    root = compiler.reserve()
    branches = []
    if schema is not None:
        branches.append(compiler.schema(schema))
    elif json_object:
        branches.append(compiler.any_object())
    if tools is not None:
        branches.append(tagged_calls(compiler, tools, names, max_calls))
    if not branches:
        raise GrammarError("a reply grammar needs a JSON format or tools")
    compiler.nodes[root] = Sequence([branches[0] if len(branches) == 1 else compiler.add(Choice(branches))])
    return compiler.nodes
