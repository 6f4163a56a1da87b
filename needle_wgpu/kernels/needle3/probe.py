"""The probe heads (spec §7, §U a: embedding, confidence, router): GPU pooling over
positions, host finish (pure Python).

Per chunk: cells [T][C][d] (written by embed and mlp_mix) are prepared once, each head's k
probe rows per cell are a band of ``cq_matmul`` giving scores, and ``probe_pool.wgsl`` folds
them into that head's streaming state. After the last chunk the host reads the small state
back ([C·k][d + 2]) and finishes steps 1-3 of §7 with the dequantised query and projection rows.
"""

from __future__ import annotations

import copy
import math
import struct
from array import array

from ...constants import binary_level, inv_sqrt, ternary_level
from ...errors import UnsupportedModelError
from ...formats.cact import BINARY, CQ, CONFIDENCE_HEAD, EMBEDDING_HEAD, ROUTER_HEAD, TERNARY, CactFile
from ...gpu.device import Plan, UniformArena
from .. import cq
from ..cq import fwht_scale

CONFIDENCE, EMBEDDING, ROUTER = CONFIDENCE_HEAD, EMBEDDING_HEAD, ROUTER_HEAD
HEAD_NAMES = {EMBEDDING: "embedding", CONFIDENCE: "confidence", ROUTER: "router"}


def pool_reset_bytes(probes: int, d: int) -> bytes:
    """The empty pool: a = 0, m = -inf, s = 0 for every (cell, probe)."""
    row = struct.pack(f"<{d}f", *([0.0] * d)) + struct.pack("<ff", float("-inf"), 0.0)
    return row * probes


def pool(plan: Plan, arena: UniformArena, step, *, scores, cells, state, tokens, d: int, positions: int,
         probes: int, per_cell: int, cells_count: int) -> None:
    """Fold the chunk's scores [T][C·k] and cells [T][C][d] into the pool state (§7 step 1),
    skipping positions whose token (``tokens`` [context], at step.pos0 + t) is the pad id 0."""
    key = cq.KernelKey("probe_pool")
    params = arena.struct(key, d=d, positions=positions, probes=probes, per_cell=per_cell, cell_stride=cells_count * d,
                          inv_sqrt_d=inv_sqrt(d))
    plan.add(key, [params, scores, cells, state, step, tokens], (probes,), label="probe_pool")


def unpack_codes(data: bytes, bits: int) -> list:
    """The codes of an LSB-first bit stream of ``bits``-bit codes (§5.2), 8 codes per ``bits``
    bytes: linear in the data (no shifts of one big integer)."""
    mask = (1 << bits) - 1
    shifts = range(0, 8 * bits, bits)
    out = []
    for at in range(0, len(data), bits):
        word = int.from_bytes(data[at : at + bits], "little")
        out.extend((word >> shift) & mask for shift in shifts)
    return out


