"""Continuous batching for the server: the ``scheduler.Scheduler``'s stepper
that advances every admitted request of a model in one batched decode step.

Each admitted job's body (the one generation loop, ``generation.decode``, through
``openai.chat_completion`` or ``Model.stream``: stop strings, budgets, masks, logprobs and finish
reasons as for any caller) runs on a thread of its own against a view of the model whose
sessions are ``pool.PooledSession``s. A pooled session does no GPU work itself: each prefill chunk,
decode step and other call is handed to the worker thread (the only one that touches the
device) and waits for its answer. Each ``step`` of the worker collects what every job asks,
once each job waits (or after ``HOST_WAIT_S``), and runs:

1. session calls (open, close, rewind-free work such as a verify) in arrival order;
2. prefill chunks of the jobs reading their prompts, oldest first, up to ``PREFILL_BUDGET``
   positions a step (at least one chunk) while other jobs decode, every waiting chunk when none
   does: a new request joins between decode steps without stalling the others for long;
3. one batched decode step of every job that asked for its next id: ``models.batch``, the
   matmuls once over the batch, each row's attention and sampler on its own session, so every
   id is the one the request gets alone. A model without a batched step (a fake, a geometry
   whose rows do not align) steps its sessions one after the other.

The KV memory is a pool of at most ``capacity`` sessions (``pool.SequencePool``): a finished or
cancelled request's session is rewound and reused by the next, and the scheduler admits no
more jobs than the pool holds (the rest wait in its bounded queue; past that, a 429 with
Retry-After). A job that is cancelled, disconnects or runs out of time gets a ``StoppedError``
in answer to its next call, so it leaves at the next step and its session returns to the pool.
"""

from __future__ import annotations

import copy
import logging
import threading
import time

from ..errors import ContextFullError, DeviceLostError, NeedleError, UnsupportedModelError
from .errors import error_of
from .pool import PooledGpu, SequencePool

log = logging.getLogger("needle_wgpu.server")

HOST_WAIT_S = 0.05  # how long a step waits for jobs still busy on the host before it runs without them
PREFILL_BUDGET = 64  # prompt positions read per step while other sequences decode (at least one chunk)


class StoppedError(NeedleError):
    """The job was cancelled (disconnect, time limit, shutdown): its next call ends it."""


