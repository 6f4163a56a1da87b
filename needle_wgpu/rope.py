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
