"""Rotary position embedding tables for the dense GGUF family (spec dense-gguf.md §3, RoPE).

Pure Python (no numpy), so the GPU side and the NumPy reference import the same numbers:
theta_j = pos · freq_j with freq_j = freq_base^(−2j / n_dims), j < n_dims/2.

Why not numpy: `np.power` (and `np.cos`/`np.sin`) in f32 may take a SIMD path whose result
differs by one ulp between CPUs (AVX-512 vs AVX2), so a table built with it makes an expected
value depend on the machine. Here every value is evaluated once in float64 with `math` and
rounded to f32 once: deterministic, and the correctly rounded f32 of the exact value whenever
the double result is (it is, for every base and width that occurs).
"""

from __future__ import annotations

import math
import struct

# Pairings of §3: which two elements of a head one rotation mixes.
ADJACENT = "adjacent"  # (x_{2j}, x_{2j+1}): llama.cpp's "normal" RoPE, used for llama GGUFs
NEOX = "neox"          # (x_j, x_{j + n_dims/2}): qwen2, qwen3, qwen3moe, olmoe, gemma3
STYLES = (ADJACENT, NEOX)

_F32 = struct.Struct("<f")


def f32(value: float) -> float:
    """value rounded to the nearest f32 (round half to even), as a Python float."""
    return _F32.unpack(_F32.pack(value))[0]


def rope_frequencies(n_dims: int, freq_base: float, *, round_to_f32: bool = True) -> list[float]:
    """freq_j = freq_base^(−2j / n_dims) for j < n_dims/2 (§3).

    The exponent and the power are float64 (`math.pow`), rounded once to f32 unless
    `round_to_f32` is false (the float64 reference keeps the double values).
    """
    if n_dims <= 0 or n_dims % 2:
        raise ValueError(f"RoPE needs a positive even number of dimensions, got {n_dims}")
    if not (freq_base > 0 and math.isfinite(freq_base)):
        raise ValueError(f"RoPE frequency base must be positive and finite, got {freq_base}")
    base = float(freq_base)
    exact = [math.pow(base, -2.0 * j / n_dims) for j in range(n_dims // 2)]
    return [f32(f) for f in exact] if round_to_f32 else exact


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
