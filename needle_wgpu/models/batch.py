"""Decode steps of several sessions of one model in one plan and one submit (continuous
batching, issue 19 item 2).

The weight matmuls run once over the batch's rows; what belongs to one sequence runs per row,
from that session's own state: its token and position (the embedding gather reads its
``tokens`` at its ``step_uniform``), its K/V cache (qk_rope and attention), and its sampler
(its sampling values, seed, penalties over its own ids, its mask, its ``tokens`` and
``result``). Every op a row goes through computes that row with a solo decode step's
arithmetic (the matmuls keep the per-position GEMV; the per-sequence ops run at T = 1), so a
sequence's ids are the same in any batch as alone (``tests/gpu/test_batch.py``).

A family provides ``GpuModel.batch(rows)``: a ``DecodeBatch`` subclass whose ``_build(key)``
is the batched forward for one composition (``BatchKey``). Plans are cached by composition:
a sequence that joins or leaves changes the key, and the plan of a composition seen before is
reused (bounded, least recently used out).
"""

from __future__ import annotations

import collections
import struct
from dataclasses import dataclass

from ..errors import ContextFullError, InputError
from ..gpu.device import Device, Plan, recording
from ..logprobs import row_values, token_logprob
from .session import ChunkedSession, session_sampling

MAX_CACHED_PLANS = 32


@dataclass(frozen=True)
class BatchRow:
    """One row of a batched step: the session it advances, its sampling (baked into the plan,
    as a solo step's) and whether its sampler reads the session's mask."""

    session: ChunkedSession
    sampling: object
    masked: bool = False


@dataclass(frozen=True)
class BatchKey:
    rows: tuple  # of BatchRow, in row order


@dataclass
class StepRequest:
    """What one sequence asks of a batched step: ``ChunkedSession.step``'s arguments."""

    session: ChunkedSession
    sampling: object
    mask: bytes | None = None
    top_logprobs: int | None = None


class DecodeBatch:
    """Scratch rows for up to ``capacity`` sequences and the cached batched plans. Subclasses set
    ``device``, ``capacity``, ``logit_rows``, ``logits`` (f32 [capacity][logit_rows]) and
    implement ``_build``."""

    device: Device
    capacity: int
    logit_rows: int
    logits: object

    def _start(self) -> None:
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._owned: list = []
        with recording(self._owned):
            self.results = self.device.buffer(16 * self.capacity, label="batch_results", kind="session")
        self.plans_built = 0

    def _build(self, key: BatchKey) -> Plan:
        raise NotImplementedError

    def _plan(self, key: BatchKey) -> Plan:
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = self._build(key)
            self.plans_built += 1
        self._plans[key] = plan
        while len(self._plans) > MAX_CACHED_PLANS:
            self._plans.popitem(last=False)  # its arena goes with it
        return plan

    def forget(self, session: ChunkedSession) -> None:
        """Drop the plans that bind ``session``'s buffers (before it is closed)."""
        for key in [key for key in self._plans if any(row.session is session for row in key.rows)]:
            del self._plans[key]

    def step(self, requests: list) -> list:
        """One decode step of every request's session (``StepRequest``s, distinct sessions of this
        batch's model): one submit, one readback of the sampled ids. Returns per request what
        ``session.step`` returns: the id, or (id, ``TokenLogprob``) with ``top_logprobs``."""
        if not 0 < len(requests) <= self.capacity:
            raise InputError(f"a batched step takes 1 to {self.capacity} sequences, not {len(requests)}")
        if len({id(r.session) for r in requests}) != len(requests):
            raise InputError("a batched step advances each session once")
        dev, rows = self.device, []
        for request in requests:
            session = request.session
            session._check()
            if session.position >= session.context:
                raise ContextFullError(f"context of {session.context} positions is full")
            sampling = session_sampling(request.sampling, self.logit_rows, required=True)
            masked = session._write_mask(request.mask)
            dev.write(session.step_uniform, struct.pack("<4I", session.position, 0, 0, 0))
            rows.append(BatchRow(session, sampling, masked))
        plan = self._plan(BatchKey(tuple(rows)))
        dev.run(plan, copies=[(r.session.result, 0, self.results, 16 * b, 16) for b, r in enumerate(rows)])
        ids = struct.unpack(f"<{4 * len(rows)}I", dev.read(self.results, 16 * len(rows)))[::4]
        out = []
        for b, (request, token) in enumerate(zip(requests, ids)):
            request.session.position += 1
            if request.top_logprobs is None:
                out.append(token)
                continue
            values = row_values(dev.read(self.logits, 4 * self.logit_rows, 4 * b * self.logit_rows),
                                self.logit_rows, request.mask)
            out.append((token, token_logprob(values, token, request.top_logprobs)))
        return out

    def close(self) -> None:
        self._plans.clear()
        self.device.free(self._owned)
        self._owned.clear()
