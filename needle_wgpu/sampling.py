"""Sampling parameters: the saturating rules of the no-panic contract (docs/api.md).

Every number a caller passes is mapped to a valid value instead of raising: NaN, infinities,
negative values and absurd sizes all have one documented meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

U32_MAX = 0xFFFFFFFF
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6


def _number(value, default: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return value


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
        """temperature: NaN or <= 0 -> 0 (greedy), +inf -> 100; top_k: NaN or <= 0 -> 0 (off),
        above the vocabulary -> the vocabulary; top_p: NaN or >= 1 -> 1 (off), <= 0 -> 1e-6
        (only the most likely token); seed: reduced modulo 2^32 (NaN -> 0)."""
        t = _number(temperature, 0.0)
        t = 0.0 if (math.isnan(t) or t <= 0.0) else min(t, MAX_TEMPERATURE)
        k = _number(top_k, 0.0)
        k = 0 if (math.isnan(k) or k <= 0) else int(min(k, vocab))
        p = _number(top_p, 1.0)
        p = 1.0 if (math.isnan(p) or p >= 1.0) else max(p, MIN_TOP_P)
        s = _number(seed, 0.0)
        s = 0 if (math.isnan(s) or math.isinf(s)) else int(s) & U32_MAX
        return cls(t, k, p, s)


def saturate_ids(ids) -> tuple:
    """Token ids as u32 (spec §0 item 1): negative -> 0, above 2^32 - 1 -> 2^32 - 1, non-integers
    (NaN, strings) -> 0. Returns (ids, number of ids that had to be changed)."""
    out, changed = [], 0
    for value in ids:
        try:
            v = int(value)
        except (TypeError, ValueError, OverflowError):
            v = -1
        w = min(max(v, 0), U32_MAX)
        changed += w != value
        out.append(w)
    return out, changed


def clamp_budget(max_tokens, remaining: int) -> int:
    """max_tokens clamps to [0, remaining context]; NaN or garbage -> 0."""
    value = _number(max_tokens, 0.0)
    if math.isnan(value) or value <= 0:
        return 0
    return int(min(value, remaining))
