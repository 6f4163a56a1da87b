"""The limits every request is checked against, whichever surface it came through
(``Model.stream``/``generate``, ``Conversation``, ``Model.chat``, ``Agent``, the CLI): one place
that says how much a caller may pass, so that nothing a request holds can make the engine hang,
recurse without end or allocate beyond a bound (docs/api.md, "Limits").

The readers that apply them: ``inputs.as_text`` (every text), ``chat.tools.tools_json`` (tools),
``chat.template.check_messages`` (messages and their tool calls), ``openai.check_response_format``
(a JSON schema), ``inputs.stop_strings``; ``check_json`` is the one walk over a JSON value they
share. A value outside a limit is an ``InputError`` naming the field (``tools[0].function.
parameters.properties.n.maximum``). Grammar compilation has its own work bound on top
(``grammar.Limits``: nodes, schema depth, enum bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InputError


@dataclass(frozen=True)
class RequestLimits:
    text_chars: int = 1 << 24  # one text: a prompt, a message's content, a stop string, a JSON string
    message_chars: int = 1 << 26  # all of a request's messages together
    messages: int = 1 << 17
    tool_calls: int = 128  # on one assistant message
    tools: int = 1024
    json_depth: int = 64  # containers nested in one JSON value (tools, a call's arguments, a schema)
    json_values: int = 1 << 17  # values (containers, keys' values, items) in one JSON value
    json_number: float = 1e308  # the largest magnitude of a JSON number (a float can hold it)
    stop_strings: int = 64


LIMITS = RequestLimits()


def check_text_length(text, name: str):
    """``text`` (str or bytes), refused when longer than ``LIMITS.text_chars``."""
    if len(text) > LIMITS.text_chars:
        raise InputError(f"{name}: {len(text)} characters, more than the limit of {LIMITS.text_chars}")
    return text


def _path(name: str, entry) -> str:
    keys = []
    while entry is not None:
        entry, key = entry
        keys.append(key)
    shown = [f"[{k}]" if isinstance(k, int) else f".{k[:40]}" for k in reversed(keys)]
    inside = "".join(shown if len(shown) <= 12 else shown[:4] + ["..."] + shown[-6:])
    return f"{name}: at {inside}" if inside else name


def check_json(value, name: str):
    """Checks that ``value`` is a plain JSON value within the limits: dicts (keys text, numbers,
    booleans or None, as ``json.dumps`` writes them), lists and tuples, text, finite numbers of
    magnitude up to 1e308, booleans and None; at most ``json_depth`` containers deep (a cycle is
    refused as too deep) and ``json_values`` values. Walks without recursion; returns ``value``.
    Anything else is an ``InputError`` naming the field (``name`` and the path inside it)."""
    stack = [(value, 0, None)]  # (value, depth, where: (parent's where, key) or None)
    seen = 0
    while stack:
        item, depth, where = stack.pop()
        seen += 1
        if seen > LIMITS.json_values:
            raise InputError(f"{name}: more than {LIMITS.json_values} JSON values")
        if isinstance(item, str):
            if len(item) > LIMITS.text_chars:
                raise InputError(f"{_path(name, where)}: a string of {len(item)} characters, more than "
                                 f"the limit of {LIMITS.text_chars}")
        elif item is None or isinstance(item, bool):
            pass
        elif isinstance(item, (int, float)):
            if not _finite_json_number(item):
                raise InputError(f"{_path(name, where)}: a number JSON cannot hold (NaN, infinite, or beyond "
                                 f"±{LIMITS.json_number:g})")
        elif isinstance(item, (dict, list, tuple)):
            if depth >= LIMITS.json_depth:
                raise InputError(f"{_path(name, where)}: nested deeper than {LIMITS.json_depth} levels "
                                 "(or a cycle)")
            if isinstance(item, dict):
                for key in item:
                    if not (key is None or isinstance(key, (str, bool)) or isinstance(key, (int, float))
                            and _finite_json_number(key)):
                        raise InputError(f"{_path(name, where)}: an object key that is not text "
                                         f"({type(key).__name__})")
                    stack.append((item[key], depth + 1, (where, str(key))))
            else:
                stack.extend((child, depth + 1, (where, i)) for i, child in enumerate(item))
            if len(stack) > LIMITS.json_values:
                raise InputError(f"{name}: more than {LIMITS.json_values} JSON values")
        else:
            raise InputError(f"{_path(name, where)}: a {type(item).__name__} is not a JSON value")
    return value


def _finite_json_number(number) -> bool:
    if isinstance(number, float):
        return math.isfinite(number) and abs(number) <= LIMITS.json_number
    return -LIMITS.json_number <= number <= LIMITS.json_number  # an int of any size compares exactly
