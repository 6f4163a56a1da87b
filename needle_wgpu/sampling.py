"""Sampling parameters: the saturating rules of the no-panic contract (docs/api.md).

Every number a caller passes is mapped to a valid value instead of raising: NaN, infinities,
negative values and absurd sizes all have one documented meaning.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass

U32_MAX = 0xFFFFFFFF
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6
WEIGHT_ONE = 1 << 24  # the sampler's fixed point: weights, top_p and the draw are multiples of 2^-24
F32_MAX = 3.4028234663852886e38
MAX_INVERSE_TEMPERATURE = 2.0 ** 100  # see sampler_constants

# The sampler's exp, in integers only so that every GPU and NumPy agree bit for bit
# (reference/sampling.py: fixed_exp; the kernels get these as pipeline constants).
EXP_CUT = 17  # e^-17 · 2^24 < 1: a weight below it is 0
LOG2E_Q30 = 1549082005  # round(log2(e) · 2^30)
LN2_Q31 = 1488522236  # round(ln(2) · 2^31)
EXP_C3, EXP_C4 = 357913941, 89478485  # round(2^31 / 6), round(2^31 / 24)
EXP2_SIXTEENTHS = (  # round(2^31 · 2^(-a/16)), a = 0 … 15
    2147483648, 2056437387, 1969251188, 1885761398, 1805811301, 1729250827, 1655936265, 1585730000,
    1518500250, 1454120821, 1392470869, 1333434672, 1276901417, 1222764986, 1170923762, 1121280436)


def _number(value, default: float) -> float:
    """``float(value)``; an integer too large for a float is ±inf, anything else -> default."""
    try:
        return float(value)
    except OverflowError:
        try:
            return math.inf if value > 0 else -math.inf
        except Exception:  # an exotic type whose comparison fails too
            return default
    except (TypeError, ValueError):
        return default


@dataclass(frozen=True)
class Sampling:
    """Validated decoding parameters. Build with ``Sampling.saturate``; never raises."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def saturate(cls, temperature=0.0, top_k=0, top_p=1.0, seed=0, vocab: int = U32_MAX) -> "Sampling":
        """temperature: NaN or <= 0 -> 0 (greedy), above 100 (or +inf) -> 100; top_k: NaN or
        <= 0 -> 0 (off), above the vocabulary -> the vocabulary, fractions truncate; top_p: NaN
        or >= 1 -> 1 (off), <= 0 -> 1e-6 (only the most likely token); seed: integers reduced
        modulo 2^32, other numbers truncated first, NaN or ±inf -> 0. A value ``float()``
        cannot read (None, "abc", a list) takes the default in the signature."""
        t = _number(temperature, 0.0)
        t = 0.0 if (math.isnan(t) or t <= 0.0) else min(t, MAX_TEMPERATURE)
        k = _number(top_k, 0.0)
        k = 0 if (math.isnan(k) or k <= 0) else int(min(k, vocab))
        p = _number(top_p, 1.0)
        p = 1.0 if (math.isnan(p) or p >= 1.0) else max(p, MIN_TOP_P)
        if isinstance(seed, numbers.Integral):
            s = int(seed) & U32_MAX
        else:
            s = _number(seed, 0.0)
            s = 0 if (math.isnan(s) or math.isinf(s)) else int(s) & U32_MAX
        return cls(t, k, p, s)


def f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (±inf past the float32 range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # beyond the largest float32 by more than half an ulp
        return math.copysign(math.inf, value)


def sampler_constants(s: Sampling) -> tuple:
    """What the GPU sampler and its reference compute with, derived once on the host (pure Python):
    (greedy, weight scale, top_k, top_p as a multiple of 2^-24).

    greedy: the float32 temperature is not > 0, top_k == 1 or top_p <= 0. The weight scale is
    2^24 · f32(min(1 / f32(temperature), 2^100)), a float32: the kernels multiply by it (a
    float32 multiply is exact on every GPU, a division is not; the bound keeps subnormal logits,
    which a GPU may flush to zero, from moving a weight). top_k: clamped to [0, 2^32 - 1].
    top_p: floor(f32(top_p) · 2^24); 2^24 = off (also for NaN). Saturated settings need none of
    the clamps; they keep the GPU and the reference in step for any ``Sampling``.
    """
    temperature = f32(float(s.temperature))
    top_p = f32(float(s.top_p))
    top_k = max(0, min(int(s.top_k), U32_MAX))
    greedy = not temperature > 0.0 or top_k == 1 or top_p <= 0.0
    scale = 0.0 if greedy else f32(min(1.0 / temperature, MAX_INVERSE_TEMPERATURE)) * WEIGHT_ONE
    p_fixed = int(math.floor(top_p * WEIGHT_ONE)) if top_p < 1.0 and not greedy else WEIGHT_ONE
    return greedy, scale, top_k, p_fixed


def exp_consts() -> tuple:
    """The integer exp's constants as (NAME, value) pairs for a kernel's ``KernelKey``."""
    table = tuple((f"EXP2_{a}", v) for a, v in enumerate(EXP2_SIXTEENTHS))
    return (("EXP_CUT", EXP_CUT), ("LOG2E_Q30", LOG2E_Q30), ("LN2_Q31", LN2_Q31), ("EXP_C3", EXP_C3),
            ("EXP_C4", EXP_C4)) + table


def as_u32(value) -> tuple:
    """One token id as a u32 (spec §0 item 1): (id, whether it had to be changed).

    Integers (int, bool, NumPy integers) and integral reals (``7.0``) keep their value, clamped
    to [0, 2^32 - 1]; everything else (``7.5``, NaN, infinities, strings, None) becomes 0.
    """
    if type(value) is not int:
        if isinstance(value, numbers.Integral):
            value = int(value)
        elif isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
            value = int(value)
        else:
            return 0, True
    if 0 <= value <= U32_MAX:
        return value, False
    return (0 if value < 0 else U32_MAX), True


def saturate_ids(ids, vocab: int | None = None) -> tuple:
    """Token ids as u32 (see ``as_u32``). Returns (ids, how many were changed); with ``vocab``,
    ids at or above it count too (the embedding lookup clamps them), each id at most once."""
    out, changed = [], 0
    limit = U32_MAX + 1 if vocab is None else vocab
    for value in ids:
        v, was_changed = as_u32(value)
        changed += was_changed or v >= limit
        out.append(v)
    return out, changed


def clamp_budget(max_tokens, remaining: int) -> int:
    """max_tokens clamps to [0, remaining context]; NaN or garbage -> 0; a negative remaining
    context (a prompt longer than the context) -> 0."""
    value = _number(max_tokens, 0.0)
    if math.isnan(value) or value <= 0 or remaining <= 0:
        return 0
    return int(min(value, remaining))
