"""The dense FFN's gated activation (dense spec §3): SwiGLU (llama, qwen) and tanh-GELU (Gemma 3).

Reference functions: ``reference.ops.swiglu`` and ``reference.ops.gelu_gated``.
"""

from __future__ import annotations

from ..constants import GELU_TANH_CUBIC, GELU_TANH_SCALE
from ..errors import UnsupportedModelError
from ..gpu.device import KernelKey, Plan, UniformArena

THREADS = 256
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def gated_activation(plan: Plan, arena: UniformArena, *, gate, up, out, width: int, positions: int,
                     act: str = "silu", gate_stride: int | None = None, gate_offset: int = 0,
                     up_stride: int | None = None, up_offset: int = 0, out_stride: int | None = None,
                     label: str | None = None) -> None:
    """out[t][j] = act(g[t][j]) · u[t][j] for j < ``width``: act "silu" (g / (1 + e^-g)) or
    "gelu_tanh" (0.5·g·(1 + tanh(sqrt(2/π)·(g + 0.044715·g³)))).

    Bindings (``gated_act.wgsl``): 0 params, 1 ``gate`` f32 [T][gate_stride] (g at float
    ``gate_offset``), 2 ``up`` f32 [T][up_stride] (u at ``up_offset``; may be the same buffer
    as ``gate``), 3 ``out`` f32 [T][out_stride]. Workgroups: (ceil(width / 256), T).
    Constants: WIDTH, ACT, GELU_SCALE, GELU_CUBIC.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"gated_activation: act {act!r} (one of {tuple(ACTIVATIONS)})")
    if width < 1:
        raise UnsupportedModelError(f"gated_activation: width {width}")
    key = KernelKey("gated_act", consts=(("WIDTH", width), ("ACT", ACTIVATIONS[act]),
                                          ("GELU_SCALE", GELU_TANH_SCALE), ("GELU_CUBIC", GELU_TANH_CUBIC)))
    params = arena.struct(key, gate_stride=gate_stride or width, gate_offset=gate_offset, up_stride=up_stride or width,
                          up_offset=up_offset, out_stride=out_stride or width)
    plan.add(key, [params, gate, up, out], (-(-width // THREADS), positions), label=label or act)


def swiglu(plan: Plan, arena: UniformArena, **sizes) -> None:
    """silu(g) · u (llama, qwen2, qwen3): ``gated_activation`` with act "silu"."""
    gated_activation(plan, arena, act="silu", **sizes)


def gelu_gated(plan: Plan, arena: UniformArena, **sizes) -> None:
    """gelu_tanh(g) · u (Gemma 3): ``gated_activation`` with act "gelu_tanh"."""
    gated_activation(plan, arena, act="gelu_tanh", **sizes)
