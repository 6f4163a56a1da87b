"""Tools and tool calls, the same for every family: one normaliser of the ``tools`` argument, one
decoder of a call's ``arguments``, and the parsed-completion record.

``tools`` arrives as a JSON string, one tool object, or a list (OpenAI's
``{"type": "function", "function": {...}}`` or the bare ``{"name", "parameters"}``);
``tools_json`` is its compact JSON (Needle 3's prompt shows exactly that, §9), and
``check_tools`` the list of tool objects the chat templates, the grammars and the agent read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import InputError
from ..inputs import checked
from ..request_limits import LIMITS, check_json, check_text_length


@dataclass
class Completion:
    """A parsed completion.

    ``tool_calls`` holds the calls that normalised to ``{"name": str, "arguments": dict}``;
    it is None when no calls could be read. ``abstained`` is True only when the model
    declined to call (Needle 3: exactly ``[]``). Everything unexpected is in ``problems``.
    """

    thinking: str | None
    tool_calls: list | None
    raw: str
    problems: list = field(default_factory=list)
    abstained: bool = False


def json_kind(value) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), f"a {type(value).__name__}")


@checked
def tools_json(tools) -> str:
    """Tools as compact JSON: ``separators=(",", ":")``, ``ensure_ascii=False``, key order kept.

    ``tools`` is a JSON string or a Python list (a single dict is wrapped in a list, since the
    model saw lists of tools in training). Pretty-printed JSON changes the model's decisions
    (§9), so a string is parsed and re-serialised; numbers come out as Python writes them
    (``1e5`` becomes ``100000.0``). Raises ``InputError`` for invalid JSON (with its position),
    a top level that is not a list or object, or a value outside ``request_limits.check_json``
    (a cycle, a set, NaN, nesting deeper than 64 levels, more than 1024 tools) naming the field.
    """
    if tools is None:
        return "[]"
    if isinstance(tools, (bytes, bytearray)):
        tools = bytes(check_text_length(tools, "tools")).decode("utf-8", "replace")
    if isinstance(tools, str):
        check_text_length(tools, "tools")
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise InputError(f"tools: invalid JSON at line {exc.lineno} column {exc.colno} "
                             f"(character {exc.pos}): {exc.msg}") from None
        except (RecursionError, ValueError) as exc:
            raise InputError(f"tools: JSON cannot be read ({type(exc).__name__})") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, (list, tuple)):
        raise InputError(f"tools: expected a JSON array of tool objects, got {json_kind(tools)}")
    if len(tools) > LIMITS.tools:
        raise InputError(f"tools: {len(tools)} tools, more than the limit of {LIMITS.tools}")
    check_json(tools, "tools")
    try:
        return json.dumps(list(tools), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InputError(f"tools: not serialisable as JSON ({exc})") from None


def check_tools(tools) -> list | None:
    """Tools as a list of tool objects (None for None), each a plain JSON value: normalised as
    ``tools_json`` reads them (a JSON string parsed, one object made a list)."""
    if tools is None:
        return None
    tools = json.loads(tools_json(tools))
    if not all(isinstance(t, dict) for t in tools):
        raise InputError("tools must be a list of tool objects")
    return tools


def tool_function(tool) -> dict:
    """The function object of a tool: OpenAI's ``{"type": "function", "function": {...}}`` or
    the bare form."""
    return tool["function"] if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool


def tool_name(tool) -> str | None:
    function = tool_function(tool)
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def call_arguments(arguments):
    """A call's ``arguments`` as a value: a JSON string decoded (OpenAI's wire form), anything
    else as it is; a string that is not JSON stays that string. Each reader decides what a
    value that is not an object means for it."""
    if isinstance(arguments, (bytes, bytearray)):
        arguments = bytes(arguments).decode("utf-8", "replace")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested past the interpreter's limit
            return arguments
    return arguments
