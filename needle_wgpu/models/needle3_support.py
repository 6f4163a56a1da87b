"""What the kernels support, checked once when a Needle 3 model is opened (STYLE.md: a file
that cannot be served is refused when it is opened, not at its first request).

Each kernel module states its own limits as ``check(...)`` on plain sizes; this walks the
model's geometry through all of them before anything is uploaded. A refusal names the kernel
and the limit: ``UnsupportedModelError`` for what a kernel cannot compute, ``DeviceLimitError``
for what this device's limits cannot hold.
"""

from __future__ import annotations

from ..errors import DeviceLimitError
from ..formats.cact import CactFile
from ..formats.needle3_geometry import Needle3Geometry
from ..gpu.device import Limits
from ..kernels import attention as attention_ops
from ..kernels import cq
from ..kernels.needle3 import embed as embed_ops, engram as engram_ops, mhc as mhc_ops, mlp as mlp_ops
from ..kernels import sample as sample_ops

F32 = 4


def _pad(width: int, group: int) -> int:
    return (width + group - 1) // group * group


def widest_row_bytes(g: Needle3Geometry, group: int) -> int:
    """Bytes of the widest per-position scratch row of a session: one chunk position of it must
    fit a storage binding (the prefill chunk is as long as the binding limit allows)."""
    sites = len(g.engram_sites)
    return F32 * max(g.head_rows, g.mhc_width, sites * 2 * g.d_model, sites * _pad(g.engram_width, group),
                     g.q_dim + g.k_dim + g.v_dim + g.attn_out)


def check_supported(container: CactFile, limits: Limits) -> None:
    """Refuse, before any upload, a model some kernel or this device's limits cannot serve."""
    g = container.geometry
    group = container["embedding"].group  # one group for every CQ tensor (cact checks it)
    # Every record has its own width (§U b); packs of several widths run one band per width.
    workgroup = limits.max_workgroup_storage
    cq.check(group)
    embed_ops.check(g.d_model, group, workgroup)
    engram_ops.check(g, group, workgroup)
    mhc_ops.check(g.mhc_lanes, g.d_model, group, workgroup)
    for layer in range(g.num_layers):
        attention_ops.check(attention_ops.needle3_shape(g, layer), workgroup)
    cq.check_prepare(g.attn_out, group, workgroup)  # the attention output before out_proj
    mlp_ops.HadaShape.from_cact(container).check(workgroup)
    sample_ops.check(g.head_rows)
    if container.head_codes:
        cq.check_prepare(g.d_model, group, workgroup)  # the hidden cells before the probes
    widest = widest_row_bytes(g, group)
    if widest > limits.max_storage_binding:
        raise DeviceLimitError(f"one position of a session's widest scratch row ({widest} bytes) exceeds "
                               f"maxStorageBufferBindingSize {limits.max_storage_binding}")
    _check_engram_tables_fit(container, limits)


def _check_engram_tables_fit(container: CactFile, limits: Limits) -> None:
    """engram fetch binds one site's tables whole: they must fit one storage binding."""
    for s in range(len(container.geometry.engram_sites)):
        t = container[f"engram.{s}.tables"]
        need = t.rows * t.row_bytes + (t.rows * t.num_groups * 2 + 3) // 4 * 4
        if need > limits.max_storage_binding:
            raise DeviceLimitError(f"engram.{s}.tables: {need} bytes must fit one storage binding "
                                   f"(maxStorageBufferBindingSize {limits.max_storage_binding})")
