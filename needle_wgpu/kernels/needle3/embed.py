"""The ends of the forward: embedding lookup (spec §4.1, §4.3) and the output norm (§4.8).

Reference functions: ``reference.needle3.cq.dequantize_rows`` (times the f32 of sqrt(d)) for ``embed``;
``reference.needle3.mhc.lane_mean``, ``reference.ops.zc_rms_norm`` and ``reference.needle3.cq.prepare_input``
for ``final_norm``.
"""

from __future__ import annotations

import struct

from ... import constants
from ...errors import UnsupportedModelError
from ...formats.needle3_geometry import Needle3Geometry
from ...gpu.device import Binding, KernelKey, Plan, UniformArena
from ..cq import CODE_BITS, LEVEL_BASE, CQPack, fwht_scale
from .fp16_store import Fp16Store

THREADS = 256


def f32(value: float) -> float:
    """The f32 rounding of a Python float (the host computes constants once, like the spec)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def workgroup_cap(*widths: int) -> int:
    """Floats of a workgroup FWHT buffer holding the widest of ``widths``: a multiple of 256."""
    return max(THREADS, -(-max(widths) // THREADS) * THREADS)


def check(d_model: int, group: int, workgroup_bytes: int) -> None:
    """embed and final_norm fit the device's workgroup memory (called at load)."""
    d_pad = -(-d_model // group) * group
    for name, need in (("embed", 4 * (workgroup_cap(d_pad) + 16 + 1)),
                       ("final_norm", 4 * (workgroup_cap(d_pad) + THREADS))):
        if need > workgroup_bytes:
            raise UnsupportedModelError(f"{name}: d = {d_model} (group {group}) needs {need} bytes of workgroup "
                                        f"memory (the device has {workgroup_bytes})")


def embed(plan: Plan, arena: UniformArena, step, *, geometry: Needle3Geometry, pack: CQPack, levels, tokens,
          lanes, positions: int, cells=None) -> None:
    """lanes[t][j] = E[min(tokens[pos0 + t], vocab - 1)][:d] · sqrt(d) for every lane j (§4.1, §4.3).

    Bindings (``embed.wgsl``, entry ``main``; ``with_cells`` when ``cells`` is given):
    0 params, 1 ``step`` (uniform Step, pos0), 2 ``tokens`` u32 [context] (raw ids by absolute
    position), 3 one slice of the embedding ``pack``, 4 ``levels``, 5 ``lanes`` f32 [T][n][d],
    6 ``cells`` f32 [T][L+1][d] (cell 0 written, §4.8). The token id is clamped to vocab - 1 for
    this lookup only (§0 item 1). Rows are dequantised per §5.4 at any code width.
    Workgroups: (T,), 256 invocations, one dispatch per slice of the pack (a workgroup whose row
    another slice holds does nothing). Constants: CODE_BITS, LEVEL_BASE, GROUP, CAP, FWHT_SCALE.
    """
    g = geometry
    entry = "main" if cells is None else "with_cells"
    key = KernelKey("embed", entry=entry, consts=(
        ("CODE_BITS", CODE_BITS[pack.bits]), ("LEVEL_BASE", LEVEL_BASE[pack.bits]), ("GROUP", pack.group),
        ("CAP", workgroup_cap(pack.in_pad)), ("FWHT_SCALE", fwht_scale(pack.group))))
    scale = constants.sqrt(g.d_model)  # the f32 of sqrt(d), correctly rounded (§4.1)
    for piece in pack.slices:
        params = arena.struct(key, d=g.d_model, lanes=g.mhc_lanes, vocab=g.vocab, row_pad=pack.in_pad,
                              row_words=pack.row_words, groups=pack.groups, norm_base=piece.rows * pack.row_words,
                              slice_first=piece.first, slice_rows=piece.rows,
                              cells_stride=(g.num_layers + 1) * g.d_model, scale=scale)
        bindings = [params, step, tokens, Binding(piece.buffer), levels, lanes]
        if cells is not None:
            bindings.append(cells)
        plan.add(key, bindings, (positions,), label=f"embed {pack.name}[{piece.first}:]")


def final_norm(plan: Plan, arena: UniformArena, *, geometry: Needle3Geometry, fp16_store: Fp16Store, lanes, xfh,
               positions: int, group: int, act_quant: bool = False) -> None:
    """xfh[t] = prepare_input(ZCRMSNorm(lane mean of lanes[t]; final_norm)) (§4.8, §3, §5.5.1);
    ``act_quant`` (deploy numerics) prepares A8 of the normed vector instead (§4.9 point 7).

    The lane mean sums the n lanes in order, then divides by n. Bindings (``final_norm.wgsl``):
    0 params, 1 ``fp16`` (the Fp16Store buffer), 2 ``lanes`` f32 [T][n][d], 3 ``xfh`` f32
    [T][pad(d)] (the prepared input of the tied head's cq_matmul). Workgroups: (T,), 256
    invocations. Constants: GROUP, CAP, FWHT_SCALE.
    """
    g = geometry
    d_pad = -(-g.d_model // group) * group
    key = KernelKey("final_norm", consts=(("GROUP", group), ("CAP", workgroup_cap(d_pad)),
                                          ("FWHT_SCALE", fwht_scale(group)), ("ACT_QUANT", bool(act_quant))))
    window = fp16_store.window(["final_norm"])
    params = arena.struct(key, d=g.d_model, lanes=g.mhc_lanes, out_pad=d_pad, norm_at=window.offset("final_norm"),
                          lane_stride=g.mhc_lanes * g.d_model)
    plan.add(key, [params, window.binding, lanes, xfh], (positions,), label="final_norm")
