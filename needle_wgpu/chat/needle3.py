"""The Needle 3 chat prompt and the parser for its completions (§9). Pure Python (no numpy).

Prompt (upstream ``finetune.render_example``; needle-rs ``build_prompt``)::

    [<|im_start|>system\\n{system}<|im_end|>\\n]
    <|im_start|>user\\n<tools>{compact tools JSON}</tools>\\n{query}<|im_end|>\\n
    <|im_start|>assistant\\n

(shown on three lines; the only newlines are the ``\\n`` written out).

The model answers ``<think>…</think>`` reasoning followed by ``<tool_call>[…]</tool_call>``,
where ``[]`` is a deliberate abstention. :func:`parse_completion` reads that answer without
ever raising: a model can emit anything, and the caller decides what a problem means.
"""

from __future__ import annotations

import json

from .tool_calls import ToolCallFormat
from .tools import Completion, call_arguments, json_kind, tool_name, tools_json
from .tools import tools_json as compact_tools_json  # noqa: F401  (§9's name for the tools' JSON)
from ..grammar.tool_calls import tool_call_grammar
from ..inputs import as_text, checked

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOLS_START, TOOLS_END = "<tools>", "</tools>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESULT_START, TOOL_RESULT_END = "<tool_result>", "</tool_result>"
EOS_TEXT = "</s>"


# ----------------------------------------------------------------------------- the prompt


@checked
def build_prompt(query: str, tools=None, system: str | None = None) -> str:
    """The §9 prompt text. ``tools=None`` means no tools (``[]``).

    As upstream renders its training examples, ``system`` is stripped and the system turn is
    left out when it is empty. ``query`` and ``system`` are text (``inputs.as_text``: a str,
    bytes decoded as UTF-8, None as empty); anything else raises ``InputError``.
    """
    query, system = as_text(query, "query"), as_text(system, "system").strip()
    prefix = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
    return (f"{prefix}{IM_START}user\n{TOOLS_START}{tools_json(tools)}{TOOLS_END}\n"
            f"{query}{IM_END}\n{IM_START}assistant\n")


def prompt_ids(tokenizer, query: str, tools=None, system: str | None = None) -> list[int]:
    """``[BOS] + encode(prompt)`` (§9)."""
    return [tokenizer.bos_id] + tokenizer.encode(build_prompt(query, tools, system))


# ----------------------------------------------------------------------------- the completion


@checked
def parse_completion(text) -> Completion:
    """Parse ``<think>…</think><tool_call>[…]</tool_call>``; never raises (§9)."""
    problems = []
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    elif not isinstance(text, str):
        problems.append(f"completion is {type(text).__name__}, not text")
        text = ""
    try:
        return _parse(text, problems)
    except Exception as exc:  # a last line of defence: the parser's contract is to never raise
        problems.append(f"parser failure: {type(exc).__name__}")
        return Completion(None, None, text, problems)


def _parse(text: str, problems: list) -> Completion:
    thinking, rest = _split_thinking(text, problems)
    call_at = rest.find(TOOL_CALL_START)
    if call_at < 0:
        problems.append("no <tool_call> block")
        if _strip_ends(rest):
            problems.append("text outside the tool call ignored")
        return Completion(thinking, None, text, problems)
    if rest[:call_at].strip():
        problems.append("text before <tool_call> ignored")
    body = rest[call_at + len(TOOL_CALL_START) :]
    end_at = body.find(TOOL_CALL_END)
    if end_at < 0:
        problems.append("unterminated <tool_call> (output truncated?)")
        body = _strip_ends(body)
    else:
        if _strip_ends(body[end_at + len(TOOL_CALL_END) :]):
            problems.append("text after </tool_call> ignored")
        body = body[:end_at]
    calls, abstained = _read_calls(body.strip(), problems)
    return Completion(thinking, calls, text, problems, abstained)


