"""Mixture-of-experts FFN ops (dense-gguf spec §3, MoE: qwen3moe, olmoe), all on the GPU.

- ``route``: router logits [T][n_expert] (a plain ``q_matmul`` of ``ffn_gate_inp``) ->
  softmax over all experts, top-k (ties to the lower index), weights (renormalised or not)
  -> routes [T][k] of (expert id u32, weight f32 bits) (``moe_router.wgsl``).
- ``routed_matmul``: a matmul over the rows of the expert each route names, read from the
  routes buffer by the kernel (no host readback), "expand" (gate, up: one output row per
  route) or "combine" (down: the weighted sum of a position's k routes) (``q_matmul_routed.wgsl``).

A 3-D expert tensor [n_expert][rows][cols] is uploaded as one ``qmatmul.QPack`` of
n_expert * rows rows; it must fit one binding (``check_expert_pack``).
Reference: ``needle_wgpu.reference.dense.moe_route`` / ``moe_ffn``.
"""

from __future__ import annotations

from ..errors import DeviceLimitError
from ..gpu.device import Binding, KernelKey, Plan, UniformArena
from .packs import PART_SLACK
from .qmatmul import QPack, _block_consts

ROUTER_THREADS = 64
ROWS_PER_GROUP = 64
RENORM_FLOOR = 6.103515625e-5  # 2^-14, llama.cpp's clamp of the top-k sum (reference.dense.RENORM_FLOOR)
ROUTE_WORDS = 2                # (expert id, weight) per route


def routes_bytes(positions: int, used: int) -> int:
    return 4 * ROUTE_WORDS * positions * used


def check_expert_bytes(name: str, nbytes: int, limit: int) -> None:
    """Before upload: an expert tensor of ``nbytes`` must fit one binding of ``limit`` bytes."""
    if nbytes > limit - PART_SLACK:
        raise DeviceLimitError(f"{name}: {nbytes} bytes of experts exceed this device's storage binding "
                               f"limit {limit} (expert tensors are not split)")


def check_expert_pack(pack: QPack, experts: int) -> None:
    """An expert pack is read through one binding: refuse one split into parts (at load)."""
    if len(pack.parts) != 1 or pack.rows % experts:
        raise DeviceLimitError(f"{pack.name}: {pack.gpu_bytes} bytes of {experts} experts do not fit one "
                               f"storage binding of this device")


def route(plan: Plan, arena: UniformArena, *, logits, routes, positions: int, experts: int, used: int,
          renormalise: bool, logits_stride: int | None = None, logits_offset: int = 0,
          label: str | None = None) -> None:
    """routes[t][j] = (e_j, w_j) of each position t < ``positions`` from its router logits.

    Bindings (``moe_router.wgsl``): 0 params, 1 ``logits`` f32 [T][logits_stride], 2 ``routes``
    u32 [T][used][2]. Workgroups: ceil(positions / 64). Constants: N_EXPERT, K, RENORMALISE,
    RENORM_FLOOR.
    """
    if not 0 < used <= experts:
        raise ValueError(f"route: top-{used} of {experts} experts")
    key = KernelKey("moe_router", consts=(("N_EXPERT", experts), ("K", used), ("RENORMALISE", bool(renormalise)),
                                          ("RENORM_FLOOR", RENORM_FLOOR)))
    params = arena.struct(key, positions=positions, logits_stride=logits_stride or experts, logits_offset=logits_offset)
    plan.add(key, [params, logits, routes], (-(-positions // ROUTER_THREADS),), label=label or "moe route")


def routed_matmul(plan: Plan, arena: UniformArena, pack: QPack, routes, x, y, *, experts: int, used: int,
                  positions: int, combine: bool, x_stride: int, y_stride: int, x_offset: int = 0,
                  y_offset: int = 0) -> None:
    """Expert e's rows [e·rows, (e+1)·rows) of ``pack`` (rows = pack.rows / experts) times x,
    e read from ``routes`` on the GPU.

    combine False: y[y_offset + (t·used + j)·y_stride + o] = W_e(t,j)[o] · x[t] (x row t);
    combine True:  y[y_offset + t·y_stride + o] = Σ_j w(t,j) · W_e(t,j)[o] · x[t·used + j].
    Bindings (``q_matmul_routed.wgsl``): 0 params, 1 the pack's one part, 2 routes, 3 x, 4 y.
    """
    check_expert_pack(pack, experts)
    if (x_stride | x_offset) % 4:
        raise ValueError("routed_matmul reads x as vec4: x_stride and x_offset must be multiples of 4")
    rows = pack.rows // experts
    part = pack.parts[0]
    key = KernelKey("q_matmul_routed", consts=_block_consts(pack) + (("N_EXPERT", experts), ("K", used),
                                                                     ("COMBINE", bool(combine))))
    params = arena.struct(key, rows=rows, side_base=part.side_base, positions=positions, x_stride=x_stride,
                          x_offset=x_offset, y_stride=y_stride, y_offset=y_offset)
    groups = (-(-rows // ROWS_PER_GROUP), positions if combine else positions * used)
    plan.add(key, [params, Binding(part.buffer), routes, x, y], groups,
             label=f"routed {'combine' if combine else 'expand'} {pack.name}")
