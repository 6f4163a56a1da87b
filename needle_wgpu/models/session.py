"""The session driver every model family shares: context clamp, plan cache, chunked prefill,
the decode step and the sampled-id readback (docs/gpu-layout.md).

A family's session subclasses ``ChunkedSession``, allocates its cache and scratch for a fixed
context and chunk length, and implements ``_build(key)``: the forward of one chunk as a
prebuilt ``Plan``. Everything that decides *when* a plan runs lives here, once.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

from ..errors import ContextFullError, InputError, NeedleError, UnsupportedModelError
from ..gpu.device import Buffer, Device, Plan, recording
from ..inputs import callback_or_none, checked_methods, id_list
from ..logprobs import row_values, token_logprob
from ..sampling import Sampling, clamp_count, saturate_ids


@dataclass(frozen=True)
class PlanKey:
    """What a prebuilt plan depends on besides the session's buffers."""

    positions: int  # the chunk length T (1 for a decode step)
    sample: Sampling | None = None  # sample after the chunk's last position (values are baked in)
    all_logits: bool = False  # the head over every position of the chunk, not only the last
    mask: bool = False  # the sampler reads the session's ``mask`` buffer (constrained decoding)
    every_position: bool = False  # with all_logits: sample after every position (speculative verify)


GREEDY = Sampling()
MAX_PLANS = 24  # a session's cached plans (chunk lengths, samplings, options), least recently used out


def clamp_context(context, limit: int) -> int:
    """A requested context as a whole number of positions in [1, limit]: fractions truncate;
    None, NaN, ±inf and what is not a number give ``limit`` (``sampling.clamp_count``)."""
    return clamp_count(context, 1, limit, limit)


def session_ids(ids) -> list:
    """The low-level API's ids under the engine's rule: any iterable, each item a u32."""
    return saturate_ids(id_list(ids))[0]


def session_sampling(sampling, rows: int, required: bool) -> Sampling | None:
    """A ``Sampling`` (top_k clamped to the head's rows), or None where none is asked for."""
    if sampling is None and not required:
        return None
    if not isinstance(sampling, Sampling):
        raise InputError(f"sampling must be a Sampling (Sampling.saturate(...)), got {type(sampling).__name__}")
    return sampling.for_vocab(rows)


