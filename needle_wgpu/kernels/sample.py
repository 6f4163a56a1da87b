"""Next-token sampling on the GPU (spec §9): the decode step's only readback is 16 bytes.

When the ``Sampling`` asks for logit_bias or penalties, ``logits_process.wgsl`` runs first, in
place on the row (``reference.sampling.process_logits``); min_p is a weight threshold inside
both samplers. The plain settings build exactly the dispatches they always did.

The algorithm (greedy, top-k, top-p, a counter-based RNG) is defined by
``needle_wgpu.reference.sampling.sample``; both kernels follow it id for id. Two variants:
``ONE_WORKGROUP`` (``sample.wgsl``, one dispatch, rows <= 16,384) and ``STAGED``
(``sample_staged.wgsl``, several passes of the same plan, any rows up to 2^24).
"""

from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..gpu.device import Buffer, Device, KernelKey, Plan, UniformArena
from ..sampling import U32_MAX, WEIGHT_ONE, WHOLE_CONTEXT, Sampling, exp_consts, f32, min_weight, sampler_constants

THREADS = 256
MAX_ITEMS = 64  # one workgroup: logits per invocation held in registers, so rows <= 16384
ONE_WORKGROUP_ROWS = THREADS * MAX_ITEMS
STAGED_ITEMS = 64  # staged: slices of 16,384 logits (few and long: CPU adapters pay per barrier)
SLICE = THREADS * STAGED_ITEMS
MAX_ROWS = 1 << 24
STATE_SLICES_AT = 4128  # sample_staged.wgsl: SLICES; then 8 words per slice
RESULT_BYTES = 16
FLAG_WRITTEN, FLAG_GREEDY, FLAG_NO_FINITE = 1, 2, 4

ONE_WORKGROUP, STAGED = "one_workgroup", "staged"


def variant_for(rows: int) -> str:
    """The faster variant for a vocabulary: one workgroup while it fits (one dispatch)."""
    return ONE_WORKGROUP if rows <= ONE_WORKGROUP_ROWS else STAGED


@dataclass(frozen=True)
class SampleResult:
    """The 16-byte result: the id, where it went, and why it was chosen."""

    id: int
    position: int  # absolute position of the drawn token (the logits row's position + 1)
    written: bool  # stored into tokens[position] (position < context)
    greedy: bool  # chosen by argmax (temperature <= 0, top_k == 1, or no finite/+inf logits)
    no_finite: bool  # every logit was -inf or NaN (the id is then 0)
    logit: float

    @classmethod
    def parse(cls, data: bytes) -> "SampleResult":
        token, flags, position, logit_bits = struct.unpack_from("<4I", data)
        logit = struct.unpack("<f", struct.pack("<I", logit_bits))[0]
        return cls(token, position, bool(flags & FLAG_WRITTEN), bool(flags & FLAG_GREEDY),
                   bool(flags & FLAG_NO_FINITE), logit)


def check(rows: int) -> None:
    """Whether a head of ``rows`` logits can be sampled (called at load)."""
    if not 0 < rows <= MAX_ROWS:
        raise UnsupportedModelError(f"sampler: {rows} logits (at most {MAX_ROWS})")


