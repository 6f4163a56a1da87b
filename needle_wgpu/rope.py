"""Rotary position embedding tables for the dense GGUF family (spec dense-gguf.md §3, RoPE).

Pure Python (no numpy), so the GPU side and the NumPy reference import the same numbers:
theta_j = pos · freq_j with freq_j = freq_base^(−2j / n_dims), j < n_dims/2.

Why not numpy: `np.power` (and `np.cos`/`np.sin`) in f32 may take a SIMD path whose result
differs by one ulp between CPUs (AVX-512 vs AVX2), so a table built with it makes an expected
value depend on the machine. Here every value is evaluated in float64 with `math` and rounded to
f32 once per step: deterministic on every CPU.
"""

from __future__ import annotations

import math

from . import constants
from .constants import f32

# Pairings of §3: which two elements of a head one rotation mixes.
ADJACENT = "adjacent"  # (x_{2j}, x_{2j+1}): llama.cpp's "normal" RoPE, used for llama GGUFs
NEOX = "neox"          # (x_j, x_{j + n_dims/2}): qwen2, qwen3, qwen3moe, olmoe, gemma3
STYLES = (ADJACENT, NEOX)

def rope_frequencies(n_dims: int, freq_base: float, *, round_to_f32: bool = True) -> list[float]:
    """freq_j = freq_base^(−2j / n_dims) for j < n_dims/2 (§3).

    In f32 this is the one table the GPU uses too (``constants.rope_frequencies``: the f32
    formula of the spec, each step correctly rounded); ``round_to_f32=False`` gives the float64
    values for the float64 reference.
    """
    if n_dims <= 0 or n_dims % 2:
        raise ValueError(f"RoPE needs a positive even number of dimensions, got {n_dims}")
    if not (freq_base > 0 and math.isfinite(freq_base)):
        raise ValueError(f"RoPE frequency base must be positive and finite, got {freq_base}")
    if round_to_f32:
        return list(constants.rope_frequencies(n_dims, float(freq_base)))
    return [math.pow(float(freq_base), -2.0 * j / n_dims) for j in range(n_dims // 2)]


def rope_angles(position: int, frequencies: list[float], *, round_to_f32: bool = True) -> list[float]:
    """theta_j = position · freq_j. In f32 this is one f32 multiplication, which is what a
    shader computes: the product of two f32 values is exact in float64 and rounded once here."""
    p = float(position)
    if round_to_f32:
        return [f32(p * f) for f in frequencies]
    return [p * f for f in frequencies]


def rope_cos_sin(position: int, frequencies: list[float], *,
                 round_to_f32: bool = True) -> tuple[list[float], list[float]]:
    """(cos theta_j, sin theta_j) for one position: float64 `math.cos`/`math.sin` of the
    (f32) angle, rounded once to f32 unless `round_to_f32` is false."""
    angles = rope_angles(position, frequencies, round_to_f32=round_to_f32)
    cos = [math.cos(a) for a in angles]
    sin = [math.sin(a) for a in angles]
    if round_to_f32:
        return [f32(c) for c in cos], [f32(s) for s in sin]
    return cos, sin


# ---------------------------------------------------------------------------------- scaled RoPE
# Llama 3 frequency factors, YaRN and LongRoPE, as llama.cpp's ggml_rope_ext applies them (its
# rope_yarn: theta = p·f_j / ff_j, interpolated by freq_scale, mixed with the extrapolated angle
# by YaRN's ramp; cos and sin scaled by the magnitude). Each folds into one f32 frequency per
# pair, so the kernels' exact angle reduction applies unchanged.

YARN_BETA_FAST = 32.0  # llama.cpp's defaults; its loaders read rope.scaling.yarn_beta_* only for
YARN_BETA_SLOW = 1.0   # a few architectures, none of those served here


def yarn_corr_dims(n_dims: int, orig_context: int, freq_base: float, beta_fast: float = YARN_BETA_FAST,
                   beta_slow: float = YARN_BETA_SLOW) -> tuple[float, float]:
    """(low, high) pair indices of YaRN's ramp (ggml_rope_yarn_corr_dims)."""
    def corr_dim(rotations):
        return n_dims * math.log(orig_context / (rotations * 2 * math.pi)) / (2 * math.log(freq_base))
    return max(0.0, math.floor(corr_dim(beta_fast))), min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))


def scaled_frequencies(n_dims: int, freq_base: float, *, freq_scale: float = 1.0, factors=None,
                       ext_factor: float = 0.0, orig_context: int = 0) -> tuple:
    """f32 f'_j = f_j / ff_j · (s·(1 − r_j) + r_j): f_j the plain table, ff_j the frequency
    factors (rope_freqs / LongRoPE; none: 1), s = freq_scale, r_j = ext_factor · YaRN's ramp
    (1 below the ramp's low pair, 0 above its high one)."""
    table = constants.rope_frequencies(n_dims, float(freq_base))
    low = high = 0.0
    if ext_factor:
        low, high = yarn_corr_dims(n_dims, orig_context, freq_base)
    out = []
    for j, f in enumerate(table):
        if factors is not None:
            f = f32(f / f32(factors[j]))
        mix = 0.0
        if ext_factor:
            y = (j - low) / max(0.001, high - low)
            mix = (1.0 - min(1.0, max(0.0, y))) * ext_factor
        g = freq_scale * (1.0 - mix) + mix
        out.append(f if g == 1.0 else f32(f * f32(g)))
    return tuple(out)


def rope_magnitude(freq_scale: float, ext_factor: float, attn_factor: float = 1.0, log_mul: float = 0.0) -> float:
    """The factor llama.cpp multiplies cos and sin by: rope.scaling.attn_factor, and with YaRN
    (ext_factor != 0) its context's mscale (0.1·ln(factor) + 1, or the ratio of the two with
    rope.scaling.yarn_log_multiplier), divided by and then multiplied again by rope_yarn's own
    1 + 0.1·ln(1 / freq_scale)."""
    m = 1.0
    if ext_factor:
        factor = 1.0 / freq_scale

        def mscale(scale, mul):
            return 1.0 if scale <= 1.0 else 0.1 * mul * math.log(scale) + 1.0
        m = mscale(factor, 1.0) / mscale(factor, log_mul) if log_mul else mscale(factor, 1.0)
        m *= 1.0 / (1.0 + 0.1 * math.log(factor))
    m = f32(m) * attn_factor
    if ext_factor:
        m *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    return f32(m)