def _split_thinking(text: str, problems: list) -> tuple:
    """(thinking or None, the text after it). Training wraps the reasoning in newlines."""
    start = text.find(THINK_START)
    end = text.find(THINK_END)
    call = text.find(TOOL_CALL_START)
    if start >= 0 and (call < 0 or start < call):
        if text[:start].strip():
            problems.append("text before <think> ignored")
        inner_at = start + len(THINK_START)
        end = text.find(THINK_END, inner_at)
        if end < 0:
            problems.append("unterminated <think>")
            stop = call if call > start else len(text)
            return text[inner_at:stop].strip(), text[stop:]
        return text[inner_at:end].strip(), text[end + len(THINK_END) :]
    if end >= 0 and (call < 0 or end < call):
        problems.append("</think> without <think>")
        return text[:end].strip(), text[end + len(THINK_END) :]
    return None, text


def _strip_ends(text: str) -> str:
    """Drop the end markers and whitespace a completion may legitimately finish with."""
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for marker in (IM_END, EOS_TEXT):
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                changed = True
    return text


def _read_calls(body: str, problems: list) -> tuple:
    """(normalised calls or None, whether the model emitted exactly an empty list)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        problems.append(f"tool call JSON is invalid at character {exc.pos}: {exc.msg}")
        return None, False
    except (RecursionError, ValueError) as exc:  # deep nesting, or an over-long integer
        problems.append(f"tool call JSON cannot be read ({type(exc).__name__})")
        return None, False
    if isinstance(value, dict):
        problems.append("tool call JSON is an object, not a list; read as one call")
        value = [value]
    if not isinstance(value, list):
        problems.append(f"tool call JSON is {json_kind(value)}, not a list")
        return None, False
    calls = []
    for i, item in enumerate(value):
        call = _normalise_call(i, item, problems)
        if call is not None:
            calls.append(call)
    return calls, not value


def _normalise_call(i: int, item, problems: list) -> dict | None:
    if not isinstance(item, dict):
        problems.append(f"call {i} is {json_kind(item)}, not an object; dropped")
        return None
    name = item.get("name")
    if not isinstance(name, str) or not name:
        problems.append(f"call {i} has no name; dropped")
        return None
    arguments = item.get("arguments")
    if arguments is None:
        problems.append(f"call {i} ({name}) has no arguments; using {{}}")
        arguments = {}
    elif isinstance(arguments, str):
        # Some outputs carry the arguments as a JSON string, as OpenAI-style APIs do.
        arguments = call_arguments(arguments)
        if not isinstance(arguments, dict):
            problems.append(f"call {i} ({name}) has arguments that are not an object; dropped")
            return None
        problems.append(f"call {i} ({name}) had its arguments as a JSON string; decoded")
    elif not isinstance(arguments, dict):
        kind = json_kind(arguments)
        problems.append(f"call {i} ({name}) has arguments that are {kind}; dropped")
        return None
    extra = sorted(str(k) for k in item if k not in ("name", "arguments"))
    if extra:
        problems.append(f"call {i} ({name}) has extra keys {extra}; ignored")
    return {"name": name, "arguments": arguments}


# ----------------------------------------------------------------------------- the chat format


def _answer_grammar(tools) -> list:
    """The grammar of a §9 answer: reasoning, then ``<tool_call>[calls]</tool_call>``, ``[]`` allowed."""
    return tool_call_grammar(tools)


def _required_grammar(tools, names=None) -> list:
    """A §9 answer of at least one call (to one of ``names`` when given)."""
    chosen = [t for t in json.loads(tools_json(tools)) if names is None or tool_name(t) in names]
    return tool_call_grammar(chosen, min_calls=1)


# Needle 3's calls (§9): one JSON array in one <tool_call> block.
NEEDLE3_CALLS = ToolCallFormat("needle3", required_grammar=_required_grammar, answer_grammar=_answer_grammar)


class Needle3Chat:
    """How the engine speaks to a Needle 3 model (the ``ChatFormat`` of ``api.Model``)."""

    # Conversation records each reply's sampled ids on its message ("token_ids"): render_ids
    # splices them back, so the next turn's ids start with exactly what the KV cache holds.
    renders_reply_ids = True
    template = None  # §9's format is fixed: no chat template in the file
    tool_calls = NEEDLE3_CALLS

    def render_ids(self, tokenizer, messages, tools=None) -> list:
        """Ids of a multi-turn conversation (``Conversation``; docs/api.md, "Needle 3 turns").

        Turns, in order: a system message as §9's system part (stripped, left out when empty);
        a user message as §9's user turn, ``<tools>…</tools>`` included; a run of tool messages
        as one user turn holding ``<tool_result>{content}</tool_result>`` each (our template:
        upstream's is UNKNOWN, §9.1); an assistant message as ``<|im_start|>assistant\n``, its
        sampled ``token_ids`` (else its text, tool calls as ``<tool_call>[…]</tool_call>``),
        then ``<|im_end|>\n``. The prompt ends ``<|im_start|>assistant\n`` unless the last
        message is the assistant's. For [system,] user this is ``prompt_ids``, id for id.
        """
        shown_tools = tools_json(tools)
        ids = [tokenizer.bos_id]
        text = ""  # rendered text not yet encoded
        spliced = False  # ids were spliced in: later text starts at a marker, without a dummy prefix
        splice = tokenizer.im_end_id is not None
        messages = list(messages)
        for i, message in enumerate(messages):
            role, content = message["role"], str(message.get("content") or "")
            if role == "system":
                system = content.strip()
                text += f"{IM_START}system\n{system}{IM_END}\n" if system else ""
            elif role == "user":
                text += f"{IM_START}user\n{TOOLS_START}{shown_tools}{TOOLS_END}\n{content}{IM_END}\n"
            elif role == "tool":
                opens = i == 0 or messages[i - 1]["role"] != "tool"
                closes = i + 1 == len(messages) or messages[i + 1]["role"] != "tool"
                text += (f"{IM_START}user\n" if opens else "") + f"{TOOL_RESULT_START}{content}{TOOL_RESULT_END}" \
                    + (f"{IM_END}\n" if closes else "")
            else:  # assistant
                text += f"{IM_START}assistant\n"
                reply_ids = message.get("token_ids")
                if reply_ids is not None and splice:
                    ids += _encode_rendered(tokenizer, text, spliced)
                    ids += [int(t) for t in reply_ids]
                    text, spliced = "", True
                else:
                    text += content + _calls_text(message.get("tool_calls"))
                text += f"{IM_END}\n"
        if not messages or messages[-1]["role"] != "assistant":
            text += f"{IM_START}assistant\n"
        return ids + _encode_rendered(tokenizer, text, spliced)

    def request_ids(self, tokenizer, *, prompt=None, query=None, tools=None, system=None) -> list:
        """A tool-calling prompt when ``query`` or ``tools`` is given (§9), else BOS + free text."""
        if query is not None or tools is not None:
            if system is not None and not isinstance(system, str):
                system = str(system)
            return prompt_ids(tokenizer, query or "", tools=tools, system=system)
        return [tokenizer.bos_id] + tokenizer.encode(str(prompt))

    @staticmethod
    def stop_ids(tokenizer) -> set:
        """EOS (id 1, §9) plus the tokenizer's own end-of-turn ids."""
        stops = {1}
        if tokenizer is not None:
            stops |= set(tokenizer.stop_ids)
        return stops

    @staticmethod
    def parse(text) -> Completion:
        return parse_completion(text)



def _encode_rendered(tokenizer, text: str, continued: bool) -> list:
    """The ids of rendered text. After spliced ids (``continued``) the text starts with
    ``<|im_end|>``: the tokenizer splits at markers and encodes each segment alone, so its
    ids from that marker on are the ids the whole text would have; the dummy prefix's ids
    before it are dropped."""
    if not text:
        return []
    ids = tokenizer.encode(text)
    return ids[ids.index(tokenizer.im_end_id):] if continued else ids


def _calls_text(calls) -> str:
    """An assistant message's OpenAI-style ``tool_calls`` as the Needle 3 answer writes them."""
    if not calls:
        return ""
    answer = []
    for call in calls:
        function = call.get("function", call)
        arguments = call_arguments(function.get("arguments", {}))
        answer.append({"name": function.get("name"), "arguments": arguments})
    return TOOL_CALL_START + json.dumps(answer, separators=(",", ":"), ensure_ascii=False) + TOOL_CALL_END