class SampleScratch:
    """The staged sampler's working memory for up to ``rows`` logits: ``state`` (histograms, the
    outcome of each radix step, 8 words per slice) and ``weights`` (one u32 per logit).

    Every run rewrites what it reads, so plans (of any session) on one device may share one.
    """

    def __init__(self, device: Device, rows: int):
        self.rows = rows
        groups = -(-rows // SLICE)
        self.state: Buffer = device.buffer(4 * (STATE_SLICES_AT + 8 * groups), label="sample_state", kind="shared")
        self.weights: Buffer = device.buffer(4 * rows, label="sample_weights", kind="shared")


_shared_scratch: "weakref.WeakKeyDictionary[Device, SampleScratch]" = weakref.WeakKeyDictionary()


def shared_scratch(device: Device, rows: int) -> SampleScratch:
    """The device's scratch, replaced by a larger one when ``rows`` needs it (plans built
    earlier keep the one they were built with)."""
    scratch = _shared_scratch.get(device)
    if scratch is None or scratch.rows < rows:
        scratch = SampleScratch(device, rows)
        _shared_scratch[device] = scratch
    return scratch


_no_mask: "weakref.WeakKeyDictionary[Device, Buffer]" = weakref.WeakKeyDictionary()


def mask_bytes(rows: int) -> int:
    """Size of the constrained-decoding bitmask of ``rows`` ids: one bit each, in u32 words."""
    return 4 * (-(-rows // 32))


def _unmasked(device: Device) -> Buffer:
    """The one-word buffer an unmasked plan binds where a masked one binds its mask (never read)."""
    buffer = _no_mask.get(device)
    if buffer is None:
        buffer = _no_mask[device] = device.buffer(16, label="sample_no_mask", kind="shared")
    return buffer


_shared_counts: "weakref.WeakKeyDictionary[Device, tuple]" = weakref.WeakKeyDictionary()


def penalty_counts(device: Device, rows: int) -> Buffer:
    """The device's per-id counts (u32 [rows]) for the penalties: every plan leaves them zero,
    so plans of any session share them; replaced by a larger one when ``rows`` needs it."""
    held = _shared_counts.get(device)
    if held is None or held[0] < rows:
        held = _shared_counts[device] = (rows, device.buffer(4 * rows, label="penalty_counts", kind="shared"))
    return held[1]


def penalty_window(sampling: Sampling, context: int) -> int:
    """How many positions the penalties look at: 0 when they are off; penalty_last_n, or the
    whole context for -1 or a value at or above it."""
    if not sampling.penalized:
        return 0
    last_n = sampling.penalty_last_n
    return context if last_n == WHOLE_CONTEXT or last_n >= context else last_n


def process_logits(plan: Plan, arena: UniformArena, step, *, logits, logits_offset: int, rows: int, tokens,
                   context: int, positions: int, sampling: Sampling) -> None:
    """logit_bias, then the penalties over the latest positions of ``tokens`` (ids by absolute
    position; the row is position pos0 + T - 1), in place on logits[logits_offset : + rows].
    ``logits_process.wgsl``: ``count`` (bias and counts), then ``apply`` when penalized.
    Bindings: 0 params, 1 ``step``, 2 ``logits`` (read_write), 3 ``tokens``, 4 counts
    (``penalty_counts``), 5 the bias pairs (a buffer made with the plan; ``count`` only)."""
    window = penalty_window(sampling, context)
    pairs = [(token, value) for token, value in sampling.logit_bias if token < rows]
    if window == 0 and not pairs:
        return
    device = plan.device
    if pairs:
        data = b"".join(struct.pack("<If", token, value) for token, value in pairs)  # values are float32 already
        bias = device.buffer(len(data), label="logit_bias", data=data)
    else:
        bias = _unmasked(device)
    r = float(sampling.repetition_penalty)
    count = KernelKey("logits_process", entry="count")
    params = arena.struct(count, rows=rows, logits_offset=logits_offset, positions=positions, window=window,
                          bias_count=len(pairs), scale_positive=f32(1.0 / f32(r)), scale_negative=f32(r),
                          presence=float(sampling.presence_penalty), frequency=float(sampling.frequency_penalty),
                          zero=0)
    bindings = [params, step, logits, tokens, penalty_counts(device, rows), bias]
    plan.add(count, bindings, (-(-max(window, len(pairs)) // THREADS),), label="logits.count")
    if window:
        plan.add(KernelKey("logits_process", entry="apply"), bindings[:5], (-(-window // THREADS),), label="logits.apply")


def sample(plan: Plan, arena: UniformArena, step, *, logits, logits_offset: int, rows: int, tokens, result,
           context: int, positions: int, sampling: Sampling, variant: str | None = None,
           scratch: SampleScratch | None = None, mask: Buffer | None = None) -> None:
    """Pick the next id from logits[logits_offset : logits_offset + rows] (the chunk's last row).

    The row is position p = pos0 + T - 1; the id goes into tokens[p + 1] when p + 1 < context,
    and ``result`` (16 bytes, ``SampleResult.parse``) gets [id, flags, p + 1, logit bits].
    ``sampling`` (already saturated) is baked into the plan's parameters; the random draw
    depends only on (seed, p + 1), so replaying a step gives the same id.

    ``variant``: ``ONE_WORKGROUP`` or ``STAGED`` (default ``variant_for(rows)``). ``scratch``
    (staged only): default ``shared_scratch(plan.device, rows)``, allocated once per device.
    Bindings: ``sample.wgsl`` 0 params, 1 ``step`` (uniform Step), 2 ``logits`` f32, 3 ``tokens``
    u32 [context] (read_write), 4 ``result`` u32 [4], one workgroup, ITEMS = ceil(rows / 256);
    ``sample_staged.wgsl`` 0 params, 1 ``logits``, 2 ``state``, 3 ``weights`` (the passes after
    the top-k ones), 4 ``step``, 5 ``tokens``, 6 ``result`` (draw only); ceil(rows / 16384)
    workgroups per pass, one for the draw.

    ``mask`` (constrained decoding): a buffer of ``mask_bytes(rows)`` bytes, bit i allowing id i;
    disallowed ids read as -inf and are never the argmax (``reference.sampling.sample(mask=)``).
    It is binding 5 of ``sample.wgsl`` and 7 of every ``sample_staged.wgsl`` pass; the caller
    writes it before the submit, so the step stays one submit.

    logit_bias and penalties (``sampling.processes_logits``): ``process_logits`` first, which
    changes the row in place (a logprobs readback of the row sees the processed logits).
    """
    variant = variant or variant_for(rows)
    limit = ONE_WORKGROUP_ROWS if variant == ONE_WORKGROUP else MAX_ROWS
    if not 0 < rows <= limit:
        raise UnsupportedModelError(f"sampler: {rows} logits (the {variant} sampler takes 1 to {limit})")
    if sampling.processes_logits:
        process_logits(plan, arena, step, logits=logits, logits_offset=logits_offset, rows=rows, tokens=tokens,
                       context=context, positions=positions, sampling=sampling)
    greedy, scale, top_k, p_fixed = sampler_constants(sampling)
    # The members sample.wgsl and sample_staged.wgsl share (the staged passes add groups and digit).
    settings = dict(rows=rows, logits_offset=logits_offset, positions=positions, context=context, weight_scale=scale,
                    top_k=top_k, top_p=p_fixed, seed=int(sampling.seed) & U32_MAX, greedy=int(greedy),
                    min_weight=min_weight(sampling))
    masked = mask is not None
    mask = mask if masked else _unmasked(plan.device)
    if variant == ONE_WORKGROUP:
        key = KernelKey("sample", consts=(("ITEMS", -(-rows // THREADS)), ("MASKED", masked)) + exp_consts())
        plan.add(key, [arena.struct(key, **settings), step, logits, tokens, result, mask], (1,), label="sample")
        return
    _staged(plan, arena, step, logits, tokens, result, settings, scratch or shared_scratch(plan.device, rows),
            use_top_k=not greedy and 0 < top_k < rows, use_top_p=not greedy and p_fixed < WEIGHT_ONE,
            mask=mask, masked=masked)


# How many of sample_staged.wgsl's bindings each entry uses (auto layouts: exactly those).
_BINDINGS_USED = {"reduce": 3, "count_k": 3, "count_ties": 3, "weigh": 4, "sum_p": 4, "keep": 4, "draw": 7}


def _staged(plan, arena, step, logits, tokens, result, settings, scratch, *, use_top_k, use_top_p,
            every_pass=False, mask=None, masked=False):
    """The passes ``sample_staged.wgsl`` describes: only those the settings need, or (tests)
    ``every_pass``, since each pass also checks the settings itself. ``settings``: the members
    of its Params but groups and digit (``sample`` builds them)."""
    rows, greedy = settings["rows"], settings["greedy"]
    if scratch.rows < rows:
        raise UnsupportedModelError(f"sampler: scratch for {scratch.rows} logits, the row has {rows}")
    groups = -(-rows // SLICE)
    params = [arena.struct("sample_staged", **settings, groups=groups, digit=digit) for digit in range(4)]
    bindings = [None, logits, scratch.state, scratch.weights, step, tokens, result]
    mask = mask if mask is not None else _unmasked(plan.device)

    def add(entry, digit=0, groups=groups):
        key = KernelKey("sample_staged", entry=entry,
                        consts=(("ITEMS", STAGED_ITEMS), ("MASKED", masked)) + exp_consts())
        bindings[0] = params[digit]
        used = _BINDINGS_USED[entry]
        plan.add(key, bindings[:used] + [None] * (7 - used) + [mask], (groups,), label=f"sample.{entry}")

    add("reduce")
    if every_pass or not greedy:
        if every_pass or use_top_k:
            for digit in range(4):
                add("count_k", digit)
            add("count_ties")
        add("weigh")
        if every_pass or use_top_p:
            for digit in (1, 2, 3):
                add("sum_p", digit)
            add("keep")
    add("draw", groups=1)
