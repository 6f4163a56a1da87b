"""Next-token sampling on the GPU (spec §9): the decode step's only readback is 16 bytes.

The algorithm (greedy, top-k, top-p, a counter-based RNG) is defined by
``needle_wgpu.reference.sampling.sample``, which the kernel mirrors id for id.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..gpu.device import KernelKey, Plan, UniformArena
from ..sampling import Sampling

THREADS = 256
MAX_ITEMS = 64  # logits per invocation held in registers: rows <= 16384
RESULT_BYTES = 16
FLAG_WRITTEN, FLAG_GREEDY, FLAG_NO_FINITE = 1, 2, 4


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
    """The sampler holds every logit in registers: at most THREADS · MAX_ITEMS rows (called at load)."""
    if not 0 < -(-rows // THREADS) <= MAX_ITEMS:
        raise UnsupportedModelError(f"sampler: {rows} logits (at most {THREADS * MAX_ITEMS})")


def sample(plan: Plan, arena: UniformArena, step, *, logits, logits_offset: int, rows: int, tokens, result,
           context: int, positions: int, sampling: Sampling) -> None:
    """Pick the next id from logits[logits_offset : logits_offset + rows] (the chunk's last row).

    The row is position p = pos0 + T - 1; the id goes into tokens[p + 1] when p + 1 < context,
    and ``result`` (16 bytes, ``SampleResult.parse``) gets [id, flags, p + 1, logit bits].
    ``sampling`` (already saturated) is baked into the plan's parameters; the random draw
    depends only on (seed, p + 1), so replaying a step gives the same id.
    Bindings (``sample.wgsl``): 0 params, 1 ``step`` (uniform Step), 2 ``logits`` f32,
    3 ``tokens`` u32 [context] (read_write), 4 ``result`` u32 [4]. Workgroups: (1,), 256
    invocations. Constant: ITEMS = ceil(rows / 256) (at most 64, so rows <= 16384).
    """
    check(rows)
    items = -(-rows // THREADS)
    top_k = max(0, min(int(sampling.top_k), 0xFFFFFFFF))
    params = arena.add(rows, logits_offset, positions, context, float(sampling.temperature), top_k,
                       float(sampling.top_p), int(sampling.seed) & 0xFFFFFFFF)
    key = KernelKey("sample", consts=(("ITEMS", items),))
    plan.add(key, [params, step, logits, tokens, result], (1,), label="sample")