def dequantize_row(container: CactFile, name: str, row: int) -> array:
    """One CQ row as floats (§5.4) in pure Python: level·norm per group, then the FWHT.

    Time O(cols · log G), memory one float per column (an ``array('d')``).
    """
    t = container[name]
    assert t.dtype == CQ
    if t.bits == TERNARY:  # crumbs 0, 1, 2 (invalid), 3 (§5.2)
        table = [0.0, ternary_level(t.group), 0.0, -ternary_level(t.group)]
    elif t.bits == BINARY:  # §U b
        table = [-binary_level(t.group), binary_level(t.group)]
    else:
        table = list(container.levels(t.bits))
    codes = unpack_codes(bytes(t.codes[row * t.row_bytes : (row + 1) * t.row_bytes]), 2 if t.bits == TERNARY else t.bits)
    norms = struct.unpack_from(f"<{t.num_groups}e", t.norms, row * t.num_groups * 2)
    scale = fwht_scale(t.group)
    out = array("d")
    G = t.group
    for g in range(min(t.num_groups, -(-t.cols // G))):  # groups wholly past cols are padding
        norm = norms[g]
        u = [table[c] * norm for c in codes[g * G : (g + 1) * G]]
        h = 1
        while h < G:
            for i in range(0, G, 2 * h):
                for j in range(i, i + h):
                    a, b = u[j], u[j + h]
                    u[j], u[j + h] = a + b, a - b
            h *= 2
        out.extend(x * scale for x in u)
    del out[t.cols :]
    return out


def _halves(data) -> array:
    """FP16 values as an ``array('d')``, without a tuple of all of them."""
    out = array("d")
    for chunk in range(0, len(data), 8192):
        out.extend(struct.unpack(f"<{len(data[chunk : chunk + 8192]) // 2}e", data[chunk : chunk + 8192]))
    return out


# Host work of one confidence finish (multiply-adds of §7 steps 2-3 plus the FWHTs that decode
# the query and projection rows) that the engine accepts: ~1-2 s of pure Python. Shipped: 0.8M.
MAX_HOST_WORK = 1 << 23


class ProbeHead:
    """Host side of one probe head (manifest entry ``h``): small tensors decoded at load, the
    query and projection rows decoded at the first use (their cost is bounded by ``check``)."""

    def __init__(self, container: CactFile, h: int | None = None):
        if h is None:  # the confidence head
            h = container.head_codes.index(CONFIDENCE)
        self.code = code = container.head_codes[h]
        self.name = HEAD_NAMES[code]
        self.prefix = prefix = f"heads.{h}."
        self._container = container
        g = container.geometry
        self.d = g.d_model
        gain = container[prefix + "gain"]
        self.cells_count, self.per_cell = gain.shape
        self.gain = _halves(gain.data)
        query = container[prefix + "query"]
        self.queries = query.rows
        self.row_bias = _halves(container[prefix + "row_bias"].data)
        self.outputs = container[prefix + "proj"].rows
        self.bias = list(_halves(container[prefix + "bias"].data))
        self.calibration = (list(_halves(container[prefix + "calibration"].data)) if code == ROUTER else None)
        self.probes = container[prefix + "probes"]
        log_group = max(1, query.group.bit_length() - 1)
        self.host_work = (self.queries * self.probe_rows * self.d
                          + (self.queries + self.outputs) * self.queries * self.d * log_group
                          + self.outputs * self.queries * self.d)
        self._query = self._proj = None

    def check(self) -> None:
        """Refuse a head whose host finish would take more than ``MAX_HOST_WORK`` operations."""
        if self.host_work > MAX_HOST_WORK:
            raise UnsupportedModelError(
                f"{self.name} head: {self.queries} queries x {self.probe_rows} probes x d {self.d} need "
                f"{self.host_work} host operations per request (at most {MAX_HOST_WORK})")

    @property
    def query(self) -> list:
        if self._query is None:
            self._query = [dequantize_row(self._container, self.prefix + "query", q) for q in range(self.queries)]
        return self._query

    @property
    def proj(self) -> list:
        if self._proj is None:
            self._proj = [dequantize_row(self._container, self.prefix + "proj", o) for o in range(self.outputs)]
        return self._proj

    @property
    def probe_rows(self) -> int:
        return self.cells_count * self.per_cell

    def at_cells(self, cells: tuple) -> "ProbeHead":
        """This head reading only the given cells of the full model, in that order (a rung of
        elastic depth, §U f: gain rows and row_bias[:, c, :] of the kept cells). The probe rows
        stay where they are on the GPU: the caller reads cell ``cells[c]``'s band."""
        k, count = self.per_cell, self.probe_rows
        head = copy.copy(self)
        head.cells_count = len(cells)
        head.gain = array("d", [self.gain[c * k + kk] for c in cells for kk in range(k)])
        head.row_bias = array("d", [self.row_bias[q * count + c * k + kk]
                                    for q in range(self.queries) for c in cells for kk in range(k)])
        head.host_work = self.host_work - self.queries * (count - head.probe_rows) * self.d
        return head

    def logit(self, state: bytes) -> float:
        """The first output: the confidence logit (0.0, probability 0.5, with no position)."""
        out = self.output(state)
        return 0.0 if out is None else out[0]

    def output(self, state: bytes) -> list | None:
        """§7 steps 1 (finish: r = a / s, rms_unit, gain), 2 (query attention) and 3 (projection):
        the logits plus bias (confidence 1, router 3), or the L2-normalised embedding (§U a).
        None when the pool holds no position (every one was the pad id 0)."""
        d, count = self.d, self.probe_rows
        values = struct.unpack(f"<{count * (d + 2)}f", state)
        if not all(values[m * (d + 2) + d + 1] > 0 for m in range(count)):
            return None
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
        z = [sum(a * b for a, b in zip(row, pooled)) for row in self.proj]
        if self.code == EMBEDDING:  # no bias (stored as zeros), then L2-normalised
            inv = 1.0 / math.sqrt(sum(x * x for x in z) + 1e-12)
            return [x * inv for x in z]
        return [x + b for x, b in zip(z, self.bias)]


ConfidenceHead = ProbeHead  # the head's former name (one head per class now)