@checked_methods
class ChunkedSession:
    """One conversation's state on the GPU and the cached plans that advance it.

    Subclasses set, before use: ``device``, ``context``, ``chunk`` (the longest prefill chunk),
    ``logit_rows``, and the buffers ``step_uniform`` (16-byte uniform: pos0), ``tokens``
    (u32 [context + 1]: ids by absolute position; the sampler writes the next id there),
    ``result`` (the sampler's 16 bytes) and ``logits`` (f32 [chunk][logit_rows]).
    """

    device: Device
    context: int
    chunk: int
    logit_rows: int
    rewindable: bool = False  # a family sets it where every layer's cache keeps each position
    max_rewind: int = 0  # else: how many recent positions its caches can still step back over
    # Whether rewind(0) may start it over whatever its position: every ring (sliding windows,
    # convolution rows) is read by position and nothing before position 0 is ever read, so a
    # new sequence never sees the old one. False where a family keeps state that is not by
    # position (Needle 3's probe pools).
    restartable: bool = True
    # the batch's ``KvSlab`` holding this session's caches (``DecodeBatch.session``) and its slot
    slab = None
    slot = None
    supports_verify = False  # a family whose plans honour ``PlanKey.every_position``
    supports_mask = False  # a family whose plans pass ``self.mask`` to the sampler when key.mask

    def __init_subclass__(cls, **kwargs):
        """A family's ``__init__`` records the buffers it makes (``gpu.device.recording``): the
        session owns them, and ``close`` frees them (one that fails half-way frees them at once)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def recorded(self, *args, **options):
            owned = self.__dict__.setdefault("_owned", [])
            try:
                with recording(owned):
                    init(self, *args, **options)
            except BaseException:
                device = getattr(self, "device", None)
                if device is not None:
                    device.free(owned)
                raise

        cls.__init__ = recorded

    def _open(self, device: Device, context, limit: int) -> None:
        self.device = device
        self.context = clamp_context(context, limit)
        self.position = 0
        self._plans: dict = {}  # PlanKey -> (plan, the buffers it owns), least recently used first
        self._closed = False
        self._owned = self.__dict__.get("_owned", [])  # the buffers close() frees
        self.step_uniform = device.buffer(16, label="step", usage="uniform", kind="session")
        self.tokens = device.buffer(4 * (self.context + 1), label="tokens", kind="session")
        self.result = device.buffer(16, label="sampled", kind="session")
        self.mask = None  # constrained decoding: the allowed-id bitmask, made at its first use
        self.round_records = None  # a multi-token round's step records (pos0 each), made at its first use

    def _build(self, key: PlanKey) -> Plan:
        """The family's forward of one chunk (``key.positions`` positions from pos0)."""
        raise NotImplementedError

    def _take_slot(self, slab) -> list:
        """A slot of a batch's ``slab`` for this session's caches, returned by layer: the last
        step of a family's ``__init__`` (a failure before it holds no slot); ``close`` gives it
        back, once."""
        self.slab, self.slot = slab, slab.take()
        return slab.caches(self.slot)

    def _plan(self, key: PlanKey) -> Plan:
        """The cached plan of ``key``, built at its first use. At most ``MAX_PLANS`` are kept: a
        long-lived session (a server's pooled one, a conversation) meets a new sampling, with
        its values baked into its plans, at every request, so the least recently used plan goes,
        and the buffers it owns (its uniform arena, a logit-bias table) with it."""
        held = self._plans.pop(key, None)
        if held is None:
            owned: list = []
            with recording(owned):
                held = (self._build(key), owned)
        self._plans[key] = held
        while len(self._plans) > MAX_PLANS:
            _, dropped = self._plans.pop(next(iter(self._plans)))
            self.device.free(dropped)
        return held[0]

    def _check(self) -> None:
        if self._closed:
            raise NeedleError("this session is closed")

    def _write_mask(self, mask) -> bool:
        """Upload the allowed-id bitmask (one queue write, before the step's one submit)."""
        if mask is None:
            return False
        if not self.supports_mask:
            raise UnsupportedModelError("this model family's sampler takes no constrained-decoding mask")
        size = 4 * (-(-self.logit_rows // 32))
        if not isinstance(mask, (bytes, bytearray)) or len(mask) != size or not any(mask):
            raise InputError(f"mask: expected {size} bytes allowing at least one id")
        if self.mask is None:
            with recording(self._owned):
                self.mask = self.device.buffer(size, label="mask", kind="session")
        self.device.write(self.mask, bytes(mask))
        return True

    def _run_chunk(self, ids: list, sample: Sampling | None, all_logits: bool = False, mask=None,
                   every_position: bool = False) -> None:
        T = len(ids)
        if self.position + T > self.context:
            raise ContextFullError(f"context of {self.context} positions is full")
        dev = self.device
        masked = self._write_mask(mask)
        dev.write(self.tokens, struct.pack(f"<{T}I", *ids), 4 * self.position)
        dev.write(self.step_uniform, struct.pack("<4I", self.position, 0, 0, 0))
        dev.run(self._plan(PlanKey(T, sample, all_logits, masked, every_position)))
        self.position += T

    def prefill(self, ids: list, sampling: Sampling | None = None, mask=None, should_stop=None, top_logprobs=None):
        """Run the prompt in chunks; with ``sampling``, return the id sampled after the last one
        (with ``mask``, a bitmask of ``ceil(logit_rows / 32)`` u32 words: only allowed ids).
        With ``top_logprobs`` (a count, 0 to 20): return (id, ``logprobs.TokenLogprob``) instead,
        from one readback of the sampled row (``needle_wgpu.logprobs``).

        ``should_stop(done, total)``, if given, is called before each chunk with the positions
        prefilled so far and the prompt's length; a true answer ends the prefill there and
        returns None (the positions already run stay in the cache). A chunk is at most
        ``chunk`` positions, or the device's ``prefill_chunk`` where that is lower.
        """
        self._check()
        ids, sampling = session_ids(ids), session_sampling(sampling, self.logit_rows, required=False)
        callback_or_none(should_stop, "should_stop")
        if not ids:
            return None
        start = 0
        while start < len(ids):
            if should_stop is not None and should_stop(start, len(ids)):
                return None
            length = min(self.chunk, self.device.prefill_chunk or self.chunk)  # may change between chunks
            part = ids[start : start + length]
            start += len(part)
            last = start >= len(ids)
            self._run_chunk(part, sampling if last else None, mask=mask if last and sampling else None)
        if sampling is None:
            return None
        return self._read_sampled(top_logprobs, mask)

    def step(self, sampling: Sampling, mask=None, top_logprobs=None):
        """Feed the last sampled id (already in ``tokens`` on the GPU) and sample the next (with
        ``mask``: among the allowed ids only; still one submit). The read back is the id's 4
        bytes; with ``top_logprobs`` (0 to 20) also the row: (id, ``TokenLogprob``)."""
        self._check()
        sampling = session_sampling(sampling, self.logit_rows, required=True)
        if self.position >= self.context:
            raise ContextFullError(f"context of {self.context} positions is full")
        dev = self.device
        masked = self._write_mask(mask)
        dev.write(self.step_uniform, struct.pack("<4I", self.position, 0, 0, 0))
        dev.run(self._plan(PlanKey(1, sampling, mask=masked)))
        self.position += 1
        return self._read_sampled(top_logprobs, mask)

    def rewind(self, position: int) -> None:
        """Forget every position from ``position`` on: the next prefill continues there (a
        conversation whose re-rendered history differs from what the cache holds). Attention
        reads only keys before the query's own position, so the stale ones are never seen.

        A session whose caches keep a sliding window (``rewindable`` false) can still step back
        over its last ``max_rewind`` positions (speculative decoding's rejected drafts): its
        rings hold that many slots beyond the window, so no key it will read again was lost;
        and start over at 0 where it is ``restartable``."""
        self._check()
        position = clamp_count(position, 0, self.position, self.position)
        if position == 0 and self.restartable:
            self.position = 0
            return
        if not self.rewindable and self.position - position > self.max_rewind:
            raise NeedleError("this session cannot rewind that far (its cache keeps a sliding window"
                              + (f"; at most {self.max_rewind} positions back)" if self.max_rewind else ")"))
        self.position = position

    def decode_round(self, count: int, sampling: Sampling) -> list:
        """``count`` decode steps in one submit, as ``count`` calls of ``step`` would run them
        (each feeds the id the one before sampled, which the sampler left in ``tokens``), and
        one readback of their ``count`` ids (4 bytes each): a multi-token round of the
        generation loop. Steps past the context are not run; ``rewind`` takes back the ones
        the caller does not keep."""
        return self._round(count, sampling, self.context - self.position)

    def draft(self, count: int, sampling: Sampling, read: bool = True) -> list:
        """``count`` decode steps from the id already at ``tokens[position]`` (each step's id
        goes into the next position's slot), leaving one position free for the verify, then one
        readback of the ``count`` ids (none with ``read`` false: ``verify_drafts`` copies them
        on the GPU)."""
        return self._round(count, sampling, self.context - 1 - self.position, read)

    def submit_round(self, count: int, sampling: Sampling):
        """``decode_round`` without its readback: the round is submitted and the position
        advanced; ``collect_round`` reads its ids later, so the next round can be submitted
        first (pipelining: the GPU runs one round while the host handles the one before).
        None when no step fits the context."""
        return self._submit(count, sampling, self.context - self.position)

    def collect_round(self, submitted) -> list:
        """The ids of a round ``submit_round`` returned (waits for that round only where the
        back end can tell rounds apart, ``Device.collect``)."""
        if submitted is None:
            return []
        self._check()
        return list(struct.unpack(f"<{submitted.size // 4}I", self.device.collect(submitted)))

    def _round(self, count, sampling: Sampling, room: int, read: bool = True) -> list:
        submitted = self._submit(count, sampling, room, read)
        return self.collect_round(submitted) if read else []

    def _submit(self, count, sampling: Sampling, room: int, read: bool = True):
        self._check()
        sampling = session_sampling(sampling, self.logit_rows, required=True)
        count = clamp_count(count, 0, max(room, 0), 0)
        if count == 0:
            return None
        start, dev = self.position, self.device
        if self.round_records is None or self.round_records.size < 16 * count:
            with recording(self._owned):
                self.round_records = dev.buffer(16 * max(count, 16), label="round", kind="session")
        dev.write(self.round_records, b"".join(struct.pack("<4I", start + i, 0, 0, 0) for i in range(count)))
        readback = (self.tokens, 4 * (start + 1), 4 * count) if read else None
        submitted = dev.run_steps(self._plan(PlanKey(1, sampling)), self.round_records, self.step_uniform, count,
                                  readback=readback)
        self.position += count
        return submitted

    def verify_drafts(self, first: int, source: "ChunkedSession", count: int) -> tuple:
        """``verify([first] + drafts)`` where the drafts are the ``count`` ids another session
        of the same device left in its ``tokens`` right after this session's position (its
        ``draft``): copied buffer to buffer, so the draft session is never waited for before
        the verify is submitted. Returns (drafts, verified ids)."""
        self._check()
        if not self.supports_verify:
            raise UnsupportedModelError("this model family's sessions cannot verify drafts")
        start, T, dev = self.position, count + 1, self.device
        if source.device is not dev or not 0 < T <= self.chunk or start + T >= min(self.context, source.context):
            raise InputError(f"verify takes 1 to {self.chunk} ids that leave room for one more position")
        dev.write(self.tokens, struct.pack("<I", first & 0xFFFFFFFF), 4 * start)
        if count:
            dev.run(copies=[(source.tokens, 4 * (start + 1), self.tokens, 4 * (start + 1), 4 * count)])
        dev.write(self.step_uniform, struct.pack("<4I", start, 0, 0, 0))
        dev.run(self._plan(PlanKey(T, GREEDY, True, False, True)))
        self.position += T
        verified = list(struct.unpack(f"<{T}I", dev.read(self.tokens, 4 * T, 4 * (start + 1))))
        drafts = list(struct.unpack(f"<{count}I", dev.read(source.tokens, 4 * count, 4 * (start + 1)))) if count else []
        if count:  # as verify: the chunk's own ids back where the samplers wrote
            dev.write(self.tokens, struct.pack(f"<{count}I", *drafts), 4 * (start + 1))
        return drafts, verified

    def verify(self, ids: list) -> list:
        """Feed ``ids`` (one chunk) and return the greedy id after each of them: one plan (the
        head over every position, a sampler per position writing ``tokens[p + 1]``), one
        readback of ``len(ids)`` ids; the chunk's ids are then put back (the Engram hash of
        later chunks reads them), and ``tokens[position]`` holds the id after the last one,
        the next to feed. The last id's successor must fit the context."""
        self._check()
        if not self.supports_verify:
            raise UnsupportedModelError("this model family's sessions cannot verify drafts")
        ids = session_ids(ids)
        if not 0 < len(ids) <= self.chunk or self.position + len(ids) >= self.context:
            raise InputError(f"verify takes 1 to {self.chunk} ids that leave room for one more position")
        start = self.position
        self._run_chunk(ids, GREEDY, all_logits=True, every_position=True)
        out = list(struct.unpack(f"<{len(ids)}I", self.device.read(self.tokens, 4 * len(ids), 4 * (start + 1))))
        if len(ids) > 1:  # the samplers wrote over the chunk's own ids, which later chunks hash
            self.device.write(self.tokens, struct.pack(f"<{len(ids) - 1}I", *ids[1:]), 4 * (start + 1))
        return out

    def _read_sampled(self, top_logprobs=None, mask=None):
        token = struct.unpack_from("<I", self.device.read(self.result, 4))[0]
        if top_logprobs is None:
            return token
        # Without all_logits the head wrote the sampled row first; the logits pass changed it in place.
        rows = self.logit_rows
        values = row_values(self.device.read(self.logits, 4 * rows), rows, mask)
        return token, token_logprob(values, token, top_logprobs)

    def all_logits(self, ids: list) -> list:
        """Logits of every position (tests and analysis): reads back each chunk's logits."""
        self._check()
        ids = session_ids(ids)
        rows = self.logit_rows
        out = []
        for start in range(0, len(ids), self.chunk):
            part = ids[start : start + self.chunk]
            self._run_chunk(part, None, all_logits=True)
            data = self.device.read(self.logits, 4 * rows * len(part))
            values = struct.unpack(f"<{rows * len(part)}f", data)
            out += [list(values[t * rows : (t + 1) * rows]) for t in range(len(part))]
        return out

    def last_logits(self, ids: list, tokenwise: bool = False) -> list:
        """The logits after the last of ``ids`` (run from the session's position), as floats.

        Batched: the prefill's chunks (the GEMM path over up to ``chunk`` positions);
        tokenwise: one position per plan (the decode step's GEMV path). Spec dense-gguf §7
        compares the two (``needle_wgpu.verdict``). Nothing is sampled.
        """
        self._check()
        ids = session_ids(ids)
        if not ids:
            raise InputError("last_logits needs at least one id")
        length = 1 if tokenwise else self.chunk
        for start in range(0, len(ids), length):
            self._run_chunk(ids[start : start + length], None)
        rows = self.logit_rows  # without all_logits the head wrote the last position's row first
        return list(struct.unpack(f"<{rows}f", self.device.read(self.logits, 4 * rows)))

    def close(self) -> None:
        """Free the session's GPU memory now: the buffers it made (its caches, scratch and the
        plans' uniforms; never the model's weights nor the device's shared scratch), once its
        plans are gone. A closed session refuses further calls."""
        self._closed = True
        for _, plan_owned in self.__dict__.get("_plans", {}).values():
            self.device.free(plan_owned)
        self._plans.clear()
        owned = self.__dict__.get("_owned", [])
        owned += [value for value in vars(self).values() if isinstance(value, Buffer)]  # made lazily elsewhere
        self.device.free(owned)
        owned.clear()
        if self.slab is not None and self.slot is not None:
            self.slab.give(self.slot)  # its slot's memory goes with its page's last
            self.slot = None
