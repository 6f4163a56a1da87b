"""The shared constants (needle_wgpu/constants.py) against exact decimal arithmetic.

The expected values here come from Python's decimal module at 60 digits, rounded to f32 by
comparing with the exact midpoints: nothing depends on the CPU's SIMD or its libm. The GPU ops
and the NumPy reference both read these tables, so their parity tests cannot disagree on them.
"""

import math
import struct
from decimal import Decimal, localcontext

import numpy as np
import pytest

from needle_wgpu import constants
from needle_wgpu.kernels import attention as attention_ops
from needle_wgpu.kernels import cq as cq_ops
from needle_wgpu.reference import ops as ref_ops
from needle_wgpu.reference.needle3.cq import level_table


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def round_f32(exact: Decimal) -> float:
    """The f32 nearest to a non-negative decimal, ties to even, decided exactly."""
    if exact == 0:
        return 0.0
    candidate = constants.f32(float(exact))
    while True:
        up, down = _from_bits(_bits(candidate) + 1), _from_bits(_bits(candidate) - 1)
        if exact > (Decimal(candidate) + Decimal(up)) / 2:
            candidate = up
        elif exact < (Decimal(candidate) + Decimal(down)) / 2:
            candidate = down
        else:
            return candidate


def exact_frequencies(dims: int, base: float) -> list:
    """f_i = f32(1 / f32(f32(base)^f32(2i/dims))), every f32 step correctly rounded."""
    out = []
    with localcontext() as ctx:
        ctx.prec = 60
        base32 = Decimal(constants.f32(base))
        for i in range(dims // 2):
            exponent = round_f32(Decimal(2 * i) / Decimal(dims))
            power = round_f32(base32 ** Decimal(exponent))
            out.append(round_f32(1 / Decimal(power)))
    return out


@pytest.mark.parametrize("base", [10000.0, 100000.0, 500000.0, 1e6, 5e6])
def test_rope_frequencies_are_correctly_rounded(base):
    for dims in list(range(2, 130, 2)) + [160, 192, 256]:
        assert list(constants.rope_frequencies(dims, base)) == exact_frequencies(dims, base), dims


def test_linear_rope_scaling_folds_into_the_table():
    plain, scaled = constants.rope_frequencies(64, 1e6), constants.rope_frequencies(64, 1e6, 0.125)
    assert scaled == tuple(constants.f32(f * 0.125) for f in plain) and scaled != plain
    assert constants.rope_frequencies(64, 1e6, 1.0) == plain


def test_reference_and_kernels_share_the_tables():
    for dims, base in ((48, 100000.0), (10, 10000.0), (64, 1e6), (128, 1e6), (32, 500000.0)):
        table = constants.rope_frequencies(dims, base)
        assert ref_ops.rope_frequencies(dims, base).dtype == np.float32
        np.testing.assert_array_equal(ref_ops.rope_frequencies(dims, base), np.array(table, np.float32))
        assert attention_ops.rope_frequencies(dims, base) == table


def test_scales_and_levels():
    with localcontext() as ctx:
        ctx.prec = 60
        for n in list(range(1, 600)) + [768, 1024, 2048, 4096]:
            assert constants.inv_sqrt(n) == round_f32(1 / Decimal(n).sqrt()), n
            assert constants.sqrt(n) == round_f32(Decimal(n).sqrt()), n
        for group in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
            # the f32 division of the spec equals the f32 of the exact quotient: one value
            level = round_f32(Decimal(constants.f32(constants.TERNARY_LEVEL)) / Decimal(round_f32(Decimal(group).sqrt())))
            assert constants.ternary_level(group) == level == constants.f32(constants.TERNARY_LEVEL / math.sqrt(group))
            assert float(level_table(5, group, ())[1]) == level
            assert cq_ops.fwht_scale(group) == constants.inv_sqrt(group)
    assert constants.GELU_TANH_SCALE == round_f32(Decimal(2 / math.pi).sqrt())


def test_reference_cos_sin_rounded_once():
    angles = np.array([0.0, 1e-3, 1.0, 3.0, 100.0, 5000.5, 65000.25], np.float32)
    cos, sin = ref_ops.cos_sin(angles)
    assert cos.dtype == sin.dtype == np.float32
    for a, c, s in zip(angles.tolist(), cos.tolist(), sin.tolist()):
        assert c == constants.f32(math.cos(a)) and s == constants.f32(math.sin(a))
