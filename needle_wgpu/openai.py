"""``Model.chat``: the OpenAI chat-completions surface over a ``Conversation`` (docs/api.md).

A request is checked whole before anything runs (messages, tools, ``tool_choice``,
``response_format``, the sampling options): a problem is one typed ``InputError`` naming it.
Then one fresh conversation answers the messages, under a grammar where the request asks for
structure (``response_format`` JSON, ``tool_choice`` "required" or a named function): the reply
is then always a JSON document or tool calls in the template's format (``grammar/tagged_calls.py``),
the mask applied on the GPU before each sampled token. The result is a ``chat.completion``
dict, or with ``stream=True`` an iterator of ``chat.completion.chunk`` dicts.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from .chat.template import check_messages
from .chat.tools import check_tools, tool_name
from .conversation import Conversation
from .errors import InputError, UnsupportedModelError
from .generation import openai_finish_reason
from .grammar.tagged_calls import reply_grammar
from .inputs import describe, flag, stop_strings
from .request_limits import check_json

TOOL_CHOICES = ("none", "auto", "required")
MAX_REQUIRED_CALLS = 4  # tool_choice "required": 1 .. this many calls in one reply

# Sampling options forwarded to Conversation.stream only when the caller changed them from
# these defaults.
SAMPLING_EXTRAS = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "penalty_last_n": None, "logit_bias": None, "logprobs": False, "top_logprobs": 0}


@dataclass(frozen=True)
class ReplyShape:
    """What one request asks of the reply: which tools the template shows, whether calls are
    parsed, and the grammar (None: free text)."""

    render_tools: list | None  # the tools given to the template (None for tool_choice "none")
    bare_json_calls: bool  # whether a bare JSON answer may be read as a call
    grammar_key: str | None  # Model.constraint's cache key
    grammar: dict | None  # reply_grammar's keywords


# ------------------------------------------------------------------------------ checks


def check_tool_choice(tool_choice, tools) -> tuple:
    """(kind, names): kind "none", "auto", "required" or "function" (names: the one allowed)."""
    if tool_choice is None:
        tool_choice = "auto"
    names = [tool_name(t) for t in tools or ()]
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise InputError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {describe(tool_choice)}")
        if tool_choice == "required" and not tools:
            raise InputError("tool_choice 'required' needs tools")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise InputError("tool_choice: a named function is {'type': 'function', 'function': {'name': ...}}")
    name = function["name"]
    if name not in names:
        raise InputError(f"tool_choice names the function {describe(name)}, which is not among the tools "
                         f"({', '.join(repr(n) for n in names if n) or 'none given'})")
    return "function", [name]


def check_response_format(response_format) -> tuple:
    """("text", None), ("json_object", None) or ("json_schema", schema)."""
    if response_format is None:
        return "text", None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind in ("text", "json_object"):
        return kind, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise InputError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return kind, check_json(spec["schema"], "response_format.json_schema.schema")
    raise InputError("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                     f"{{'type': 'json_schema', 'json_schema': {{...}}}}, got {describe(response_format)}")


def reply_shape(model, tools, tool_choice, response_format) -> ReplyShape:
    """How the request's tools, tool_choice and response_format shape the reply."""
    choice, names = check_tool_choice(tool_choice, tools)
    kind, schema = check_response_format(response_format)
    if choice == "none":  # the model is not offered the tools: a plain answer (any format asked for)
        tools = None
    calls = bool(tools) and (choice in ("required", "function") or kind != "text")
    if choice in ("required", "function") or calls:
        calls_format = model.chat_format.tool_calls
        if calls_format is None or not calls_format.chat_replies:
            if choice in ("required", "function"):
                raise UnsupportedModelError(f"tool_choice {choice!r}: this model's chat template writes tool calls "
                                            "in a format the engine cannot constrain (only <tool_call> blocks)")
            calls = False  # auto + a JSON format: the reply is the JSON document only
    if choice in ("required", "function"):
        grammar = {"tools": tools, "names": names, "max_calls": 1 if names else MAX_REQUIRED_CALLS}
    elif kind != "text":
        grammar = {"schema": schema, "json_object": kind == "json_object"}
        if calls:
            grammar.update(tools=tools, max_calls=MAX_REQUIRED_CALLS)
    else:
        grammar = None
    key = None
    if grammar is not None:
        try:
            key = "chat:" + json.dumps(grammar, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InputError(f"response_format or tools are not JSON ({exc})") from None
    return ReplyShape(tools, bare_json_calls=kind == "text", grammar_key=key, grammar=grammar)


def sampling_options(options: dict) -> dict:
    """The sampling keywords for Conversation.stream: the standard ones as given, an extra
    only when it differs from its default (``SAMPLING_EXTRAS``: ``penalty_last_n=None`` leaves
    the conversation's own default)."""
    out = {}
    for name, value in options.items():
        if name in SAMPLING_EXTRAS and (value is None or value is SAMPLING_EXTRAS[name]
                                        or _same(value, SAMPLING_EXTRAS[name])):
            continue
        out[name] = value
    return out


def _same(value, default) -> bool:
    try:
        return type(value) is not bool and value == default or value is default
    except Exception:  # an array's == is not a truth value: not the default
        return False


# ------------------------------------------------------------------------------ the request


def chat_completion(model, messages, tools=None, *, tool_choice="auto", response_format=None, stream=False,
                    context=None, kv=None, conversation=None, **options):
    """A ``chat.completion`` dict, or with ``stream`` an iterator of chunk dicts.

    ``conversation``: a ``Conversation`` of ``model`` to answer on instead of a new one (its
    history is replaced by ``messages``, its ``context`` and ``kv`` are its own): the KV cache it
    holds is reused for the prefix the new rendering shares with it (prefix caching; the ids are
    those of a fresh conversation), and it is left open for the next request. ``usage`` says how
    many prompt tokens came from the cache (``prompt_tokens_details.cached_tokens``)."""
    messages, tools = check_messages(messages), check_tools(tools)
    if not messages or messages[-1]["role"] == "assistant":
        raise InputError("messages must end with a user or tool message")
    shape = reply_shape(model, tools, tool_choice, response_format)
    options = sampling_options(options)
    stop_strings(options.get("stop", ()))  # checked now, not at the stream's first chunk
    constraint, notices = None, []
    if shape.grammar is not None:
        constraint = model.constraint(shape.grammar_key, lambda: reply_grammar(**shape.grammar))
        if stop_strings(options.get("stop", ())):  # a stop string could cut the document
            options["stop"] = ()
            notices.append("stop strings are not applied under a response format or required tool calls")
    owned = conversation is None
    if owned:
        conversation = Conversation(model, tools=shape.render_tools, context=context, kv=kv)
    else:
        if not isinstance(conversation, Conversation) or conversation.model is not model:
            raise InputError("conversation must be a Conversation of this model (model.conversation())")
        conversation.reset()
        conversation.turns.clear()
        conversation.tools = shape.render_tools
    conversation.bare_json_calls = shape.bare_json_calls
    conversation.add(messages)
    header = {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()), "model": model_name(model)}
    turn = conversation.stream(None, constraint=constraint, **options)
    if flag(stream, "stream"):
        return _chunks(conversation, turn, header, notices, owned)
    try:
        for _ in turn:
            pass
        reply, stats = conversation.messages[-1], conversation.turns[-1]
        stats.notices += notices
    finally:
        if owned:
            conversation.close()
    return {**header, "object": "chat.completion",
            "choices": [{"index": 0, "message": _message(reply), "finish_reason": _finish(stats),
                         "logprobs": openai_logprobs(model, turn_logprobs(stats, reply))}],
            "usage": _usage(stats), "stats": stats.as_dict()}


