"""Tool calls in a model's answer -> OpenAI-style ``tool_calls`` (spec dense-gguf §5.5).

Qwen style: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
small models often answer a bare JSON object (or a list of them, or one in a ```json fence)
instead. Parsing never raises: what cannot be read stays in ``content`` and is listed in
``problems``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ..formats.stream_decoder import partial_tail
from ..grammar.tagged_calls import reply_grammar
from .tools import call_arguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@dataclass(frozen=True)
class ToolCallFormat:
    """How a chat format's model writes tool calls, and the grammars that constrain them: every
    surface (``Model.generate(tools=...)``, ``Agent``, ``Model.chat``) asks this one record.

    ``answer_grammar(tools)``: the nodes of an answer to a tool request that may also decline
    (Needle 3: ``[]``), so a tool request is constrained by default; None where an unconstrained
    answer may be free text (the request is then constrained only when asked: ``constrained=True``
    or ``tool_choice`` "required"). ``required_grammar(tools, names=None)``: the nodes of an
    answer of at least one call (to one of ``names`` when given). ``chat_replies``: whether
    ``Model.chat``'s reply grammar (a JSON document, calls, or either) writes calls this way."""

    name: str
    required_grammar: Callable
    answer_grammar: Callable | None = None
    chat_replies: bool = False


@dataclass
class ParsedReply:
    content: str
    tool_calls: list = field(default_factory=list)  # OpenAI: {"id", "type": "function", "function": {...}}
    problems: list = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def openai_call(name: str, arguments) -> dict:
    """One OpenAI tool call: ``arguments`` as a JSON string, as the API returns it."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _calls_of(value, problems: list, where: str) -> list | None:
    """A JSON value read as calls: an object with ``name`` (+ ``arguments`` or ``parameters``),
    or a list of them. None when it is not shaped like calls."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            problems.append(f"{where}: not a call object with a 'name'")
            return None
        arguments = call_arguments(item.get("arguments", item.get("parameters", {})))
        if isinstance(arguments, str):
            problems.append(f"{where}: arguments of {item['name']!r} are not JSON")
            return None
        if not isinstance(arguments, dict):
            problems.append(f"{where}: arguments of {item['name']!r} are not an object")
            return None
        calls.append(openai_call(item["name"], arguments))
    return calls


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_reply(text: str, bare_json: bool = True) -> ParsedReply:
    """Content and tool calls of one assistant answer. ``bare_json`` False: only
    ``<tool_call>`` blocks are calls (a JSON answer, e.g. under a response format, is content)."""
    text = str(text)
    problems: list = []
    if OPEN in text:
        content_parts, calls = [], []
        rest = text
        while OPEN in rest:
            before, _, after = rest.partition(OPEN)
            content_parts.append(before)
            body, closed, rest = after.partition(CLOSE)
            if not closed:
                problems.append("a <tool_call> block is not closed (the answer was cut off?)")
            value = _loads(body.strip())
            found = _calls_of(value, problems, "<tool_call>") if value is not None else None
            if value is None:
                problems.append("<tool_call>: the block is not valid JSON")
            if found is None:
                content_parts.append(OPEN + body + (CLOSE if closed else ""))
            else:
                calls += found
        content_parts.append(rest)
        return ParsedReply("".join(content_parts).strip(), calls, problems)
    if not bare_json:
        return ParsedReply(text, [], problems)
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    candidate = fenced.group(1) if fenced else stripped
    if candidate[:1] in "{[" and candidate:
        value = _loads(candidate)
        if value is not None:
            quiet: list = []  # JSON that is not a call is simply the answer
            found = _calls_of(value, quiet, "JSON answer")
            if found:
                return ParsedReply("", found, problems)
    return ParsedReply(text, [], problems)


class ToolCallHolder:
    """Streamed text with tool-call blocks held back: ``push`` returns what may be shown now
    (never the start of a possible ``<tool_call>``, nothing once one opens)."""

    def __init__(self):
        self.pending = ""
        self.inside = False

    def push(self, piece: str) -> str:
        if self.inside:
            return ""
        self.pending += piece
        at = self.pending.find(OPEN)
        if at >= 0:
            self.inside = True
            shown, self.pending = self.pending[:at], ""
            return shown
        keep = partial_tail(self.pending, (OPEN,))  # the tail that could begin the opening tag
        shown = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(shown):]
        return shown

    def finish(self) -> str:
        shown, self.pending = ("" if self.inside else self.pending), ""
        return shown


def _tagged_required(tools, names=None, max_calls: int = 4) -> list:
    return reply_grammar(tools=tools, names=names, max_calls=max_calls)


# Hermes/Qwen ``<tool_call>`` blocks (``grammar/tagged_calls.py``), parsed by ``parse_reply``.
TAGGED = ToolCallFormat("tagged", required_grammar=_tagged_required, chat_replies=True)
