"""Constants that both the GPU ops and the NumPy reference use, each computed once, here.

NumPy's float32 ``power``/``exp``/``sin`` pick their implementation by the CPU's SIMD (AVX-512
and AVX2 paths can give results one ulp apart), so a value the reference computes with them and
the engine computes in plain Python is not the same value on every machine; RoPE at position
~65000 turns one ulp of a frequency into an angle error past the parity gate. Every constant
here is evaluated in float64 with IEEE operations (+, −, ×, ÷ and sqrt are correctly rounded;
``math.pow`` is within 0.52 double ulp in glibc and musl) and rounded to f32 once per step the
spec defines in f32, so the result is the correctly rounded f32 of that step on every CPU.

Plain Python (no numpy): the kernels' Python ops import this in the browser too; the reference
wraps the tuples in float32 arrays. ``tests/test_constants.py`` checks the tables against an
exact decimal evaluation.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

TERNARY_LEVEL = 1.2240064  # Needle 3 §5.2, the ternary level before the 1/sqrt(G) scale


def f32(value: float) -> float:
    """The float32 nearest to value (round half to even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


@lru_cache(maxsize=64)
def rope_frequencies(dims: int, base: float, scale: float = 1.0) -> tuple:
    """f_i = 1 / base^(2i / dims) for i < dims/2, each step in f32 (Needle 3 §4.5 item 7,
    dense §3: theta_j = pos · base^(−2j/n_dims)).

    The exponent 2i/dims is an f32 division, base^exponent the correctly rounded f32 power (the
    float64 ``math.pow`` rounded once), then an f32 reciprocal: the f32 formula of the specs
    (and of HF's ``1 / base ** (arange(0, dims, 2).float() / dims)``) without its libm's ulps.
    ``dims`` is the rotary width (head_dim, or rope.dimension_count for partial rotary).
    ``scale``: linear RoPE scaling (1 / rope.scaling.factor; angle = (p·scale)·f_j), folded
    into the table as f32(f_j·scale); 1 leaves the table as it is.
    """
    base32 = f32(base)
    out = []
    for i in range(dims // 2):
        exponent = f32(f32(2 * i) / dims)
        frequency = f32(1.0 / f32(math.pow(base32, exponent)))
        out.append(frequency if scale == 1.0 else f32(frequency * scale))
    return tuple(out)


def _round_bits(value: float, bits: int) -> float:
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * (1 << bits)), exponent - bits)


def pio2_parts() -> tuple:
    """π/2 as three 8-bit parts plus an f32 remainder, for the Cody-Waite angle reduction.

    k·part is exact in f32 for k < 2^16, so a RoPE angle below 2^16 reduces to [−π/4, π/4]
    with an absolute error near 1e-7 (``shaders/include/rope_cos_sin.wgsl``).
    """
    rest, parts = math.pi / 2, []
    for _ in range(3):
        parts.append(_round_bits(rest, 8))
        rest -= parts[-1]
    return (*parts, f32(rest))


def inv_sqrt(n: float) -> float:
    """The f32 of 1/sqrt(n), rounded once: attention's 1/sqrt(head_dim), FWHT's 1/sqrt(G)."""
    return f32(1.0 / math.sqrt(n))


def sqrt(n: float) -> float:
    """The f32 of sqrt(n) (= the f32 sqrt of f32(n) for the integers used): embedding scales."""
    return f32(math.sqrt(n))


def ternary_level(group: int) -> float:
    """The ternary CQ level c = f32(1.2240064) / f32(sqrt(G)), an f32 division (Needle 3 §5.2).

    Equal to the f32 of the float64 quotient for every power-of-two group (the tests check 8 to
    4096), so the level table on the GPU and the reference's are one value.
    """
    return f32(f32(TERNARY_LEVEL) / f32(math.sqrt(group)))


BINARY_LEVEL = math.sqrt(2.0 / math.pi)  # Needle 3 §U b: 1-bit CQ levels ±sqrt(2/π)/sqrt(G)


def binary_level(group: int) -> float:
    """The 1-bit CQ level c = f32(sqrt(2/π)) / f32(sqrt(G)), an f32 division (Needle 3 §U b):
    code 0 reads as −c and code 1 as +c (levels ascending, as every codebook slice)."""
    return f32(f32(BINARY_LEVEL) / f32(math.sqrt(group)))


KV_CQ_GROUP = 64  # Needle 3 §4.9 point 5: K/V of kv_bits 2/3/4 are CQ at group 64
ACT_QMAX = 127.0  # Needle 3 §4.9: A8 = symmetric 8-bit fake-quant, scale = max|v| / 127


def kv_cq_levels(header_levels, group: int) -> tuple:
    """The CQ levels of the K/V round trip at group 64 (Needle 3 §4.9 point 5) from the header's
    levels of one width, which are the Lloyd–Max book divided by sqrt(``group``) (§5.3):
    f32(level · sqrt(group / 64)), the book divided by sqrt(64) up to the f32 rounding of the
    header value (upstream recomputes the book; the two agree to an ulp, which moves a nearest
    level only for a value within an ulp of a decision boundary)."""
    factor = math.sqrt(group / KV_CQ_GROUP)
    return tuple(f32(level * factor) for level in header_levels)


GELU_TANH_SCALE = f32(math.sqrt(2.0 / math.pi))  # sqrt(2/π) of the tanh GELU (dense §3, Gemma 3)
GELU_TANH_CUBIC = f32(0.044715)
