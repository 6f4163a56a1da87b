"""A conversation that keeps its KV cache across turns (``Model.conversation()``).

Each turn renders the whole history with the model's chat template (``chat/template.py``),
tokenises it, and compares it with the ids the session already holds: only the tail after the
longest common prefix is prefilled. Templates are not always prefix-stable (a reply re-tokenised
from its text, a template that rewrites earlier turns): the session then rewinds to the first
differing position (or, where its cache cannot rewind, a new session starts) and the turn's
``TurnStats`` says so. When the history would not leave room for the reply, the oldest turns
are dropped (the system message stays) with a notice in the stats, never an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ContextFullError, InputError, UnsupportedModelError
from .chat.template import check_messages
from .chat.tools import check_tools
from .chat.tool_calls import ToolCallHolder, parse_reply
from .formats.cact import CONFIDENCE_HEAD
from .generation import Decoded, Steps, decode, round_tokens
from .grammar import Constraint
from .inputs import as_text, callback_or_none, checked_methods, flag, instance_or_none, optional_text, stop_strings
from .logprobs import probability_of_logit, saturate_top_logprobs
from .sampling import Sampling, clamp_budget

MIN_REPLY_ROOM = 16  # positions a turn keeps free for the reply when max_tokens asks for more than fits


@dataclass
class TurnStats:
    """What one turn cost. ``prefilled`` + ``reused`` = the rendered prompt's ids."""

    prompt_tokens: int = 0
    prefilled: int = 0  # ids run through the model this turn
    reused: int = 0  # ids already in the KV cache from earlier turns
    rewound: bool = False  # the cache held ids the new rendering does not start with
    new_session: bool = False
    completion_tokens: int = 0
    finish_reason: str = "empty"  # generation.FINISH_REASONS: "eos", "stop", "length", "tool_calls", "stopped"
    prefill_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    context_used: int = 0  # positions the cache holds after the turn
    context: int = 0
    dropped_messages: int = 0
    notices: list = field(default_factory=list)
    # With logprobs=True: per produced token {"token", "logprob", "top_logprobs": [...]}
    # (``logprobs.TokenLogprob.as_dict``); None otherwise.
    logprobs: list | None = None
    timings: dict = field(default_factory=dict)  # "mask_s" under a grammar

    def as_dict(self) -> dict:
        return dict(vars(self))


