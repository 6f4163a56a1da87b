"""One scheduler per served model: a bounded queue in front of a worker thread that owns the
model's GPU (the model is loaded on that thread, and every wgpu call of it is made there).

The HTTP layer only ever calls ``Scheduler.submit(job)`` and ``Job.cancel``, and reads the
job's events (handed to ``Job.deliver``: ``("data", payload)`` ... then ``("end", None)`` or
``("error", ApiError)``). How the worker advances its jobs is the stepper's business:
``batching.BatchingStepper`` advances every admitted sequence by one token per step, in one
batched decode step (its ``capacity``: the KV pool's sequences, ``Limits.max_sequences``).

A job ends early, at its next step (or the engine's next ``should_stop`` question, asked before
each prefill chunk and each decode step), when its client disconnects, when its time limit
passes, or when the server shuts down; a job that ends early never delivers a result.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import DeviceLostError
from .batching import BatchingStepper
from .errors import ApiError, cancelled, error_of, queue_full, shutting_down, timed_out
from .prefix_cache import PrefixCache

log = logging.getLogger("needle_wgpu.server")

CANCELLED, TIMEOUT, SHUTDOWN = "cancelled", "timeout", "shutdown"


@dataclass(eq=False)
class Job:
    """One request's work. ``body(model, job)`` is a generator of payloads (the chunks of a
    stream, or the one response of a request that is not streamed), run on the worker thread.
    ``deliver(event)`` hands an event to the waiting client; it must not block."""

    endpoint: str
    body: Callable
    deliver: Callable
    time_limit_s: float
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    stop_reason: str | None = None
    usage: dict = field(default_factory=dict)  # what the body reports for the metrics
    prefix_cache: object = None  # the model's ``PrefixCache``, handed to the body when admitted
    finished: bool = False

    @property
    def deadline(self) -> float:
        return self.submitted + self.time_limit_s

    def cancel(self, reason: str = CANCELLED) -> None:
        """Ask the job to end at its next step (any thread)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def should_stop(self, done=None, total=None) -> bool:
        """The engine's ``should_stop``: asked before each prefill chunk and decode step."""
        if self.stop_reason is None and time.monotonic() > self.deadline:
            self.stop_reason = TIMEOUT
        return self.stop_reason is not None

    def stopped_error(self) -> ApiError:
        return {TIMEOUT: timed_out(self.time_limit_s), SHUTDOWN: shutting_down()}.get(self.stop_reason, cancelled())