def _chunks(conversation, turn, header, notices, owned=True):
    """The streamed form: role, content deltas, tool calls, finish reason, then usage."""
    model = conversation.model

    def chunk(delta=None, finish=None, **extra):
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None),
                                             "finish_reason": finish}]
        return {**header, "object": "chat.completion.chunk", "choices": choices, **extra}

    try:
        yield chunk({"role": "assistant", "content": ""})
        shown = ContentStream()
        for piece in turn:
            text = shown.push(piece)
            if text:
                yield chunk({"content": text})
        reply, stats = conversation.messages[-1], conversation.turns[-1]
        stats.notices += notices
        rest = shown.finish(reply["content"] or "")
        if rest:
            yield chunk({"content": rest})
        if reply.get("tool_calls"):
            yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(reply["tool_calls"])]})
        yield chunk({}, _finish(stats), logprobs=openai_logprobs(model, turn_logprobs(stats, reply)))
        yield chunk(usage=_usage(stats), stats=stats.as_dict())
    finally:
        turn.close()
        if owned:
            conversation.close()


class ContentStream:
    """Content deltas that add up to the final ``message.content``: the turn's pieces (stop
    strings are already held back and cut by the generation loop) with trailing whitespace held
    back (a reply with tool calls is stripped) and leading whitespace until some text follows."""

    def __init__(self):
        self.pending, self.emitted = "", ""

    def push(self, piece: str) -> str:
        self.pending += piece
        out = self.pending.rstrip()
        if not (self.emitted + out).strip():
            out = ""  # only whitespace so far: held
        self.emitted += out
        self.pending = self.pending[len(out):]
        return out

    def finish(self, content: str) -> str:
        """The rest of ``content`` not yet shown ("" where the shown text is not its prefix)."""
        rest = content[len(self.emitted):] if content.startswith(self.emitted) else ""
        self.emitted += rest
        return rest


