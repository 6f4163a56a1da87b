"""The KV pool of a model's batching stepper (``batching.BatchingStepper``) and the pooled
sessions the requests' threads see.

``SequencePool``: at most ``capacity`` sessions, kept open and reused (rewound) when a request
leaves. ``PooledGpu`` / ``PooledSession``: the model's GPU side as a request's thread sees it;
a pooled session does no GPU work itself but hands each prefill chunk, decode step and other
call to the worker thread (``stepper.call`` / ``stepper.post``) and waits for its answer.
"""

from __future__ import annotations

from ..models.batch import StepRequest


class SequencePool:
    """The model's KV memory: at most ``capacity`` sessions, kept open and reused. Only the
    worker thread calls it. ``opener(context=, kv=)`` makes a session (the stepper's: the
    batch's for the served kind, ``DecodeBatch.session``, whose caches the dense family keeps in
    the batch's slab so that its rows attend in one dispatch; else the model's)."""

    def __init__(self, opener, capacity: int, reclaim=None):
        self.opener, self.capacity, self.reclaim = opener, capacity, reclaim
        self.free: list = []  # (key, session), least recently freed first
        self.in_use: set = set()

    @property
    def size(self) -> int:
        return len(self.free) + len(self.in_use)

    def take(self, context, kv):
        key = (context, kv)
        session = self._reuse(key)
        if session is None and self.size >= self.capacity and self.reclaim is not None:
            self.reclaim()  # a prefix-cache entry holds one: the oldest gives it back
            session = self._reuse(key)
        if session is None:
            if self.size >= self.capacity and self.free:
                self.free.pop(0)[1].close()  # another context or kv mode: its memory goes to this one
            session = self.opener(context=context, kv=kv)
            session.pool_key = key
        self.in_use.add(session)
        return session

    def _reuse(self, key):
        for i, (held, session) in enumerate(self.free):
            if held == key:
                del self.free[i]
                if session.restartable:
                    session.rewind(0)
                    return session
                session.close()  # state that cannot start over (probe pools): a fresh one instead
                return None
        return None

    def give(self, session) -> None:
        self.in_use.discard(session)
        if self.size < self.capacity and not getattr(session, "_closed", getattr(session, "closed", False)):
            self.free.append((session.pool_key, session))
        else:
            session.close()

    def close(self) -> None:
        for _, session in self.free:
            session.close()
        self.free = []


class PooledGpu:
    """The model's GPU side as a job thread sees it: what it does not override is the model's
    own (geometry, tokenizer, chat rules, describe); ``session`` returns a ``PooledSession``."""

    def __init__(self, gpu, stepper):
        self._gpu, self._stepper = gpu, stepper

    def __getattr__(self, name):
        return getattr(self._gpu, name)

    def session(self, context=None, kv=None, **extra):
        return PooledSession(self._stepper, self._stepper.call(None, "open", context, kv, extra))


class PooledSession:
    """A session whose GPU work runs on the worker: prefill chunk by chunk, ``step`` in the
    batched step; attributes (position, context, rewindable ...) are the session's own."""

    def __init__(self, stepper, session):
        self._stepper, self._session = stepper, session

    def __getattr__(self, name):
        attribute = getattr(self._session, name)
        if callable(attribute):  # any other method (verify, draft, all_logits ...) on the worker
            return lambda *args, **options: self._stepper.call(self._session, "method", name, args, options)
        return attribute

    def prefill(self, ids, sampling=None, mask=None, should_stop=None, top_logprobs=None):
        """``ChunkedSession.prefill``, one chunk per worker step (the same chunks as alone)."""
        session = self._session
        ids = list(ids)
        extra = {} if top_logprobs is None else {"top_logprobs": top_logprobs}
        if sampling is not None and mask is not None:
            extra["mask"] = mask
        if not ids or not hasattr(session, "chunk"):  # nothing to run, or a session that chunks alone
            if should_stop is not None:
                extra["should_stop"] = should_stop
            return self._stepper.call(session, "chunk", ids, sampling, extra)
        start = 0
        while True:
            if should_stop is not None and should_stop(start, len(ids)):
                return None
            length = min(session.chunk, session.device.prefill_chunk or session.chunk)
            part = ids[start : start + length]
            start += len(part)
            if start < len(ids):
                self._stepper.call(session, "chunk", part, None, {})
                continue
            return self._stepper.call(session, "chunk", part, sampling, extra)

    def step(self, sampling, mask=None, top_logprobs=None):
        return self._stepper.call(self._session, "step", StepRequest(self._session, sampling, mask, top_logprobs))

    def decode_round(self, count, sampling):
        """A round of one step (a batched step is the round): ``generation.Steps`` asks again."""
        if count <= 0 or self._session.position >= self._session.context:
            return []
        return [self.step(sampling)]

    def submit_round(self, count, sampling):
        """A pipelined round (``generation.Steps``) is one batched step, run when it is
        collected: nothing runs ahead of the batch, so nothing is taken back."""
        return None if count <= 0 else sampling

    def collect_round(self, submitted) -> list:
        if submitted is None or self._session.position >= self._session.context:
            return []
        return [self.step(submitted)]

    def rewind(self, position) -> None:
        self._session.rewind(position)  # host state only; the job's thread owns it between calls

    def close(self) -> None:
        self._stepper.post(self._session, "close")
