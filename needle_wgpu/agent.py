"""A tool-calling agent (docs/api.md, "Agents"): ``Agent(model, tools=[...]).run(query)``.

Each model turn runs in one ``Conversation`` (its KV cache kept across turns: a turn prefills
only its new ids), under the family's answer grammar for the tools where it has one (Needle 3:
``grammar.tool_calls``, the grammar ``Model.generate(query, tools)`` uses). The calls of a turn
are executed as Python functions; ``json.dumps(results)`` goes back as the next turn (a tool
message: Needle 3 renders it ``<tool_result>…</tool_result>``, ``prompt.Needle3Chat.render_ids``).
The loop ends when the model answers without a call (``[]`` for Needle 3) or after
``max_steps`` rounds of calls (at most 8, as upstream's ``run``), so it always ends.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field

from .api import Model
from .chat.tools import call_arguments, tool_function
from .errors import ContextFullError, InputError
from .inputs import checked, checked_methods, flag
from .sampling import clamp_count
from .tools import Field, Tool, tool

__all__ = ["Agent", "AgentResult", "Field", "Tool", "tool", "MAX_STEPS"]

MAX_STEPS = 8  # rounds of tool calls a run may execute (upstream's run() bound, spec §9.1)


@dataclass
class AgentResult:
    """What a run did. ``function_calls`` and ``results`` are aligned: every call executed, in
    order, and what it returned (``{"error": ...}`` where it failed). ``reasoning`` and
    ``confidence`` are the final turn's. ``steps``: rounds of calls executed (<= max_steps).
    ``finish_reason``: "answer" (the model answered without a call), "max_steps" (it still
    called: those calls are ``pending_calls``, not executed), "length" (the reply was cut by
    the token budget before a call could be read), "context_full" (the next turn did not fit).
    ``turns``: per model turn its text, calls, results, reasoning, problems and TurnStats."""

    function_calls: list = field(default_factory=list)
    results: list = field(default_factory=list)
    reasoning: str | None = None
    confidence: float | None = None
    steps: int = 0
    finish_reason: str = "answer"
    answer: str = ""
    pending_calls: list = field(default_factory=list)
    turns: list = field(default_factory=list)

    def __getitem__(self, key):  # result["function_calls"], as upstream's response dict reads
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def as_dict(self) -> dict:
        """The fields as a dict (the values as they are: results are the tools' own objects),
        each turn's stats as a dict."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["turns"] = [dict(t, stats=t["stats"].as_dict()) for t in self.turns]
        return out


@checked_methods
class Agent:
    """Tools over a model. ``tools``: ``Tool``s (``@tool``), plain functions (read as by
    ``@tool``) or schema dicts without a function (a call to one gets an error result).
    ``constrained``: None (default) decodes under the family's answer grammar where it has one
    and the schemas fit its subset; True insists (else ``UnsupportedModelError`` or
    ``InputError``); False decodes freely. ``max_steps`` saturates to [0, 8]. A second
    ``run`` continues the conversation (state in the KV cache) unless ``stateless``;
    ``reset()`` starts over."""

    @checked  # an unknown keyword is an InputError, as for every public method
    def __init__(self, model, tools=(), *, system=None, max_steps=MAX_STEPS, constrained=None, stateless=False,
                 context=None, kv=None):

        if not isinstance(model, Model):
            raise InputError(f"Agent takes a needle_wgpu Model (needle_wgpu.load), got {type(model).__name__}")
        self.model = model
        self.tools = _tools(tools)
        self.schemas = [t.schema if isinstance(t, Tool) else t for t in self.tools.values()]
        self.max_steps = clamp_count(max_steps, 0, MAX_STEPS, MAX_STEPS)
        self.stateless = flag(stateless, "stateless")
        self.constraint = model._answer_constraint(self.schemas, constrained, True)
        scored = model.capabilities.confidence
        self.conversation = model.conversation(system, tools=self.schemas, context=context, kv=kv,
                                               confidence=scored)

    def reset(self, system=None) -> None:
        """Forget the conversation (and free its KV cache); ``system`` replaces the system
        message when given."""
        self.conversation.close()
        self.conversation.reset(self.conversation.system if system is None else system)

    def close(self) -> None:
        self.conversation.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def run(self, query, *, max_tokens=256, temperature=0.0, top_k=0, top_p=1.0, seed=0) -> AgentResult:
        """Answer ``query``: model turns and tool calls until the model answers without a call
        or ``max_steps`` rounds of calls ran. Sampling options apply to every turn
        (``max_tokens`` per turn). A query that does not fit the context is a
        ``ContextFullError``; a tool's exception becomes its error result, never raised."""
        if self.stateless:
            self.reset()
        conversation = self.conversation
        options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        out = AgentResult()
        content, role = query, "user"
        while True:
            try:
                reply = conversation.send(content, role=role, constraint=self.constraint, **options)
            except ContextFullError:
                if role == "user":
                    raise  # the query itself: the caller's to shorten (the conversation is unchanged)
                out.finish_reason = "context_full"  # the results are kept; the model never saw them
                break
            turn = self._read(reply, conversation.turns[-1])
            out.turns.append(turn)
            out.answer, out.reasoning = turn["text"], turn["reasoning"]
            calls = turn["calls"]
            if not calls:
                out.finish_reason = "length" if turn["stats"].finish_reason == "length" else "answer"
                break
            if out.steps >= self.max_steps:
                out.finish_reason, out.pending_calls = "max_steps", calls
                break
            turn["results"] = [self._execute(call) for call in calls]
            out.function_calls += calls
            out.results += turn["results"]
            out.steps += 1
            content, role = results_json(turn["results"]), "tool"
        out.confidence = conversation.confidence()
        return out

    # ------------------------------------------------------------------ a turn's calls
    def _read(self, reply: dict, stats) -> dict:
        """A reply's text, calls ({"name", "arguments"}), reasoning and parse problems."""
        ids = reply.get("token_ids")
        if ids is not None:  # the family parses its raw answer (Needle 3: <think>, <tool_call>)
            text = _decoded(self.model.tokenizer, ids)
            completion = self.model.chat_format.parse(text)
            calls, reasoning, problems = completion.tool_calls, completion.thinking, list(completion.problems)
        else:  # the conversation read the calls with the template's tool-call parser
            text, reasoning, problems = reply["content"], None, list(stats.notices)
            calls = [{"name": c["function"]["name"], "arguments": call_arguments(c["function"]["arguments"])}
                     for c in reply.get("tool_calls", ())]
        return {"text": text, "calls": calls, "results": [], "reasoning": reasoning, "problems": problems,
                "stats": stats}

    def _execute(self, call: dict):
        """One call's result: the function's return value, or ``{"error": ...}``."""
        target = self.tools.get(call.get("name"))
        if target is None:
            return {"error": f"unknown tool {call.get('name')!r}"}
        if not isinstance(target, Tool):
            return {"error": f"tool {call['name']!r} has no Python function"}
        try:
            return target.invoke(call.get("arguments"))
        except Exception as exc:  # the tool's failure is the model's to read, never the caller's crash
            return {"error": f"{type(exc).__name__}: {exc}"}


def results_json(results: list) -> str:
    """The next turn's text: ``json.dumps(results)``; a value JSON lacks is written as
    ``_jsonable`` says, one that still fails as an error result in its place."""
    fed = []
    for result in results:
        try:
            json.dumps(result, default=_jsonable)
            fed.append(result)
        except (TypeError, ValueError, RecursionError) as exc:
            fed.append({"error": f"the result is not JSON ({type(exc).__name__}: {exc})"})
    return json.dumps(fed, default=_jsonable)


def _jsonable(value):
    """JSON for the values tools commonly return: Enum members, dataclasses, sets, bytes;
    anything else as its ``str``."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _tools(tools) -> dict:
    """name -> Tool (or schema dict) of the agent's tools; duplicate names are an InputError."""
    if isinstance(tools, (Tool, dict)) or callable(tools):
        tools = [tools]
    if isinstance(tools, (str, bytes)) or not hasattr(tools, "__iter__"):
        raise InputError("tools must be a list of @tool functions, functions or tool schema objects")
    out = {}
    for i, entry in enumerate(tools):
        if isinstance(entry, dict):
            entry = dict(tool_function(entry))
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise InputError(f"tools[{i}]: a tool schema needs a 'name'")
        elif isinstance(entry, Tool):
            name = entry.name
        elif callable(entry):
            entry = Tool(entry)
            name = entry.name
        else:
            raise InputError(f"tools[{i}]: expected a @tool function, a function or a schema, "
                             f"got {type(entry).__name__}")
        if name in out:
            raise InputError(f"tools[{i}]: two tools are named {name!r}")
        out[name] = entry
    return out


def _decoded(tokenizer, ids) -> str:
    """A reply's text from its ids, decoded as the conversation streamed it."""
    decoder = tokenizer.stream_decoder(at_text_start=False)
    return "".join(decoder.push(i) for i in ids) + decoder.finish()