@checked_methods
class Conversation:
    """Messages, tools and one session. ``send(text)`` runs a user turn and returns the
    assistant message; ``stream(text)`` yields its text pieces (tool-call blocks held back)."""

    def __init__(self, model, *, system=None, tools=None, context=None, kv=None, confidence=False):
        self.model = model
        self.tools = check_tools(tools)
        self.kv, self.requested_context = kv, context
        # The session runs the confidence head's pool alongside every turn (confidence()).
        self.scores_confidence = flag(confidence, "confidence")
        if self.scores_confidence and CONFIDENCE_HEAD not in model.capabilities.heads:
            raise UnsupportedModelError("this model has no confidence head")
        # Formats that splice a reply's sampled ids back into the next rendering get them.
        self.keeps_reply_ids = model.chat_format.renders_reply_ids
        self.messages: list = []
        self.session = None
        self.cached: list = []  # the ids whose keys and values the session holds, in order
        self.turns: list = []
        self.bare_json_calls = True  # a bare JSON call object counts as a call (chat/tool_calls.py)
        self.system = optional_text(system, "system")
        self.reset(self.system)

    # ------------------------------------------------------------------ state
    def reset(self, system=None) -> None:
        """Start over (the KV cache is kept for reuse: the system turn's prefix still matches)."""
        self.system = optional_text(system, "system")
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def set_system(self, text) -> None:
        """Replace the system message (the next turn re-prefills from where it changes)."""
        self.system = as_text(text, "system")
        rest = [m for m in self.messages if m["role"] != "system"]
        self.messages = [{"role": "system", "content": self.system}] + rest

    def add(self, messages) -> None:
        """Append OpenAI-style messages (tool results, earlier turns) without running a turn."""
        self.messages += check_messages(messages)

    @property
    def context(self) -> int:
        return self._session().context

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        self.cached = []

    def _session(self):
        if self.session is None:
            extra = {"confidence": True} if self.scores_confidence else {}
            self.session = self.model.gpu.session(context=self.requested_context, kv=self.kv, **extra)
            self.cached = []
        return self.session

    def confidence(self) -> float | None:
        """σ of the confidence head over every position the session holds (the history and
        the last reply: prompt + completion, §7); None before a turn or without
        ``confidence=True``. A Needle 3 cache never rewinds (a changed history opens a new
        session), so the pool holds exactly those positions."""
        if not self.scores_confidence or self.session is None or self.session.position == 0:
            return None
        return probability_of_logit(self.session.confidence_logit_so_far())

    # ------------------------------------------------------------------ a turn
    def send(self, content=None, *, role="user", **options) -> dict:
        """One turn; returns the assistant message (``content``, ``tool_calls`` when any; an
        empty one when Stop took the message back before the reply began)."""
        for _ in self.stream(content, role=role, **options):
            pass
        stats = self.turns[-1]
        if stats.finish_reason == "stopped" and not stats.completion_tokens:
            return {"role": "assistant", "content": ""}
        return self.messages[-1]

    def stream(self, content=None, *, role="user", max_tokens=256, temperature=0.0, top_k=0, top_p=1.0,
               seed=0, stop=(), min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
               penalty_last_n=64, logit_bias=None, constraint=None, should_stop=None, logprobs=False,
               top_logprobs=0, tokens_per_round=None):
        """Append a ``role`` message (None: none, e.g. after ``add``), render, prefill the new
        tail, and yield the reply's text as it is sampled. The stats land in ``self.turns``.
        Sampling options as ``Model.stream``'s (the penalties see the rendered history);
        ``logprobs``: the turn's ``TurnStats.logprobs`` gets each produced token's logprob and
        its ``top_logprobs`` (0 to 20) alternatives, from one logits-row readback per token.

        ``constraint`` (a ``grammar.Constraint``, e.g. from ``Model.constraint``): every sampled
        id keeps the reply inside its grammar, which must also end within the token budget
        (the mask applied on the GPU before sampling; EOS only where the grammar accepts).

        ``should_stop(done, total)`` (optional), as in ``Model.stream``: asked before each
        prefill chunk and each decode step; a true answer ends the turn with finish reason
        "stopped" (the reply so far is the reply; stopped before its first token, the message
        is taken back). The cache keeps what was run either way."""
        callback_or_none(should_stop, "should_stop")
        top = saturate_top_logprobs(top_logprobs) if flag(logprobs, "logprobs") else None
        model, tokenizer = self.model, self.model._need_tokenizer()
        sampling = Sampling.saturate(temperature, top_k, top_p, seed, vocab=model.geometry.head_rows, min_p=min_p,
                                     repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                     frequency_penalty=frequency_penalty, penalty_last_n=penalty_last_n,
                                     logit_bias=logit_bias)
        stop_texts = stop_strings(stop)
        history = list(self.messages)
        if content is not None:
            self.add([{"role": role, "content": content}])
        if not self.messages or self.messages[-1]["role"] == "assistant":
            raise InputError("a turn needs a user or tool message after the last reply")
        stats = TurnStats()
        self.turns.append(stats)
        reply = {"role": "assistant", "content": ""}
        if self.keeps_reply_ids:
            reply["token_ids"] = []
        try:
            matcher = None if constraint is None else instance_or_none(constraint, Constraint, "constraint").matcher()
            rounds = round_tokens(tokens_per_round, model.gpu.device)
            yield from self._turn(tokenizer, sampling, max_tokens, stop_texts, stats, reply, matcher, should_stop, top,
                                  rounds)
        except GeneratorExit:  # the caller stopped reading: the reply so far is the reply
            stats.notices.append("the stream was closed before the reply ended")
            self.messages.append(reply)
            raise
        except BaseException:  # a device error, ContextFullError: as if the message was never sent
            if self.turns and self.turns[-1] is stats:
                self.turns.pop()
            self.messages = history
            if self.session is not None and self.session.position != len(self.cached):
                self.close()  # what the cache holds is unknown: the next turn starts afresh
            raise
        if stats.finish_reason == "stopped" and not stats.completion_tokens:
            self.messages = history  # stopped while reading the prompt: as if never sent
            return
        self.messages.append(reply)

    def _turn(self, tokenizer, sampling, max_tokens, stop_texts, stats, reply, matcher=None, should_stop=None,
              top=None, rounds=1):
        stops = self.model.chat_format.stop_ids(tokenizer)
        session = self._session()
        stats.context = session.context
        wanted = clamp_budget(max_tokens, session.context)
        ids = self._fit(tokenizer, min(wanted, max(MIN_REPLY_ROOM, session.context // 2)), stats)
        stats.prompt_tokens = len(ids)
        session = self._prefix(ids, stats)

        budget = clamp_budget(max_tokens, session.context - len(ids))
        decoder = tokenizer.stream_decoder(at_text_start=False, stop_strings=stop_texts)
        holder = ToolCallHolder() if self.tools else None
        decoded, failed = Decoded(), False
        try:
            for event in decode(Steps(session, round_tokens=rounds), ids[stats.reused:], decoded, sampling=sampling, budget=budget,
                                stop_ids=stops, decoder=decoder, matcher=matcher, should_stop=should_stop,
                                top_logprobs=top):
                reply["content"] += event.text
                if event.id is not None and self.keeps_reply_ids:
                    reply["token_ids"].append(event.id)
                stats.completion_tokens = len(decoded.ids)
                shown = holder.push(event.text) if holder else event.text
                if shown:
                    yield shown
            if holder:
                rest = holder.finish()
                if rest:
                    yield rest
        except BaseException as exc:
            failed = not isinstance(exc, GeneratorExit)  # a device error: stream() drops the session
            raise
        finally:
            if not failed:  # the cache holds the prompt's ids, then each reply id a step fed
                self.cached = (ids + decoded.ids)[: session.position]
            stats.prefill_s, stats.logprobs = decoded.prefill_s, decoded.logprobs
            stats.decode_tokens_per_s, stats.timings = decoded.decode_tokens_per_s, decoded.timings
            stats.context_used, stats.notices = session.position, stats.notices + decoded.notices
            stats.finish_reason = decoded.finish_reason
            if not decoded.sampled and decoded.finish_reason == "length":
                stats.prefilled = 0  # no room for a reply: nothing ran
        if self.tools:
            parsed = parse_reply(reply["content"], bare_json=self.bare_json_calls)
            if parsed.tool_calls:
                reply["content"], reply["tool_calls"] = parsed.content, parsed.tool_calls
                stats.finish_reason = "tool_calls"
            stats.notices += parsed.problems

    def _render(self, tokenizer) -> list:
        return self.model.chat_format.render_ids(tokenizer, self.messages, self.tools)

    def _fit(self, tokenizer, room: int, stats: TurnStats) -> list:
        """The rendered history's ids, dropping the oldest turns while the reply would lack
        ``room`` positions. The latest message alone too long is a ``ContextFullError``.

        A turn starts at a user message, so the candidate histories keep the system message
        and everything from one user message on. Keeping fewer turns never renders more ids,
        so the one kept is found by galloping down from the latest turn and bisecting (about
        2·log2(turns) renderings, each no longer than about twice what fits), not by dropping
        one turn and rendering again (quadratic in the history): the same cut, the same ids."""
        context, messages = self.session.context, self.messages
        ids = self._render(tokenizer)
        if len(ids) + room <= context:
            return ids
        first = 1 if messages and messages[0]["role"] == "system" else 0
        cuts = [first] + [i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"]
        rendered = {0: ids}

        def kept(j: int) -> list:  # the ids of the history from cuts[j] on (the system message kept)
            if j not in rendered:
                rendered[j] = self.model.chat_format.render_ids(tokenizer, messages[:first] + messages[cuts[j]:],
                                                                self.tools)
            return rendered[j]

        def fits(j: int) -> bool:
            return len(kept(j)) + room <= context

        last = len(cuts) - 1
        if last == 0 or not fits(last):  # stream() takes the message back: the conversation stays usable
            raise ContextFullError(f"the message needs {len(kept(last))} positions and the reply {room}: "
                                   f"more than the context of {context}")
        good, step = last, 1  # fits(good); fits(bad) is false
        while last - step > 0 and fits(last - step):
            good, step = last - step, step * 2
        bad = max(last - step, 0)
        while good - bad > 1:
            middle = (good + bad) // 2
            if fits(middle):
                good = middle
            else:
                bad = middle
        stats.dropped_messages = cuts[good] - first
        del self.messages[first:cuts[good]]
        stats.notices.append(f"context full: dropped the {stats.dropped_messages} oldest messages")
        return kept(good)

    def _prefix(self, ids: list, stats: TurnStats):
        """Keep the longest cached prefix of ``ids`` (at least one id is left to prefill, so
        the turn samples from fresh logits); rewind or reopen the session past it."""
        session = self.session
        same = 0
        for held, new in zip(self.cached, ids):
            if held != new:
                break
            same += 1
        same = min(same, len(ids) - 1)
        if same < session.position:
            stats.rewound = True
            if session.rewindable:
                session.rewind(same)
                self.cached = self.cached[:same]  # what the cache holds now (a turn may end before prefill)
            else:
                self.close()
                session = self._session()
                same = 0
                stats.new_session = True
            stats.notices.append(f"the history changed at position {same}: re-prefilled from there")
        stats.reused, stats.prefilled = same, len(ids) - same
        return session

