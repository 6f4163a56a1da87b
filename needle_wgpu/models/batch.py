"""Decode steps of several sessions of one model in one plan and one submit (continuous
batching).

The weight matmuls run once over the batch's rows; what belongs to one sequence runs per row,
from that session's own state: its token and position (the embedding gather reads its
``tokens`` at its ``step_uniform``), its K/V cache (qk_rope and attention), and its sampler
(its sampling values, seed, penalties over its own ids, its mask, its ``tokens`` and
``result``). Every op a row goes through computes that row with a solo decode step's
arithmetic (the matmuls keep the per-position GEMV; the per-sequence ops run at T = 1), so a
sequence's ids are the same in any batch as alone (``tests/gpu/test_batch.py``).

A family provides ``GpuModel.batch(rows)``: a ``DecodeBatch`` subclass that builds its kinds
of pieces (lists of dispatches), each once: ``_shared(B, ...)`` the rows' common work for a
batch of B (its ``attend`` callback marks where each layer's per-sequence work goes),
``_row(session, b)`` what row b does as that session (before the layers, then per layer),
``_group(slab, page, B, layer)`` a layer's work that the rows whose caches share a page of the
batch's ``KvSlab`` do together (``groups_rows``; the dense family: qk_rope and attention, one
dispatch each; Needle 3: attention), and ``_sample(...)`` each row's sampler. A composition (``BatchKey``) is these pieces put in order, so
a sequence that joins or leaves costs no new pipeline or bind group once its pieces exist; the
assembled plans are cached too (bounded, least recently used out).

Before each step the batch writes its ``sequences`` table (a uniform, 16 bytes a row: the row's
position, and its slot and page in a ``KvSlab``, ``attention.Sequences``), which the grouped
pieces read; ``session(context, kv)`` makes the sessions a pool hands to the batch (their caches
in the batch's slab).
"""

from __future__ import annotations

import collections
import struct
from dataclasses import dataclass

