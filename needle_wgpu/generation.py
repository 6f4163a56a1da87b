"""The one generation loop: every surface (``Model.stream``/``generate``, ``Conversation``,
``Model.chat``, ``Agent``, the CLI, the browser worker) runs its tokens through ``decode``.

It owns what happens between a prompt's ids and the finished reply: the prefill, the decode
steps, the grammar mask before each sampled id, end-of-generation ids, stop strings (held back
by the tokenizer's ``StreamDecoder``, so nothing streamed is later cut), the token budget, the
caller's Stop (``should_stop``), logprobs and the timings. What a surface adds around it (a
request's rendering, a conversation's cache bookkeeping, parsing tool calls) stays with it.

One vocabulary of finish reasons (``FINISH_REASONS``), mapped to OpenAI's in one place
(``openai_finish_reason``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .sampling import clamp_count

# Why a generation ended (docs/api.md, "Finish reasons").
FINISH_REASONS = {
    "empty": "the request has no ids: nothing ran",
    "length": "the token budget or the context is spent (or no answer of the grammar fits it)",
    "eos": "the model produced an end-of-generation id (not included)",
    "stop": "a stop string appeared (the text is cut before it)",
    "stopped": "should_stop answered true",
    "tool_calls": "the reply holds tool calls (a chat turn, once parsed)",
}
_OPENAI = {"length": "length", "tool_calls": "tool_calls"}


MAX_ROUND_TOKENS = 64


def round_tokens(value, device) -> int:
    """A request's ``tokens_per_round``: None, NaN, ±inf or a value that is not a number is the
    device's ``round_tokens`` (chosen per adapter kind by measurement, BENCHMARKS.md); a number
    is truncated and clamped to [1, 64]."""
    default = device.round_tokens if device is not None else 1
    return clamp_count(value, 1, MAX_ROUND_TOKENS, default)


def openai_finish_reason(reason: str) -> str:
    """OpenAI's ``finish_reason`` for one of ours: "length" and "tool_calls" as they are, every
    other end ("eos", "stop", "stopped", "empty") is "stop"."""
    return _OPENAI.get(reason, "stop")


@dataclass
class TokenEvent:
    """One streamed token: its id and the text it completed (may be empty: mid-character, or
    held back while it may begin a stop string). The last event of a generation may have
    ``id`` None: it carries the text held back when the generation ended (the rest of a
    partial stop string that did not complete, an incomplete UTF-8 sequence as U+FFFD), so the
    events' texts always join to the result's text."""

    id: int | None
    text: str


@dataclass
class Decoded:
    """What one run of the loop produced. ``ids`` exclude the end-of-generation id; ``text``
    is the decoded text of ``ids``, cut before a stop string."""

    ids: list = field(default_factory=list)
    text: str = ""
    finish_reason: str = "empty"
    logprobs: list | None = None  # per produced id, ``logprobs.TokenLogprob.as_dict()`` (with top_logprobs)
    prefill_s: float = 0.0  # prompt to first sampled id
    decode_tokens_per_s: float = 0.0
    timings: dict = field(default_factory=dict)  # "mask_s" under a grammar
    notices: list = field(default_factory=list)
    sampled: bool = False  # the prefill ran to its first sampled id (False: nothing ran, or stopped)


@dataclass
class Steps:
    """Where the ids come from: a session's prefill and decode steps, in rounds of up to
    ``round_tokens`` steps per submit and readback (``ChunkedSession.decode_round``), or a
    speculative decoder (``speculative.SpeculativeDecoder``: drafts verified in rounds) over it.

    A round runs ahead of the loop: the ids it sampled past the end of the generation (an
    end-of-generation id, a stop string, the budget, Stop) are discarded and the session
    rewound over them (``finish``), so its position and cache are those of one step at a time.
    The sampler draws from a hash of the seed and the position, so the ids are the same for
    every round length. A step that needs the host first (a grammar mask, a logprobs row) runs
    alone.

    Rounds are pipelined where the session can rewind over two of them: the next round is
    submitted before the previous one is read (``submit_round``/``collect_round``; the sampled
    ids feed the next step on the GPU), so the GPU runs one round while the host hands out the
    ids of the one before. The ids are the same; at the end one more round may have run, and
    is taken back with the rest."""

    session: object
    speculator: object = None
    round_tokens: int = 1
    pipeline: bool = True  # False: each round is read before the next is submitted (to measure the difference)
    _queue: list = field(default_factory=list)
    _ahead: object = None  # a submitted round whose ids are not read yet, and its length
    _ahead_count: int = 0

    def __post_init__(self):
        session = self.session
        if self.round_tokens > 1 and not session.rewindable:  # a ring rewinds only so far
            self.round_tokens = max(1, min(self.round_tokens, session.max_rewind + 1))
        # At the end a round's unused steps and the whole round ahead are taken back.
        self.pipelined = self.pipeline and self.round_tokens > 1 and (
            session.rewindable or 2 * self.round_tokens - 1 <= session.max_rewind)

    def first(self, ids, sampling, **extra):
        if self.speculator is not None:
            return self.speculator.start(ids, extra.get("should_stop"))
        return self.session.prefill(ids, sampling, **extra)

    def next(self, sampling, room: int, **extra):
        """The next id; ``room``: how many more ids the generation may still take."""
        if self.speculator is not None:
            self._queue = self._queue or self.speculator.round()
            return self._queue.pop(0)
        if self.round_tokens > 1 and not extra:
            if not self._queue:
                self._queue = self._next_round(sampling, room)
            if self._queue:
                return self._queue.pop(0)
        return self.session.step(sampling, **extra)

    def _next_round(self, sampling, room: int) -> list:
        session = self.session
        if not self.pipelined:
            return session.decode_round(min(self.round_tokens, room), sampling)
        current, count = self._ahead, self._ahead_count
        if current is None:
            before = session.position
            current = session.submit_round(min(self.round_tokens, room), sampling)
            count = session.position - before
        self._ahead, self._ahead_count = None, 0
        if current is not None and room > count:  # the next round goes in before this one is read
            before = session.position
            self._ahead = session.submit_round(min(self.round_tokens, room - count), sampling)
            self._ahead_count = session.position - before
        return session.collect_round(current)

    @property
    def pending(self) -> int:
        """Ids run on the GPU that the generation has not taken yet (queued or in a round ahead)."""
        return len(self._queue) + self._ahead_count

    def finish(self) -> None:
        """Take back the steps of rounds the generation did not use."""
        if self.speculator is None and self.pending:
            self.session.rewind(self.session.position - self.pending)
        self._queue, self._ahead, self._ahead_count = [], None, 0


def decode(steps: Steps, ids: list, out: Decoded, *, sampling, budget: int, stop_ids, decoder=None,
           matcher=None, should_stop=None, top_logprobs=None):
    """Prefill ``ids`` and decode up to ``budget`` ids, yielding a ``TokenEvent`` per id (and
    one last event for held-back text); ``out`` is filled as it runs.

    ``decoder``: the tokenizer's ``StreamDecoder`` for the reply, made with the request's stop
    strings (it holds back a possible stop string's start and reports ``stopped``); None for a
    model without a tokenizer (no text). ``matcher``: a grammar matcher whose mask constrains
    every sampled id (the answer must also end within the budget). ``should_stop(done, total)``
    is asked before each prefill chunk and each decode step. ``top_logprobs``: a count (0-20)
    for ``out.logprobs``, or None for no logprobs.
    """
    session = steps.session
    if budget <= 0 or matcher is not None and not matcher.fits(budget):
        out.finish_reason = "length"
        if budget > 0:
            out.notices.append(f"no reply of the grammar fits in {budget} tokens")
        return
    masking = 0.0

    def mask(room: int):
        nonlocal masking
        started_mask = time.perf_counter()
        bits = matcher.mask(room)
        masking += time.perf_counter() - started_mask
        return bits

    extra = {}  # what the session takes only when asked (a family's session need not take them otherwise)
    if top_logprobs is not None:
        extra["top_logprobs"], out.logprobs = top_logprobs, []
    first_extra = dict(extra)
    if should_stop is not None:
        first_extra["should_stop"] = should_stop
    started = time.perf_counter()
    if matcher is not None:
        first_extra["mask"] = mask(budget)
    next_id = steps.first(ids, sampling, **first_extra)
    first = time.perf_counter()
    out.prefill_s = first - started
    if next_id is None:  # should_stop said so between prefill chunks
        out.finish_reason = "stopped"
        return
    out.finish_reason, out.sampled = "length", True
    produced = 0
    try:
        while True:
            if top_logprobs is not None:
                next_id, logprob = next_id
            if matcher is not None:
                matcher.accept(next_id)
            if next_id in stop_ids:
                out.finish_reason = "eos"
                break
            out.ids.append(next_id)
            if top_logprobs is not None:
                out.logprobs.append(logprob.as_dict())
            piece = decoder.push(next_id) if decoder is not None else ""
            out.text += piece
            produced += 1
            yield TokenEvent(next_id, piece)
            if decoder is not None and decoder.stopped:
                out.finish_reason = "stop"
                break
            if produced >= budget or session.position - steps.pending >= session.context:
                break
            if should_stop is not None and should_stop(produced, budget):
                out.finish_reason = "stopped"
                break
            step = dict(extra)
            if matcher is not None:
                step["mask"] = mask(budget - produced)  # the answer ends (EOS) within the budget
            next_id = steps.next(sampling, budget - produced, **step)
    finally:
        steps.finish()
        elapsed = time.perf_counter() - first
        out.decode_tokens_per_s = (produced - 1) / elapsed if produced > 1 and elapsed > 0 else 0.0
        if matcher is not None:
            out.timings["mask_s"] = masking
    tail = decoder.finish() if decoder is not None else ""
    if tail:
        out.text += tail
        yield TokenEvent(None, tail)