# ------------------------------------------------------------------------------ the result


def _message(reply: dict) -> dict:
    calls = reply.get("tool_calls")
    message = {"role": "assistant", "content": (reply["content"] or None) if calls else reply["content"]}
    if calls:
        message["tool_calls"] = calls
    return message


def _finish(stats) -> str:
    return openai_finish_reason(stats.finish_reason)


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.reused}}


def model_name(model) -> str:
    """The file's ``general.name`` (GGUF), else the family's name."""
    return model.gpu.name


def turn_logprobs(stats, reply) -> list | None:
    """The sampling hook: per produced token ``{"token", "logprob", "top_logprobs": [{"token",
    "logprob"}]}`` as the turn reports them (``TurnStats.logprobs``, else the reply's
    ``logprobs``), None when the turn reports none."""
    found = stats.logprobs
    if found is None:
        found = reply.get("logprobs")
    return found


def openai_logprobs(model, entries) -> dict | None:
    """OpenAI's choice ``logprobs``: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [...]}], "refusal": None}``; a token given as an id is decoded."""
    if entries is None:
        return None

    def one(entry) -> dict:
        token = entry.get("token")
        raw = _token_bytes(model, token) if isinstance(token, int) else None
        if raw is None:
            text = model.decode([token]) if isinstance(token, int) else str(token)
            raw = text.encode("utf-8", "replace")
        else:  # a token may end inside a UTF-8 character: its bytes are exact, its text is not
            text = raw.decode("utf-8", "replace")
        return {"token": text, "logprob": float(entry.get("logprob", 0.0)), "bytes": list(raw)}

    return {"content": [dict(one(e), top_logprobs=[one(t) for t in e.get("top_logprobs", ())]) for e in entries],
            "refusal": None}


def _token_bytes(model, token: int) -> bytes | None:
    """The bytes a token stands for (a GGUF tokenizer's ``token_bytes``), or None."""
    tokenizer = model.tokenizer
    if tokenizer is None or not 0 <= token < tokenizer.vocab_size:
        return None
    return bytes(tokenizer.token_bytes(token))
