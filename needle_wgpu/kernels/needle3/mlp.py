"""The block tail on the GPU (spec §4.5 items 10-13, §4.6, §4.7, §4.8): ``mlp_mix``.

Post norm and gated attention residual, the HadamardMLP (three Kronecker stages), the block
delta, the mHC scatter_up into the lanes and, optionally, the layer's cell (lane mean).

Reference functions: ``reference.ops.zc_rms_norm``, ``reference.needle3.attention.residual``,
``reference.needle3.hada_mlp.hada_mlp``, ``reference.needle3.mhc.scatter_up`` and ``lane_mean``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from ...errors import UnsupportedModelError
from ...formats.cact import CactFile
from ...gpu.device import Binding, Device, KernelKey, Plan, UniformArena
from .mhc import MAX_LANES, MhcState
from .fp16_store import Fp16Store

WORKGROUP_BYTES = 16384
THREADS = 256

_placeholders: "weakref.WeakKeyDictionary[Device, object]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class HadaShape:
    """Sizes of the HadaMLP: d, N = hada_n = ba·bb, the cond rank r (§0 item 3), ba and bb."""

    width: int
    hada_n: int
    rank: int
    ba: int
    bb: int

    @classmethod
    def from_cact(cls, cact: CactFile) -> "HadaShape":
        """Read the sizes from layer 0's records: cond_v [d, r], w1a [ba, ba], w1b [bb, bb]."""
        g = cact.geometry
        d, r = cact.layer(0, "cond_v").shape
        ba, bb = cact.layer(0, "w1a").shape[0], cact.layer(0, "w1b").shape[0]
        return cls(d, g.hada_n, r, ba, bb)

    def check(self, workgroup_bytes: int = WORKGROUP_BYTES) -> None:
        if self.ba * self.bb != self.hada_n or self.width > self.hada_n or not 1 <= self.rank <= self.hada_n:
            raise UnsupportedModelError(f"HadaMLP sizes {self} are inconsistent (§4.6)")
        if self.ba % 4 or self.bb % 4 or self.width % 4:
            raise UnsupportedModelError(
                f"mlp_mix: d = {self.width} and the Kronecker blocks {self.ba} x {self.bb} must be multiples of 4 "
                "(the kernel works on 4 x 4 tiles and 4-element slots)")
        limit = min(WORKGROUP_BYTES, workgroup_bytes)
        if self.workgroup_bytes > limit:
            raise UnsupportedModelError(
                f"mlp_mix: hada_n {self.hada_n} ({self.ba} x {self.bb}) needs more than "
                f"{limit} bytes of workgroup memory")

    @property
    def workgroup_bytes(self) -> int:
        """Two hada vectors, then the sum scratch: one vec4 per invocation, 16 row sums, the total."""
        return 4 * 2 * self.hada_n + 16 * (THREADS + 16 + 1)


def _placeholder(device: Device):
    """A 16-byte buffer bound as ``cells`` when no cell is written (the slot must be bound)."""
    buffer = _placeholders.get(device)
    if buffer is None:
        buffer = device.buffer(16, label="no_cells", kind="shared")
        _placeholders[device] = buffer
    return buffer


