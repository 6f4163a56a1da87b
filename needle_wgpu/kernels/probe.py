"""The confidence probe head (spec §7): GPU pooling over positions, host finish (pure Python).

Per chunk: cells [T][C][d] (written by embed and mlp_mix) are prepared, each cell's k probe
rows are a band of ``cq_matmul`` giving scores, and ``probe_pool.wgsl`` folds them into the
streaming state. After the last chunk the host reads the small state back ([C·k][d + 2]) and
finishes steps 1-3 of §7 with the dequantised query and projection rows.
"""

from __future__ import annotations

import math
import struct

from ..constants import inv_sqrt, ternary_level
from ..formats.cact import CQ, CactFile
from ..gpu.device import Plan, UniformArena
from . import cq
from .cq import fwht_scale

CONFIDENCE = 2


def pool_reset_bytes(probes: int, d: int) -> bytes:
    """The empty pool: a = 0, m = -inf, s = 0 for every (cell, probe)."""
    row = struct.pack(f"<{d}f", *([0.0] * d)) + struct.pack("<ff", float("-inf"), 0.0)
    return row * probes


def pool(plan: Plan, arena: UniformArena, *, scores, cells, state, d: int, positions: int, probes: int,
         per_cell: int, cells_count: int) -> None:
    """Fold the chunk's scores [T][C·k] and cells [T][C][d] into the pool state (§7 step 1)."""
    params = arena.add(d, positions, probes, per_cell, cells_count * d, inv_sqrt(d), 0, 0)
    plan.add(cq.KernelKey("probe_pool"), [params, scores, cells, state], (probes,), label="probe_pool")


def dequantize_row(container: CactFile, name: str, row: int) -> list:
    """One CQ row as floats (§5.4) in pure Python: level·norm per group, then the FWHT."""
    t = container[name]
    assert t.dtype == CQ
    levels = container.levels(t.bits) or (-ternary_level(t.group), 0.0, ternary_level(t.group))
    table = list(levels) if t.bits != 5 else [0.0, levels[2], 0.0, levels[0]]
    codes = bytes(t.codes[row * t.row_bytes : (row + 1) * t.row_bytes])
    norms = struct.unpack_from(f"<{t.num_groups}e", t.norms, row * t.num_groups * 2)
    bits = 2 if t.bits == 5 else t.bits
    value = int.from_bytes(codes, "little")
    mask = (1 << bits) - 1
    scale = fwht_scale(t.group)
    out = []
    for g in range(t.num_groups):
        u = [table[(value >> ((g * t.group + m) * bits)) & mask] * norms[g] for m in range(t.group)]
        h = 1
        while h < t.group:
            for i in range(0, t.group, 2 * h):
                for j in range(i, i + h):
                    a, b = u[j], u[j + h]
                    u[j], u[j + h] = a + b, a - b
            h *= 2
        out += [x * scale for x in u]
    return out[: t.cols]


class ConfidenceHead:
    """Host side of the confidence head: the tensors needed after pooling, decoded once."""

    def __init__(self, container: CactFile):
        h = container.head_codes.index(CONFIDENCE)
        self.prefix = prefix = f"heads.{h}."
        g = container.geometry
        self.d = g.d_model
        gain = container[prefix + "gain"]
        self.cells_count, self.per_cell = gain.shape
        self.gain = struct.unpack(f"<{gain.size}e", gain.data)
        queries = container[prefix + "query"].rows
        self.query = [dequantize_row(container, prefix + "query", q) for q in range(queries)]
        row_bias = container[prefix + "row_bias"]
        self.row_bias = struct.unpack(f"<{row_bias.size}e", row_bias.data)
        self.proj = dequantize_row(container, prefix + "proj", 0)
        self.bias = struct.unpack("<e", container[prefix + "bias"].data)[0]
        self.probes = container[prefix + "probes"]

    @property
    def probe_rows(self) -> int:
        return self.cells_count * self.per_cell

    def logit(self, state: bytes) -> float:
        """§7 steps 1 (finish: r = a / s, rms_unit, gain), 2 (query attention) and 3 (projection)."""
        d, count = self.d, self.probe_rows
        values = struct.unpack(f"<{count * (d + 2)}f", state)
        readouts = []
        for m in range(count):
            row = values[m * (d + 2) : (m + 1) * (d + 2)]
            s = row[d + 1]
            r = [a / s for a in row[:d]]
            inv = 1.0 / math.sqrt(sum(x * x for x in r) / d + 1e-6)
            readouts.append([x * inv * self.gain[m] for x in r])
        pooled = []
        root = math.sqrt(d)
        for q, query in enumerate(self.query):
            v = [sum(a * b for a, b in zip(r, query)) / root + self.row_bias[q * count + m]
                 for m, r in enumerate(readouts)]
            top = max(v)
            e = [math.exp(x - top) for x in v]
            total = sum(e)
            w = [x / total for x in e]
            pooled += [sum(w[m] * readouts[m][c] for m in range(count)) for c in range(d)]
        return sum(a * b for a, b in zip(self.proj, pooled)) + self.bias
