"""LFM2's gated short convolution on the GPU (dense spec §3; llama.cpp's shortconv block).

``short_conv`` turns in_proj's rows [b | c | x] of a chunk into y = c ⊙ conv(b ⊙ x), the
convolution causal over positions with the layer's [width][taps] weights and the ``taps - 1``
positions before the chunk read from the layer's ring (its conv state): a decode step computes
what a prefill of the same positions computes. Reference: ``reference.ops.short_conv``.
"""

from __future__ import annotations

from ..errors import DeviceLimitError, UnsupportedModelError
from ..gpu.device import KernelKey, Plan, UniformArena

MAX_TAPS = 64


def ring_slots(chunk: int, taps: int) -> int:
    """Slots of a layer's ring for chunks of up to ``chunk`` positions: the chunk's own bx and
    the ``taps - 1`` before it, all distinct."""
    return chunk + taps - 1


def short_conv(plan: Plan, arena: UniformArena, step, *, bcx, weights, ring, y, width: int, taps: int, positions: int,
               slots: int, weight_at: int = 0, bcx_stride: int | None = None, y_stride: int | None = None,
               label: str = "short_conv") -> None:
    """y[t][c] = c_p[c] · Σ_j w[c][j] · (b ⊙ x)_{p - (taps - 1) + j}[c] for p = pos0 + t, j < taps,
    over positions >= 0 (``short_conv.wgsl``).

    Bindings: 0 params, 1 ``step`` (uniform Step, pos0), 2 ``bcx`` f32 [T][bcx_stride] (b at 0,
    c at ``width``, x at 2·``width``), 3 ``weights`` f32 (the [width][taps] conv weights at float
    ``weight_at``), 4 ``ring`` f32 [slots][width] (this layer's bx by position mod ``slots``;
    read_write), 5 ``y`` f32 [T][y_stride]. Entry ``store`` (bindings 0, 1, 2, 4) writes the
    chunk's bx, then entry ``conv`` the outputs; workgroups (ceil(width / 64), T) each, 64
    invocations. Constants: WIDTH, TAPS. Requires ``slots`` >= T + taps - 1 (``ring_slots``).
    """
    if not 1 < taps <= MAX_TAPS or width < 1:
        raise UnsupportedModelError(f"{label}: {taps} taps of width {width} (2 to {MAX_TAPS} taps)")
    if slots < ring_slots(positions, taps):
        raise DeviceLimitError(f"{label}: a ring of {slots} slots cannot take chunks of {positions} "
                               f"(needs {ring_slots(positions, taps)})")
    consts = (("WIDTH", width), ("TAPS", taps))
    store = KernelKey("short_conv", "store", consts)
    conv = KernelKey("short_conv", "conv", consts)
    params = arena.struct(conv, bcx_stride=bcx_stride or 3 * width, y_stride=y_stride or width, ring_slots=slots,
                          w_at=weight_at)
    groups = (-(-width // 64), positions)
    plan.add(store, [params, step, bcx, None, ring, None], groups, label=f"{label} store")
    plan.add(conv, [params, step, bcx, weights, ring, y], groups, label=label)