from ..errors import ContextFullError, InputError
from ..gpu.device import Binding, Device, Plan, UniformArena, recording
from ..kernels import sample as sample_ops
from ..kernels.attention import NO_PAGE, KvSlab
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
    """Scratch rows for up to ``capacity`` sequences and the cached batched plans. A family's
    subclass sets ``device``, ``capacity``, ``logit_rows`` and ``logits`` (f32
    [capacity][logit_rows]), calls ``_start`` and builds the pieces (``_shared``, ``_row``;
    ``_layers``: how many layers have per-row work)."""

    device: Device
    capacity: int
    logit_rows: int
    logits: object
    # a family whose sessions made by ``session`` keep their caches in the batch's ``KvSlab``, and
    # whose rows of a slab page attend in one dispatch a layer (``_group``)
    groups_rows = False

    def _start(self) -> None:
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._owned: list = []
        with recording(self._owned):
            self.results = self.device.buffer(16 * self.capacity, label="batch_results", kind="session")
            # per row: position, slot in its KvSlab page, page (NO_PAGE: none), 0
            self.sequences = self.device.buffer(16 * self.capacity, label="batch_sequences", usage="uniform",
                                                kind="session")
        self._shared_pieces: dict = {}  # B -> (dispatches, where each layer's per-row work goes, their arena)
        # each with the buffers its pieces own (their parameters), freed when ``forget`` drops it:
        self._rows: dict = {}  # (session, row) -> ([before the layers, then one list per layer], owned)
        self._samplers: dict = {}  # (session, row, sampling, masked) -> (the sampler's dispatches, owned)
        self._slab = None  # the KvSlab of the sessions this batch made (one kind at a time)
        self._next_page = 0  # page ids of the next slab: no two of this batch's slabs share one
        self._groups: dict = {}  # (slab, page, B) -> (the page's buffers, per layer its dispatches, their arena)
        self.plans_built = 0

    # ---------------------------------------------------------------- a family's pieces
    def _shared(self, plan: Plan, arena: UniformArena, B: int, attend) -> None:
        """Add the common work of B rows to ``plan``; call ``attend(plan, arena, layer, ...)``
        where each layer's per-row work goes (it records the place)."""
        raise NotImplementedError

    def _row(self, plan: Plan, arena: UniformArena, session, b: int, layer: int | None) -> None:
        """Add what row ``b`` does as ``session``: before the layers (``layer`` None), or in
        ``layer`` (the shared pieces of some B were built first)."""
        raise NotImplementedError

    def _sample(self, plan: Plan, arena: UniformArena, row: BatchRow, b: int) -> None:
        """Row ``b``'s sampler over its logits row, with its session's settings, seed and mask
        (the same for every family: the sampler reads only the session's step, tokens, result)."""
        session, rows = row.session, self.logit_rows
        sample_ops.sample(plan, arena, Binding(session.step_uniform), logits=self.logits, logits_offset=b * rows,
                          rows=rows, tokens=session.tokens, result=session.result, context=session.context,
                          positions=1, sampling=row.sampling, mask=session.mask if row.masked else None)

    def _layers(self) -> int:
        raise NotImplementedError

    def _group(self, plan: Plan, arena: UniformArena, slab, page: int, B: int, layer: int) -> None:
        """Layer ``layer``'s work of the rows whose caches are in page ``page`` of ``slab``, in one
        dispatch each (``groups_rows``; after the rows' own pieces of the layer)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- the slab
    def session(self, context=None, kv=None):
        """A session of the batch's model for the pool that feeds it: with ``groups_rows``, its
        caches in this batch's slab when it is of the slab's kind (context, chunk, mode) and the
        slab has a free slot, or when no session holds a slot (a new slab of its kind); else one
        of its own buffers. A slab session's rows attend with the others of its page."""
        if not self.groups_rows:
            return self.model.session(context=context, kv=kv)
        return self.model.session(context=context, kv=kv, slabs=self.slab_for)

    def slab_for(self, shapes: list, context: int, chunk: int, mode: str):
        """The slab for a session of this kind, or None (another kind's slab holds sessions, or
        it is full): so at most ``capacity`` sequences of one kind are allocated ahead."""
        slab = self._slab
        if slab is not None and not slab.taken and (slab.context, slab.chunk, slab.mode) != (context, chunk, mode):
            slab = self._slab = None  # empty (its memory already given back): the new kind's instead
        if slab is None:
            slab = self._slab = KvSlab(self.device, shapes, context, chunk, mode, self.capacity,
                                       name=f"kv_slab.{context}.{mode}", first_page=self._next_page)
            self._next_page += self.capacity
        if (slab.context, slab.chunk, slab.mode) != (context, chunk, mode) or len(slab.taken) >= slab.capacity:
            return None
        return slab

    def idle_slots(self) -> int:
        """Sequences' worth of KV memory the batch's slab holds for sessions not open (its
        pages' free slots)."""
        return 0 if self._slab is None else self._slab.idle_slots

    def idle_bytes(self) -> int:
        """The bytes of those slots."""
        return 0 if self._slab is None else self._slab.idle_slots * self._slab.slot_bytes

    def _slot(self, session) -> tuple | None:
        """(slot in its page, page id) of a session in this batch's slab; None for any other
        (its own buffers, or another batch's slab: attended on its own)."""
        slab = session.slab
        if slab is None or slab is not self._slab or session.slot is None:
            return None
        return slab.place(session.slot)

    def _grouped(self, rows: tuple, B: int) -> list | None:
        """Per layer, the family's ``_group`` once for each slab page the rows' caches are in
        (None: no row's is)."""
        pages = list(dict.fromkeys(self._slot(row.session)[1] for row in rows if self._slot(row.session)))
        if not pages:
            return None
        for key in [key for key, held in self._groups.items() if key[0].page_buffers(key[1]) is not held[0]]:
            del self._groups[key]  # a page given back (and maybe made anew): its dispatches bind freed buffers
        slab, layers = self._slab, [[] for _ in range(self._layers())]
        for page in pages:
            held = self._groups.get((slab, page, B))
            if held is None:  # its own arena, released with it
                arena, pieces = UniformArena(self.device, capacity=1 << 16, label=f"uniforms.batch{B}.page{page}"), []
                for layer in range(self._layers()):
                    plan = Plan(self.device, f"batch B={B} page {page}")
                    self._group(plan, arena, slab, page, B, layer)
                    pieces.append(plan.dispatches)
                held = self._groups[(slab, page, B)] = (slab.page_buffers(page), pieces, arena)
            for layer, dispatches in enumerate(held[1]):
                layers[layer] += dispatches
        return layers

    # ---------------------------------------------------------------- assembly
    def _build(self, key: BatchKey) -> Plan:
        B = len(key.rows)
        shared, marks = self._shared_for(B)
        rows = [self._row_pieces(row.session, b) for b, row in enumerate(key.rows)]
        grouped = self._grouped(key.rows, B)
        dispatches = [d for row in rows for d in row[0]]
        start = 0
        for layer, mark in enumerate(marks):
            dispatches += shared[start:mark]
            for row in rows:
                dispatches += row[1 + layer]
            if grouped is not None:  # after the rows' own work (Needle 3: each row's qkv_post)
                dispatches += grouped[layer]
            start = mark
        dispatches += shared[start:]
        for b, row in enumerate(key.rows):
            dispatches += self._sampler_pieces(row, b)
        plan = Plan(self.device, f"batch B={B}")
        plan.dispatches = dispatches
        return plan

    def _shared_for(self, B: int) -> tuple:
        held = self._shared_pieces.get(B)
        if held is None:
            arena = UniformArena(self.device, capacity=1 << 16, label=f"uniforms.batch{B}")
            plan, marks = Plan(self.device, f"batch B={B} shared"), []

            def attend(plan: Plan, arena: UniformArena, layer: int, *extra) -> None:
                marks.append(len(plan.dispatches))

            with recording(self._owned):
                self._shared(plan, arena, B, attend)
            held = self._shared_pieces[B] = (plan.dispatches, marks, arena)
        return held[0], held[1]

    def _row_pieces(self, session, b: int) -> list:
        held = self._rows.get((session, b))
        if held is None:
            pieces, owned = [], []
            with recording(owned):
                arena = UniformArena(self.device, capacity=1 << 14, label=f"uniforms.batch_row{b}")
                for layer in (None, *range(self._layers())):
                    plan = Plan(self.device, f"batch row {b}")
                    self._row(plan, arena, session, b, layer)
                    pieces.append(plan.dispatches)
            held = self._rows[(session, b)] = (pieces, owned)
        return held[0]

    def _sampler_pieces(self, row: BatchRow, b: int) -> list:
        key = (row.session, b, row.sampling, row.masked)
        held = self._samplers.get(key)
        if held is None:  # a request's sampling: its own parameters, freed with it
            owned, plan = [], Plan(self.device, f"batch sampler {b}")
            with recording(owned):
                self._sample(plan, UniformArena(self.device, capacity=1 << 12, label=f"uniforms.batch_sampler{b}"),
                             row, b)
            held = self._samplers[key] = (plan.dispatches, owned)
        return held[0]

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
        """Drop the plans and pieces that bind ``session``'s buffers (before it is closed)."""
        for key in [key for key in self._plans if any(row.session is session for row in key.rows)]:
            del self._plans[key]
        for cache in (self._rows, self._samplers):
            for key in [key for key in cache if key[0] is session]:
                self.device.free(cache.pop(key)[1])

    def step(self, requests: list) -> list:
        """One decode step of every request's session (``StepRequest``s, distinct sessions of this
        batch's model): one submit, one readback of the sampled ids. Returns per request what
        ``session.step`` returns: the id, or (id, ``TokenLogprob``) with ``top_logprobs``."""
        if not 0 < len(requests) <= self.capacity:
            raise InputError(f"a batched step takes 1 to {self.capacity} sequences, not {len(requests)}")
        if len({id(r.session) for r in requests}) != len(requests):
            raise InputError("a batched step advances each session once")
        dev, rows, table = self.device, [], bytearray()
        for request in requests:
            session = request.session
            session._check()
            if session.position >= session.context:
                raise ContextFullError(f"context of {session.context} positions is full")
            sampling = session_sampling(request.sampling, self.logit_rows, required=True)
            masked = session._write_mask(request.mask)
            dev.write(session.step_uniform, struct.pack("<4I", session.position, 0, 0, 0))
            at, page = self._slot(session) or (0, NO_PAGE)
            table += struct.pack("<4I", session.position, at, page, 0)
            rows.append(BatchRow(session, sampling, masked))
        dev.write(self.sequences, bytes(table))
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
        self._groups.clear()  # the slab goes with its sessions' slots
        for cache in (self._rows, self._samplers):
            for _, owned in cache.values():
                self.device.free(owned)
        for cache in (self._plans, self._shared_pieces, self._rows, self._samplers):
            cache.clear()
        self.device.free(self._owned)
        self._owned.clear()