class _Call:
    """One request of a job thread to the worker, and its answer."""

    __slots__ = ("kind", "job", "session", "args", "result", "error", "done")

    def __init__(self, kind: str, job, session, args: tuple):
        self.kind, self.job, self.session, self.args = kind, job, session, args
        self.result = self.error = None
        self.done = threading.Event()

    def answer(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class BatchingStepper:
    """Admits up to ``capacity`` jobs (the KV pool's sequences) and advances them together."""

    def __init__(self, finish, capacity: int = 8, reclaim=None, served=None):
        self.capacity = max(1, int(capacity))
        self.finish = finish  # finish(job, error or None): the scheduler's bookkeeping
        self.reclaim = reclaim  # frees one pool session held outside the jobs (the prefix cache's oldest)
        # the (context, kv) the model's requests decode at: their sessions are the batch's (its slab);
        # a session of another kind (an embedding's, sized to its input) is the model's own. None: any
        self.served = served
        self.active: list = []
        self.device_lost = False
        self.cond = threading.Condition()
        self.calls: list = []  # _Call, in arrival order
        self.ended: list = []  # (job, error) of job threads that returned
        self.waiting: set = set()  # jobs whose thread waits for an answer
        self.worker = None
        self.model = self.view = self.pool = self.batch = None
        self.steps = self.rows = 0  # batched steps run, rows advanced (rows / steps: the mean batch)

    # ------------------------------------------------------------------ the worker thread
    def sequences_in_use(self) -> int:
        """The pool's open sessions."""
        return self.pool.size if self.pool is not None else 0

    def idle_kv_bytes(self) -> int:
        """KV memory the model's batch holds for sessions not open: the free slots of the pages
        its pool's sessions are in."""
        return self.batch.idle_bytes() if self.batch is not None else 0

    def _bind(self, model) -> None:
        """The model's view, pool and batch (again after a reload: the old ones were on the
        lost device)."""
        if self.model is model:
            return
        self.model = model
        self.view = copy.copy(model)
        self.view.gpu = PooledGpu(model.gpu, self)
        try:
            self.batch = model.gpu.batch(self.capacity) if model.capabilities.batch else None
        except UnsupportedModelError as exc:  # a geometry the batched step does not take: one by one
            log.warning("model %s: %s", model.gpu.name, exc)
            self.batch = None
        self.pool = SequencePool(self._open, self.capacity, self.reclaim)

    def _open(self, context=None, kv=None):
        """A pool's new session: the batch's for the served kind (its rows attend together)."""
        if self.batch is not None and (self.served is None or (context, kv) == self.served):
            return self.batch.session(context=context, kv=kv)
        return self.model.gpu.session(context=context, kv=kv) if kv is not None else \
            self.model.gpu.session(context=context)

    def admit(self, job, model) -> None:
        self.worker = threading.current_thread()
        self._bind(model)
        job.started = time.monotonic()
        with self.cond:
            self.active.append(job)
        thread = threading.Thread(target=self._run_job, args=(job,), name=f"needle-wgpu request {id(job):x}",
                                  daemon=True)
        thread.start()

    def leave(self, job, error) -> None:
        """The scheduler's word that a job should stop: its thread ends at its next call."""
        job.cancel()
        with self.cond:
            self.cond.notify_all()

    def step(self) -> None:
        deadline = time.monotonic() + HOST_WAIT_S
        with self.cond:
            while self._busy() and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            if not self.calls and not self.ended and self.active and self._busy():
                self.cond.wait(HOST_WAIT_S)  # every job busy on the host: nothing to run yet
            calls, self.calls = self.calls, []
            ended, self.ended = self.ended, []
            for call in calls:  # answered before the next step: busy again until they ask anew
                self.waiting.discard(call.job)
        for job, error in ended:
            with self.cond:
                if job in self.active:
                    self.active.remove(job)
            self.finish(job, error)
        steps, chunks = [], []
        for call in calls:
            if call.kind != "close" and call.job is not None and call.job.stop_reason:
                call.answer(error=StoppedError("the request was stopped"))
            elif call.kind == "step":
                steps.append(call)
            elif call.kind == "chunk":
                chunks.append(call)
            else:
                self._run_call(call)
        if steps:  # decoding sequences wait for the prompts read meanwhile: a budget of positions
            budget, taken = PREFILL_BUDGET, 0
            while taken < len(chunks) and (taken == 0 or budget >= len(chunks[taken].args[0])):
                budget -= len(chunks[taken].args[0])
                taken += 1
            chunks, later = chunks[:taken], chunks[taken:]
            if later:
                with self.cond:  # the next step takes them first; their jobs still wait
                    self.calls[:0] = later
                    self.waiting.update(call.job for call in later)
        for call in chunks:
            self._guarded(call, lambda c=call: c.session.prefill(c.args[0], c.args[1], **c.args[2]))
        if steps:
            self._decode(steps)

    def _busy(self) -> bool:
        return any(job not in self.waiting for job in self.active) and not self.ended

    def _run_call(self, call: _Call) -> None:
        if call.kind == "open":
            context, kv, extra = call.args
            if extra:  # a session of another kind (Needle 3 heads, confidence): its own, not pooled
                self._guarded(call, lambda: self.model.gpu.session(context=context, kv=kv, **extra))
            else:
                self._guarded(call, lambda: self.pool.take(context, kv))
        elif call.kind == "close":
            try:
                if self.batch is not None:
                    self.batch.forget(call.session)
                if call.session in self.pool.in_use:
                    self.pool.give(call.session)
                else:
                    call.session.close()
            except BaseException as exc:  # noqa: BLE001  a lost device: the session is gone with it
                self.pool.in_use.discard(call.session)
                log.error("closing a session failed", exc_info=exc)
            call.answer()
        else:
            name, args, options = call.args
            self._guarded(call, lambda: getattr(call.session, name)(*args, **options))

    def _guarded(self, call: _Call, work) -> None:
        try:
            call.answer(work())
        except BaseException as exc:  # noqa: BLE001  the job's thread raises it
            self.device_lost = self.device_lost or isinstance(exc, DeviceLostError)
            call.answer(error=exc)

    def _decode(self, calls: list) -> None:
        """One batched step of every row that can take one (the batch's capacity at a time)."""
        ready = []
        for call in calls:
            session = call.session
            if session.position >= session.context:
                call.answer(error=ContextFullError(f"context of {session.context} positions is full"))
            else:
                ready.append(call)
        if self.batch is None:
            for call in ready:
                request = call.args[0]
                extra = {name: value for name, value in (("mask", request.mask), ("top_logprobs", request.top_logprobs))
                         if value is not None}
                self._guarded(call, lambda r=request, e=extra: r.session.step(r.sampling, **e))
            return
        for start in range(0, len(ready), self.capacity):
            group = ready[start : start + self.capacity]
            try:
                results = self.batch.step([call.args[0] for call in group])
            except BaseException as exc:  # noqa: BLE001  every row of the step gets the error
                self.device_lost = self.device_lost or isinstance(exc, DeviceLostError)
                for call in group:
                    call.answer(error=exc)
                continue
            self.steps += 1
            self.rows += len(group)
            for call, result in zip(group, results):
                call.answer(result)

    # ------------------------------------------------------------------ job threads
    def call(self, session, kind: str, *args):
        """Hand ``kind`` to the worker and wait for its answer (on the worker: run it now)."""
        job = getattr(_current, "job", None)
        request = _Call(kind, job, session, args)
        if threading.current_thread() is self.worker or job is None:
            self._run_call(request) if kind not in ("step", "chunk") else self._run_now(request)
        else:
            with self.cond:
                self.calls.append(request)
                self.waiting.add(job)
                self.cond.notify_all()
            request.done.wait()
            with self.cond:
                self.waiting.discard(job)
        if request.error is not None:
            raise request.error
        return request.result

    def _run_now(self, call: _Call) -> None:
        if call.kind == "chunk":
            self._guarded(call, lambda: call.session.prefill(call.args[0], call.args[1], **call.args[2]))
        else:
            self._decode([call])

    def post(self, session, kind: str) -> None:
        """Hand ``kind`` to the worker without waiting (a close)."""
        request = _Call(kind, getattr(_current, "job", None), session, ())
        if threading.current_thread() is self.worker:
            self._run_call(request)
            return
        with self.cond:
            self.calls.append(request)
            self.cond.notify_all()

    def _run_job(self, job) -> None:
        _current.job = job
        error = None
        events = job.body(self.view, job)
        try:
            for payload in events:
                if job.stop_reason:  # the engine stopped because it was asked to: no result
                    break
                job.deliver(("data", payload))
        except BaseException as exc:  # noqa: BLE001  the request fails, the worker goes on
            error = None if job.stop_reason else error_of(exc)
        finally:
            try:
                events.close()
            except BaseException as exc:  # noqa: BLE001
                log.error("closing a request failed", exc_info=exc)
        if job.stop_reason:
            error = job.stopped_error()
        with self.cond:
            self.ended.append((job, error))
            self.cond.notify_all()


_current = threading.local()