def mlp_mix(plan: Plan, arena: UniformArena, fp16: Fp16Store, perm, attn_out, state: MhcState, lanes, *,
            layer: int, shape: HadaShape, lanes_n: int, positions: int, cells=None, cell_index: int | None = None,
            cell_stride: int | None = None, attn_stride: int | None = None, attn_offset: int = 0,
            lane_stride: int | None = None, lane_offset: int = 0) -> None:
    """Block tail and scatter_up for one layer, in place in the lanes (§4.5 items 10-13, §4.6-§4.8).

    Per position t, with u, bx, hpost, Hres from ``state`` (written by ``mhc_mix``) and a the
    out_proj product ``attn_out[t]`` (``[T][d]``):
    bx += σ(attn_gate)·ZCRMSNorm(a; post_norm); bx += HadaMLP(ZCRMSNorm(bx; pre_hada));
    y = bx − u; X'[i] = Σ_j Hres[i,j]·X[j] + hpost_i·y written into lanes ``[T][n][d]``; with
    ``cells`` (``[T][L+1][d]``) the lane mean goes to cell ``cell_index`` (default layer + 1).

    ``layer`` indexes the stored tensors ``layers.{layer}.*``; ``perm`` is the u32 buffer of
    ``params.permutation_words`` (p1 at word 0, p2 at word hada_n).

    Bindings: 0 params, 1 attn_out (read), 2 state (read), 3 lanes (read-write), 4 fp16,
    5 perm (read), 6 cells (written; a placeholder when None): 6 storage. lanes and cells are
    written, so attn_out and state must not live in either of those buffers. Constants: WIDTH,
    LANES, BA, BB, RANK, WRITE_CELL (sizes are pipeline constants, see shaders/mlp_mix.wgsl).
    Workgroups: (T,), 256 invocations; workgroup memory ``shape.workgroup_bytes`` (12.3 KiB shipped).
    """
    shape.check()
    n, d, N = lanes_n, shape.width, shape.hada_n
    if not 1 <= n <= MAX_LANES:
        raise UnsupportedModelError(f"mlp_mix: {n} mHC lanes (at most {MAX_LANES} supported)")
    if positions > state.positions or (state.width, state.lanes) != (d, n):
        raise UnsupportedModelError("mlp_mix: the mhc_state scratch does not match this chunk")
    write_cell = cells is not None
    if cells is None:
        cells, cell_offset, cell_stride = _placeholder(plan.device), 0, 0
    else:
        cell_offset = ((layer + 1) if cell_index is None else cell_index) * d
        if cell_stride is None:
            raise UnsupportedModelError("mlp_mix: cell_stride is required with cells ((L+1)·d)")

    window = fp16.layer_window(layer)
    names = ("post_norm", "attn_gate", "pre_hada", "d1", "d2", "b2", "d3", "d4",
             "w1a", "w1b", "w2a", "w2b", "w3a", "w3b", "cond_v", "cond_u")
    halves = {name: window.offset(f"layers.{layer}.{name}") for name in names}
    if any(at % 2 for name, at in halves.items() if name != "attn_gate"):  # vectors are read as whole words
        raise UnsupportedModelError(f"mlp_mix: layer {layer}'s FP16 tensors are not 4-byte aligned")

    key = KernelKey("mlp_mix", consts=(("WIDTH", d), ("LANES", n), ("BA", shape.ba), ("BB", shape.bb),
                                       ("RANK", shape.rank), ("WRITE_CELL", write_cell)))
    params = arena.struct(
        key, lane_stride=lane_stride or n * d, lane_offset=lane_offset, a_stride=attn_stride or d, a_offset=attn_offset,
        u_at=state.u_at, bx_at=state.bx_at, hmix_at=state.hmix_at, cell_stride=cell_stride, cell_offset=cell_offset,
        post_norm_at=halves["post_norm"], attn_gate_at=halves["attn_gate"], pre_hada_at=halves["pre_hada"],
        d1_at=halves["d1"], d2_at=halves["d2"], b2_at=halves["b2"], d3_at=halves["d3"], d4_at=halves["d4"],
        w1a_at=halves["w1a"], w1b_at=halves["w1b"], w2a_at=halves["w2a"], w2b_at=halves["w2b"],
        w3a_at=halves["w3a"], w3b_at=halves["w3b"], cond_v_at=halves["cond_v"], cond_u_at=halves["cond_u"],
        p1_at=0, p2_at=N)
    plan.add(key, [params, attn_out, Binding(state.buffer), lanes, window.binding, perm, cells],
             (positions,), label=f"mlp_mix {layer}")