class Scheduler:
    """A model's queue and worker thread. ``load()`` (called on the worker) returns the
    ``api.Model``; ``kv_bytes`` is then one sequence's KV cache in bytes (for the metrics)."""

    def __init__(self, name: str, load: Callable, *, max_queue: int, metrics=None, probe_kv: Callable = None,
                 prefix_cache_bytes: int = 0, max_sequences: int = 8, served=None):
        self.name, self.load, self.max_queue, self.metrics = name, load, max_queue, metrics
        self.probe_kv = probe_kv
        self.prefix_cache = PrefixCache(prefix_cache_bytes)  # the worker thread's alone
        self.model = None
        self.load_error: BaseException | None = None
        self.kv_bytes = 0
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.finish_lock = threading.Lock()
        self.stepper = BatchingStepper(self._finish, max_sequences, reclaim=self.prefix_cache.evict_oldest,
                                       served=served)  # (context, kv) of the model's chats and completions
        self.accepting, self.stopping = True, False
        self.ready = threading.Event()
        self.mean_request_s = 1.0  # for Retry-After: a running average of request time
        self.thread = threading.Thread(target=self._run, name=f"needle-wgpu model {name}", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise the 429 (queue full) / 503 (shutting down) it gets instead."""
        with self.cond:
            if not self.accepting:
                raise shutting_down()
            if len(self.queue) >= self.max_queue:
                wait = (len(self.queue) + len(self.stepper.active)) * self.mean_request_s / self.stepper.capacity
                raise queue_full(self.name, wait)
            self.queue.append(job)
            self.cond.notify()

    def cancel(self, job: Job, reason: str = CANCELLED) -> None:
        """End a job: at once if it is still waiting, else at its next step."""
        with self.cond:
            job.cancel(reason)
            waiting = job in self.queue
            if waiting:
                self.queue.remove(job)
            self.cond.notify()
        if waiting:
            self._finish(job, job.stopped_error())

    def gauges(self) -> dict:
        with self.cond:
            active = len(self.stepper.active)
            held = self.stepper.sequences_in_use()  # the pool's open sessions
            return {"queue_depth": len(self.queue), "active_sequences": active,
                    "kv_bytes_in_use": active * self.kv_bytes,
                    "kv_pool_bytes": held * self.kv_bytes + self.stepper.idle_kv_bytes(),
                    "kv_pool_sequences": self.stepper.capacity, "prefix_cache_bytes": self.prefix_cache.cached_bytes()}

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new jobs, end the queued ones (503), and give the running ones ``grace_s``
        seconds to finish before they end with an error chunk."""
        with self.cond:
            self.accepting = False
            waiting, self.queue = list(self.queue), collections.deque()
            timer = threading.Timer(grace_s, self._end_running)
            timer.daemon = True
            timer.start()
            self.cond.notify()
        for job in waiting:
            job.cancel(SHUTDOWN)
            self._finish(job, shutting_down())

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down now (running jobs end with an error) and wait for the worker."""
        self.begin_shutdown(0.0)
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout)

    def _end_running(self) -> None:
        with self.cond:
            for job in list(self.stepper.active):
                job.cancel(SHUTDOWN)
            self.cond.notify()

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        try:
            self.model = self.load()
            if self.probe_kv is not None:
                self.kv_bytes = self.probe_kv(self.model)
                self.prefix_cache.entry_bytes = self.kv_bytes
        except BaseException as exc:  # noqa: BLE001  reported by the server's start-up
            self.load_error = exc
            self.ready.set()
            return
        self.ready.set()
        while True:
            with self.cond:
                while not self.queue and not self.stepper.active and not self.stopping:
                    self.cond.wait()
                if self.stopping and not self.queue and not self.stepper.active:
                    return
                admitted = []
                while self.queue and len(self.stepper.active) + len(admitted) < self.stepper.capacity:
                    admitted.append(self.queue.popleft())
                stale = [job for job in self.stepper.active if job.should_stop()]
            if admitted and self.stepper.device_lost and not self.stepper.active:
                self._reload()
            for job in admitted:
                if job.should_stop():  # cancelled or out of time while it waited
                    self._finish(job, job.stopped_error())
                elif self.stepper.device_lost:
                    self._finish(job, error_of(DeviceLostError("the GPU device was lost and the model could not be "
                                                               "loaded again")))
                else:
                    job.prefix_cache = self.prefix_cache
                    self.stepper.admit(job, self.model)
            for job in stale:
                self.stepper.leave(job, job.stopped_error())
            self.stepper.step()

    def _reload(self) -> None:
        """After a lost device, the model again on a new one (the next request's first step)."""
        log.warning("model %s: the device was lost, loading the model again", self.name)
        self.prefix_cache.clear()  # its sessions were on the lost device
        try:
            self.model = self.load()
            self.stepper.device_lost = False
        except BaseException as exc:  # noqa: BLE001  the requests get a 503 and the next one tries again
            log.error("model %s: loading it again failed: %s", self.name, exc)

    def _finish(self, job: Job, error: ApiError | None) -> None:
        with self.finish_lock:  # the worker and a cancelling client may both get here
            if job.finished:
                return
            job.finished = True
        job.deliver(("error", error) if error is not None else ("end", None))
        elapsed = time.monotonic() - (job.started or job.submitted)
        if job.started is not None:
            self.mean_request_s = 0.8 * self.mean_request_s + 0.2 * elapsed
        if self.metrics is not None:
            usage = job.usage
            self.metrics.finished(self.name, job.endpoint, "ok" if error is None else (error.code or str(error.status)),
                                  usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                                  usage.get("ttft_s"), usage.get("per_token_s"), usage.get("cached_tokens", 0))

