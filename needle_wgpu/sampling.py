"""Sampling parameters: the saturating rules of the no-panic contract (docs/api.md).

Every number a caller passes is mapped to a valid value instead of raising: NaN, infinities,
negative values and absurd sizes all have one documented meaning.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .inputs import checked, real_number, whole_number

U32_MAX = 0xFFFFFFFF
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6
WEIGHT_ONE = 1 << 24  # the sampler's fixed point: weights, top_p and the draw are multiples of 2^-24
F32_MAX = 3.4028234663852886e38
MAX_INVERSE_TEMPERATURE = 2.0 ** 100  # see sampler_constants
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_PRESENCE_PENALTY = MAX_FREQUENCY_PENALTY = 2.0  # OpenAI's range, [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]
MAX_BIAS_ENTRIES = 1024  # the logit_bias entries a Sampling keeps (the lowest ids)
DEFAULT_PENALTY_LAST_N = 64  # llama.cpp's default window
WHOLE_CONTEXT = -1  # penalty_last_n: every position of the context

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
    """``value`` read as a float (``inputs.real_number``: huge integers are ±inf); a value that
    is not a number -> ``default``."""
    number = real_number(value)
    return default if number is None else number


@dataclass(frozen=True)
class Sampling:
    """Decoding parameters, always valid: however it is built, each field saturates by the rules
    of ``saturate`` (``Sampling(temperature=NAN)`` is greedy). ``saturate`` also clamps top_k
    to a vocabulary and drops logit_bias entries past it. Never raises.

    Frozen and hashable: it is part of a prebuilt plan's key (``models.session.PlanKey``).
    ``logit_bias`` is kept as a sorted tuple of (id, float32 bias) pairs."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N
    logit_bias: tuple = ()

    def __post_init__(self):
        t = _number(self.temperature, 0.0)
        t = 0.0 if (math.isnan(t) or t <= 0.0) else min(t, MAX_TEMPERATURE)
        k = _number(self.top_k, 0.0)
        k = 0 if (math.isnan(k) or k <= 0) else int(min(k, U32_MAX))
        p = _number(self.top_p, 1.0)
        p = 1.0 if (math.isnan(p) or p >= 1.0) else max(p, MIN_TOP_P)
        m = _number(self.min_p, 0.0)
        m = 0.0 if (math.isnan(m) or m <= 0.0) else min(m, 1.0)
        r = _number(self.repetition_penalty, 1.0)
        r = 1.0 if (math.isnan(r) or r <= 0.0) else max(MIN_REPETITION_PENALTY, min(r, MAX_REPETITION_PENALTY))
        fields = (("temperature", t), ("top_k", k), ("top_p", p), ("seed", saturate_seed(self.seed)),
                  ("min_p", m), ("repetition_penalty", r),
                  ("presence_penalty", _clamped(self.presence_penalty, MAX_PRESENCE_PENALTY)),
                  ("frequency_penalty", _clamped(self.frequency_penalty, MAX_FREQUENCY_PENALTY)),
                  ("penalty_last_n", saturate_last_n(self.penalty_last_n)),
                  ("logit_bias", saturate_logit_bias(self.logit_bias)))
        for name, value in fields:
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties change any logit (a window and a penalty that is not off)."""
        return self.penalty_last_n != 0 and (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                                             or self.frequency_penalty != 0.0)

    @property
    def processes_logits(self) -> bool:
        """Whether the plan needs the logits pass before the sampler (bias or penalties)."""
        return self.penalized or bool(self.logit_bias)

    @classmethod
    @checked
    def saturate(cls, temperature=0.0, top_k=0, top_p=1.0, seed=0, vocab=U32_MAX, min_p=0.0,
                 repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                 penalty_last_n=DEFAULT_PENALTY_LAST_N, logit_bias=None) -> "Sampling":
        """temperature: NaN or <= 0 -> 0 (greedy), above 100 (or +inf) -> 100; top_k: NaN or
        <= 0 -> 0 (off), above the vocabulary -> the vocabulary, fractions truncate; top_p: NaN
        or >= 1 -> 1 (off), <= 0 -> 1e-6 (only the most likely token); seed: ``saturate_seed``;
        min_p: NaN or <= 0 -> 0 (off), >= 1 -> 1 (only tokens as likely as the most likely);
        repetition_penalty: NaN or <= 0 -> 1 (off), clamped to [0.01, 100];
        presence_penalty, frequency_penalty: NaN -> 0, clamped to [-2, 2];
        penalty_last_n: ``saturate_last_n``; logit_bias: ``saturate_logit_bias`` (then ids at or
        above the vocabulary are dropped).
        A value that is not a number (None, "abc", a list) takes the default in the signature;
        strings ``float()`` reads ("0.7", "inf") count as those numbers."""
        sampling = cls(temperature, top_k, top_p, seed, min_p, repetition_penalty, presence_penalty,
                       frequency_penalty, penalty_last_n, logit_bias)
        vocab = clamp_count(vocab, 0, U32_MAX, U32_MAX)
        return sampling.for_vocab(vocab)

    def for_vocab(self, vocab: int) -> "Sampling":
        """This sampling with top_k clamped to ``vocab`` and bias entries at or past it dropped."""
        sampling = self if self.top_k <= vocab else replace(self, top_k=vocab)
        if any(token >= vocab for token, _ in sampling.logit_bias):
            sampling = replace(sampling, logit_bias=tuple(e for e in sampling.logit_bias if e[0] < vocab))
        return sampling


def _clamped(value, bound: float) -> float:
    """A number in [-bound, bound]; NaN and what is not a number -> 0."""
    number = _number(value, 0.0)
    return 0.0 if math.isnan(number) else max(-bound, min(number, bound))


def saturate_last_n(value) -> int:
    """penalty_last_n: how many of the latest context positions the penalties look at, the
    prompt's included. 0 -> off; negative, +inf or above 2^31 -> -1 (``WHOLE_CONTEXT``; so is
    any value at or above the session's context); fractions truncate; NaN and what is not a
    number -> 64 (the default)."""
    number = _number(value, math.nan)
    if math.isnan(number):
        return DEFAULT_PENALTY_LAST_N
    if number < 0 or number >= 2 ** 31:
        return WHOLE_CONTEXT
    whole = whole_number(value)
    return int(number) if whole is None else whole


def bias_token(key) -> int | None:
    """A logit_bias key as a token id: a whole number in [0, 2^32) (``inputs.whole_number``) or a
    decimal string (``"50256"``, as JSON object keys are); anything else -> None (ignored)."""
    if isinstance(key, str):
        text = key.strip()
        whole = int(text) if text.isascii() and text.isdecimal() and len(text) <= 10 else None
    else:
        whole = whole_number(key)
    return whole if whole is not None and 0 <= whole <= U32_MAX else None


def saturate_logit_bias(bias) -> tuple:
    """logit_bias as a sorted tuple of (id, bias) pairs: a mapping {id: bias} (or pairs).

    Keys: ``bias_token``; an entry whose key is not a token id is ignored. Values: read as
    numbers, clamped to [-100, 100] (±inf -> ±100), then rounded to float32; NaN, what is not a
    number, and 0 are ignored. Several keys naming one id: the last one counts. At most
    ``MAX_BIAS_ENTRIES`` (1024) entries are kept, those of the lowest ids. Anything that is
    neither a mapping nor an iterable of pairs (None, a number, a string) -> no bias."""
    if isinstance(bias, Mapping):
        items = bias.items()
    elif isinstance(bias, (tuple, list)):
        items = bias
    else:
        return ()
    chosen = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            continue
        token, value = bias_token(item[0]), _number(item[1], math.nan)
        if token is None or math.isnan(value):
            continue
        chosen[token] = f32(max(-MAX_LOGIT_BIAS, min(value, MAX_LOGIT_BIAS)))
    return tuple(sorted((t, v) for t, v in chosen.items() if v != 0.0)[:MAX_BIAS_ENTRIES])


def saturate_seed(seed) -> int:
    """A seed as a u32: whole numbers modulo 2^32 (-1 -> 2^32 - 1), other numbers truncated
    first, NaN, ±inf and what is not a number -> 0."""
    whole = whole_number(seed)
    if whole is None:
        number = _number(seed, 0.0)
        whole = int(number) if math.isfinite(number) else 0
    return whole & U32_MAX


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


def min_weight(s: Sampling) -> int:
    """min_p as the sampler's weight threshold: ceil(f32(min_p) · 2^24), 0 when off or greedy. The
    most likely token weighs exactly 2^24, so a candidate is kept when its weight (its
    probability relative to the most likely one, at the temperature) is at least min_p."""
    greedy = sampler_constants(s)[0]
    return 0 if greedy else int(math.ceil(f32(float(s.min_p)) * WEIGHT_ONE))


def exp_consts() -> tuple:
    """The integer exp's constants as (NAME, value) pairs for a kernel's ``KernelKey``."""
    table = tuple((f"EXP2_{a}", v) for a, v in enumerate(EXP2_SIXTEENTHS))
    return (("EXP_CUT", EXP_CUT), ("LOG2E_Q30", LOG2E_Q30), ("LN2_Q31", LN2_Q31), ("EXP_C3", EXP_C3),
            ("EXP_C4", EXP_C4)) + table


def as_u32(value) -> tuple:
    """One token id as a u32 (spec §0 item 1): (id, whether it had to be changed).

    Whole numbers (``inputs.whole_number``: int, bool, NumPy integers, ``7.0``,
    ``Fraction(14, 2)``, ``Decimal("7")``) keep their value, clamped to [0, 2^32 - 1];
    everything else (``7.5``, NaN, infinities, strings, None, durations) becomes 0.
    """
    whole = whole_number(value)
    if whole is None:
        return 0, True
    if 0 <= whole <= U32_MAX:
        return whole, False
    return (0 if whole < 0 else U32_MAX), True


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


def clamp_count(value, low: int, high: int, default: int) -> int:
    """A whole count in [low, high] (a context length, a chunk size): fractions truncate;
    NaN, ±inf and what is not a number -> ``default``."""
    number = _number(value, math.nan)
    if not math.isfinite(number):
        return default
    whole = whole_number(value)
    whole = int(number) if whole is None else whole
    return max(low, min(whole, high))
