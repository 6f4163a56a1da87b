"""Chat templates: a model's own ``tokenizer.chat_template`` rendered as Hugging Face renders it,
or the built-in ChatML when the file has none (spec dense-gguf §5.5).

The Jinja environment follows transformers' ``chat_template_utils``: sandboxed and immutable,
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
block that renders its body, the globals ``raise_exception`` and ``strftime_now``, and a
``tojson`` that keeps key order and writes non-ASCII as it is (jinja2's own sorts keys and
escapes ``<``, which changes a tool prompt). The template gets ``messages``, ``tools``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``.

jinja2 and MarkupSafe are pure-Python wheels (runtime dependencies on the desktop, bundled for
the browser). Where jinja2 cannot be imported, or the template fails to compile or to render,
the built-in ChatML renders instead and ``ChatTemplate.note`` says why. A file's template is
untrusted: it runs sandboxed and bounded in work and size (``template_sandbox.py``).
"""

from __future__ import annotations

import json
from datetime import datetime

from ..errors import InputError
from ..inputs import as_text
from ..request_limits import LIMITS, check_json, check_text_length
from .template_sandbox import BASE_STEPS, STEPS_PER_MESSAGE, bound_filters, bounded_environment, render_bounded
from .tools import call_arguments, check_tools

ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# ------------------------------------------------------------------------------ messages


