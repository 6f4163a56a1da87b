"""The mHC lane stream on the GPU (spec §4.4, §4.5 items 1-2, §4.7): lane norm and mix_down.

Per layer the model runs ``mhc_norm`` (lanes -> nxh), the band ``cq_matmul`` of the layer's 24
phi rows (nxh -> mix_dots) and ``mhc_mix`` (lanes, mix_dots -> u, bx, hpost, Hres, hh). The
block tail, including scatter_up, is ``kernels.needle3.mlp.mlp_mix``.

Reference functions: ``reference.needle3.mhc`` (lane_norm, pre_weights, post_weights, residual_mix,
mix_down), ``reference.needle3.engram.gate``, ``reference.ops.zc_rms_norm``, ``reference.needle3.cq.prepare_input``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ...errors import UnsupportedModelError
from ...gpu.device import Binding, Buffer, Device, KernelKey, Plan, UniformArena
from ..cq import fwht_scale
from .fp16_store import Fp16Store

MAX_LANES = 16  # the Sinkhorn works on n x n in one invocation's registers
WORKGROUP_BYTES = 16384
_SUM_BYTES = 16 * (256 + 16 + 1)  # mhc_mix's workgroup_sum scratch: a vec4 per invocation, 16 rows, total


@dataclass
class MhcState:
    """The scratch that ``mhc_mix`` writes and ``mlp_mix`` reads, one buffer (f32 offsets).

    u ``[T][d]`` at ``u_at``, bx ``[T][d]`` at ``bx_at``, hmix ``[T][n + n·n]`` at ``hmix_at``
    (hpost_i at i, then Hres[i, j] at n + i·n + j). One buffer keeps mhc_mix at 7 storage
    bindings and mlp_mix at 6. ``positions`` is the capacity (the largest chunk).
    """

    buffer: Buffer
    positions: int
    width: int
    lanes: int

    @property
    def u_at(self) -> int:
        return 0

    @property
    def bx_at(self) -> int:
        return self.positions * self.width

    @property
    def hmix_at(self) -> int:
        return 2 * self.positions * self.width

    @property
    def hmix_stride(self) -> int:
        return self.lanes + self.lanes * self.lanes

    @staticmethod
    def floats(positions: int, width: int, lanes: int) -> int:
        return positions * (2 * width + lanes + lanes * lanes)


def mhc_state(device: Device, positions: int, width: int, lanes: int, label: str = "mhc_state") -> MhcState:
    """Allocate the u / bx / hmix scratch for chunks of up to ``positions`` positions."""
    buffer = device.buffer(4 * MhcState.floats(positions, width, lanes), label=label)
    return MhcState(buffer, positions, width, lanes)


@dataclass(frozen=True)
class EngramGateInputs:
    """Where one Engram site's K and V sit (dispatch table rows 3-4 of docs/gpu-layout.md).

    K of site s is at ``ekv[t][s·2d : s·2d + d]`` (rows ``[T][sites·2d]``) and V at
    ``ev[t][s][:]`` (rows ``[T][sites][d]``).
    """

    ekv: object  # Buffer or Binding
    ev: object
    site: int
    sites: int


def _pad(width: int, group: int) -> int:
    return (width + group - 1) // group * group


def _cap(in_pad: int) -> int:
    """Workgroup buffer length: in_pad rounded up to 256 floats, so few pipeline variants exist."""
    return (in_pad + 255) // 256 * 256


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def check(lanes_n: int, width: int, group: int, workgroup_bytes: int) -> None:
    """What mhc_norm and mhc_mix need (called at load; the ops check the same at build)."""
    n, d = lanes_n, width
    limit = min(WORKGROUP_BYTES, workgroup_bytes)
    if not 1 <= n <= MAX_LANES:
        raise UnsupportedModelError(f"mhc_mix: {n} mHC lanes (at most {MAX_LANES} supported)")
    if d % 4:
        raise UnsupportedModelError(f"mhc_mix: d = {d} is not a multiple of 4 (the kernel works on 4-channel slots)")
    if 4 * _cap(_pad(n * d, group)) + 1024 > limit:
        raise UnsupportedModelError(f"mhc_norm: n·d = {n * d} (group {group}) needs more than {limit} bytes of "
                                    "workgroup memory")
    if 4 * _pad(d, group) + 4 * n + _SUM_BYTES > limit:
        raise UnsupportedModelError(f"mhc_mix: d = {d} (group {group}) needs more than {limit} bytes of workgroup memory")


def mhc_norm(plan: Plan, arena: UniformArena, lanes, nxh, *, lanes_n: int, width: int, group: int,
             positions: int, lane_stride: int | None = None, lane_offset: int = 0,
             y_stride: int | None = None, y_offset: int = 0, act_quant: bool = False) -> None:
    """nxh[t] = prepare_input(rms_unit(flatten(X_t))) (§4.4, §5.5.1); ``act_quant`` (deploy
    numerics) prepares A8(rms_unit(flatten(X_t))) instead (§4.9 point 2).

    Bindings: 0 params (uniform), 1 lanes f32 ``[T][n][d]`` (read), 2 nxh f32
    ``[T][pad(n·d)]`` (written). Strides default to n·d and pad(n·d); offsets are in floats.
    Constants: GROUP, CAP (= pad(n·d) rounded up to 256), FWHT_SCALE. Workgroups: (T,), 256
    invocations each; workgroup memory 4·CAP + 1 KiB (13 KiB shipped at n·d = 3072).
    """
    flat = lanes_n * width
    in_pad = _pad(flat, group)
    cap = _cap(in_pad)
    if 4 * cap + 1024 > WORKGROUP_BYTES:
        raise UnsupportedModelError(
            f"mhc_norm: n·d = {flat} needs more than {WORKGROUP_BYTES} bytes of workgroup memory")
    key = KernelKey("mhc_norm", consts=(("GROUP", group), ("CAP", cap), ("FWHT_SCALE", fwht_scale(group)),
                                        ("ACT_QUANT", bool(act_quant))))
    params = arena.struct(key, width=flat, in_pad=in_pad, x_stride=lane_stride or flat, x_offset=lane_offset,
                          y_stride=y_stride or in_pad, y_offset=y_offset)
    plan.add(key, [params, lanes, nxh], (positions,), label="mhc_norm")


def mhc_mix(plan: Plan, arena: UniformArena, fp16: Fp16Store, lanes, mix_dots, state: MhcState, hh, *,
            layer: int, lanes_n: int, width: int, group: int, positions: int,
            active_lane: int | None = None, engram: EngramGateInputs | None = None,
            mix_stride: int | None = None, mix_offset: int = 0, lane_stride: int | None = None,
            lane_offset: int = 0, hh_stride: int | None = None, hh_offset: int = 0,
            act_quant: bool = False) -> None:
    """mix_down, lane weights, Sinkhorn, Engram gate and the prepared block input (§4.4-§4.7);
    ``act_quant`` (deploy numerics): hh = prepare_input(A8(ZCRMSNorm(bx; norm_in))) (§4.9 point 3).

    Reads lanes ``[T][n][d]`` and mix_dots ``[T][n + n + n·n]`` (pre_j, post_j, res_ij: the raw
    phi·nx products of the layer's band, from ``cq_matmul``). Writes into ``state`` u, bx and
    hmix (hpost_i, Hres row-major) and into hh ``[T][pad(d)]`` = prepare_input(ZCRMSNorm(bx;
    norm_in)), ready for the qkvg matmul.

    ``layer`` indexes the stored tensors (``mhc.a_pre``…, ``layers.{layer}.norm_in``);
    ``active_lane`` defaults to ``layer mod n`` (after ladder slicing, pass the block's new index
    mod n, §10). ``engram`` is given at an Engram site layer, None elsewhere.

    Bindings: 0 params, 1 lanes, 2 mix_dots, 3 fp16 (the store), 4 ekv, 5 ev (read; at a
    non-site layer the lanes are bound there and never read), 6 state, 7 hh (written): 7 storage.
    state and hh are written, so they must be buffers distinct from each other and the inputs.
    Constants: GROUP, LANES, WIDTH, ENGRAM, FWHT_SCALE (sizes and the site switch are pipeline
    constants, see shaders/mhc_mix.wgsl). Workgroups: (T,), 256 invocations; workgroup memory
    4·pad(d) + 4·n + 4368 bytes (7.3 KiB shipped).
    """
    n, d = lanes_n, width
    if not 1 <= n <= MAX_LANES:
        raise UnsupportedModelError(f"mhc_mix: {n} mHC lanes (at most {MAX_LANES} supported)")
    if d % 4:
        raise UnsupportedModelError(f"mhc_mix: d = {d} is not a multiple of 4 (the kernel works on 4-channel slots)")
    if positions > state.positions or (state.width, state.lanes) != (d, n):
        raise UnsupportedModelError("mhc_mix: the mhc_state scratch does not match this chunk")
    d_pad = _pad(d, group)
    if 4 * d_pad + 4 * n + _SUM_BYTES > WORKGROUP_BYTES:
        raise UnsupportedModelError(f"mhc_mix: d = {d} needs more than {WORKGROUP_BYTES} bytes of workgroup memory")
    active = layer % n if active_lane is None else active_lane
    if engram is None:
        ekv = ev = lanes
        ekv_stride = key_offset = ev_stride = value_offset = 0
    else:
        ekv, ev = engram.ekv, engram.ev
        ekv_stride, key_offset = engram.sites * 2 * d, engram.site * 2 * d
        ev_stride, value_offset = engram.sites * d, engram.site * d
    window = fp16.layer_window(layer)
    off = window.offset
    mhc = f"layers.{layer}.mhc."
    norm_in = off(f"layers.{layer}.norm_in")
    if norm_in % 2:  # read as whole words
        raise UnsupportedModelError(f"mhc_mix: layers.{layer}.norm_in is not 4-byte aligned")
    key = KernelKey("mhc_mix", consts=(("GROUP", group), ("LANES", n), ("WIDTH", d), ("ENGRAM", engram is not None),
                                       ("FWHT_SCALE", fwht_scale(group)), ("ACT_QUANT", bool(act_quant))))
    params = arena.struct(
        key, active_lane=active, lane_stride=lane_stride or n * d, lane_offset=lane_offset,
        mix_stride=mix_stride or 2 * n + n * n, mix_offset=mix_offset, ekv_stride=ekv_stride, key_offset=key_offset,
        ev_stride=ev_stride, value_offset=value_offset, u_at=state.u_at, bx_at=state.bx_at, hmix_at=state.hmix_at,
        hh_stride=hh_stride or d_pad, hh_offset=hh_offset,
        a_pre_at=off(mhc + "a_pre"), a_post_at=off(mhc + "a_post"), a_res_at=off(mhc + "a_res"),
        b_pre_at=off(mhc + "b_pre"), b_post_at=off(mhc + "b_post"), b_res_at=off(mhc + "b_res"),
        norm_in_at=norm_in, sqrt_d=_f32(math.sqrt(d)))
    plan.add(key, [params, lanes, mix_dots, window.binding, ekv, ev, Binding(state.buffer), hh],
             (positions,), label=f"mhc_mix {layer}")
