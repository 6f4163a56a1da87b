"""How a GPU kernel's A8 output (spec §4.9, deploy numerics) is compared with the reference.

The kernel quantises its own f32 values, which differ from the reference's by a few ulps (sums in
another order), so an integer may round the other way where x/scale is within f32 noise of a .5;
the kernel itself divides exactly and rounds half to even like the reference. So: every value
equals the reference's A8 to 1e-3 of the scale (the GPU's prepared values are read back through
the FWHT), except near-ties, which are off by one step, and rarely (at most 0.2% of the values).
"""

import numpy as np

from needle_wgpu.reference.ops import fake_quant, fwht, quantize_rows


def check_a8(got: np.ndarray, before: np.ndarray) -> None:
    """``got`` [T, width] dequantised A8 values from the GPU vs A8 of the reference's
    pre-quantisation values ``before`` [T, width]."""
    want = fake_quant(before)
    _, scale = quantize_rows(before)
    step = np.abs(got - want) / scale
    quotient = before / scale
    near_tie = np.abs(np.abs(quotient - np.floor(quotient)) - 0.5) < 1e-3
    off = step > 1e-3  # the GPU value went through the FWHT and back: f32 noise, not a step
    assert step.max() <= 1.0 + 1e-4, step.max()
    assert not (off & ~near_tie).any(), "an A8 value differs away from a rounding tie"
    assert off.mean() <= 2e-3
    assert np.abs(want - before).max() > 0  # the quantisation changed something


def unprepare(prepared: np.ndarray, width: int, group: int = 128) -> np.ndarray:
    """The values behind a prepared CQ input (the FWHT is its own inverse, §5.5.1), cut to width."""
    return fwht(prepared, group)[..., :width]