def check_messages(messages) -> list:
    """OpenAI-style messages as plain dicts: ``role`` one of ROLES, ``content`` text (None or
    absent -> ""), an assistant's ``tool_calls`` a list, a tool's ``name``/``tool_call_id`` text;
    within ``request_limits.LIMITS`` (count, characters, calls; each call's arguments a JSON
    value ``check_json`` accepts). Anything else is an ``InputError`` naming the message."""
    if isinstance(messages, (str, bytes, dict)) or not hasattr(messages, "__iter__"):
        raise InputError("messages must be a list of {'role': ..., 'content': ...} objects")
    out, chars = [], 0
    for i, message in enumerate(messages):
        if i >= LIMITS.messages:
            raise InputError(f"messages: more than {LIMITS.messages} messages")
        if not isinstance(message, dict):
            raise InputError(f"messages[{i}] must be an object with 'role' and 'content', "
                             f"got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InputError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        clean = {"role": role, "content": as_text(message.get("content"), f"messages[{i}].content")}
        chars += len(clean["content"])
        if chars > LIMITS.message_chars:
            raise InputError(f"messages: more than {LIMITS.message_chars} characters of content")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, (list, tuple)):
                raise InputError(f"messages[{i}].tool_calls: a list, on assistant messages only")
            if len(calls) > LIMITS.tool_calls:
                raise InputError(f"messages[{i}].tool_calls: more than {LIMITS.tool_calls} calls")
            clean["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(calls)]
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                clean[key] = as_text(message[key], f"messages[{i}].{key}")
        out.append(clean)
    return out


def _template_call(i: int, j: int, call) -> dict:
    """An OpenAI tool call as templates read it: ``function.arguments`` as an object (Qwen's
    template writes it with ``tojson``), the string form parsed when it is JSON."""
    where = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(call, dict):
        raise InputError(f"{where}: each call must be an object")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InputError(f"{where}: each call needs function.name")
    name = check_text_length(function["name"], f"{where}.function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, (str, bytes, bytearray)):
        check_text_length(arguments, f"{where}.function.arguments")
    arguments = check_json(call_arguments(arguments), f"{where}.function.arguments")  # a string that is not JSON shows as it is
    call_id = check_json(call.get("id"), f"{where}.id")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ------------------------------------------------------------------------------ ChatML


def render_chatml(messages: list, tools: list | None = None, add_generation_prompt: bool = True) -> str:
    """The built-in template: ChatML turns, tools Qwen-style in the system turn, assistant tool
    calls as ``<tool_call>`` blocks, tool results as ``<tool_response>`` in a user turn."""
    parts = []
    messages = list(messages)
    if tools:
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        if messages and messages[0]["role"] == "system":
            messages = messages[1:]
        parts.append(f"{IM_START}system\n{tools_system_text(tools, system)}{IM_END}\n")
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "tool":
            opens = i == 0 or messages[i - 1]["role"] != "tool"
            closes = i + 1 == len(messages) or messages[i + 1]["role"] != "tool"
            parts.append((f"{IM_START}user" if opens else "") + f"\n<tool_response>\n{content}\n</tool_response>"
                         + (f"{IM_END}\n" if closes else ""))
            continue
        calls = "".join("\n<tool_call>\n" + json.dumps(
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
            + "\n</tool_call>" for c in message.get("tool_calls", ()))
        if calls and not content:
            calls = calls[1:]
        parts.append(f"{IM_START}{role}\n{content}{calls}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def tools_system_text(tools: list, system: str = "") -> str:
    """The Qwen-style tool instructions: one JSON line per tool inside ``<tools></tools>``."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    head = (system + "\n\n") if system else ""
    return (f"{head}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


# ------------------------------------------------------------------------------ Jinja


def _jinja_environment():
    """HF's chat-template environment, or None where jinja2 is not installed."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant masks in training): the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    environment, bound_error, bounded_filter = bounded_environment(jinja2, nodes, Extension,
                                                                   ImmutableSandboxedEnvironment)
    env = environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    bound_filters(env, bounded_filter)
    env.bound_error = bound_error
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A file's chat template, compiled once. ``source`` None (no template) -> built-in ChatML.

    ``kind`` is ``"jinja"`` or ``"chatml"``; ``note`` says why ChatML serves where a template
    was given (jinja2 missing, or the template does not compile); ``last_note`` says when the
    latest render fell back (the template raised for those messages)."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.source, self.bos_token, self.eos_token = source, bos_token or "", eos_token or ""
        self.kind, self.note, self.last_note = "chatml", None, None
        self._template = None
        if not source:
            self.note = "the model file has no chat template: built-in ChatML"
            return
        env = _jinja_environment()
        if env is None:
            self.note = "jinja2 is not installed: the file's chat template is replaced by built-in ChatML"
            return
        try:
            self._template = env.from_string(source)
            self.kind = "jinja"
        except Exception as exc:  # a template the environment cannot compile
            self.note = f"the file's chat template does not compile ({type(exc).__name__}: {exc}): built-in ChatML"

    @property
    def uses_tools(self) -> bool:
        """Whether the template itself reads ``tools`` (else tools go into the system turn)."""
        return self.kind == "jinja" and "tools" in self.source

    @property
    def tool_call_format(self) -> str | None:
        """How the model is told to write tool calls: ``"tagged"`` (Hermes/Qwen
        ``<tool_call>`` blocks: the built-in ChatML, a template that gets its tools Qwen-style
        in the system turn, or one that names ``<tool_call>`` itself), or None (the template
        shows tools its own way: a format the engine cannot constrain)."""
        if not self.uses_tools or "<tool_call>" in self.source:
            return "tagged"
        return None

    def render(self, messages, tools=None, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (checked: ``InputError`` for bad ones)."""
        messages, tools = check_messages(messages), check_tools(tools)
        self.last_note = None
        if self._template is not None:
            if tools and not self.uses_tools:  # the template would drop them: state them Qwen-style
                messages = _with_tools_in_system(messages, tools)
            steps = BASE_STEPS + STEPS_PER_MESSAGE * (len(messages) + len(tools or ()))
            try:
                return render_bounded(self._template, self._template.environment.bound_error, steps,
                                      messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      bos_token=self.bos_token, eos_token=self.eos_token)
            except RecursionError as exc:  # macro recursion: the same fallback
                self.last_note = f"the chat template failed ({type(exc).__name__}): built-in ChatML"
            except Exception as exc:  # raise_exception, a bound, or a template bug: never the caller's crash
                self.last_note = f"the chat template failed ({type(exc).__name__}: {exc}): built-in ChatML"
        return render_chatml(messages, tools, add_generation_prompt)

    def describe(self) -> dict:
        return {"kind": self.kind, "chars": len(self.source or ""), "note": self.note}


def _with_tools_in_system(messages: list, tools: list) -> list:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=tools_system_text(tools, messages[0]["content"]))
        return [first] + messages[1:]
    return [{"role": "system", "content": tools_system_text(tools)}] + messages
