"""CQ weights on the GPU (spec §5): upload in quantised form, prepare activations, matmul.

Reference functions: ``needle_wgpu.reference.needle3.cq.prepare_input`` and ``matmul_prepared``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ..constants import binary_level, inv_sqrt, ternary_level
from ..errors import DeviceLimitError, UnsupportedModelError
from ..formats.cact import BINARY, TERNARY, CactFile
from ..gpu.device import Binding, Device, KernelKey, Plan, UniformArena
from .packs import RowPart, pieces, split_rows

# Offsets of each width's level table inside the levels buffer (16 floats per width).
LEVEL_BASE = {2: 0, 3: 16, 4: 32, TERNARY: 48, BINARY: 64}
LEVELS_BYTES = 4 * 16 * len(LEVEL_BASE)
CODE_BITS = {2: 2, 3: 3, 4: 4, TERNARY: 2, BINARY: 1}
ROWWISE_CODE_BITS = (2, 4)  # the widths cq_matmul_rows.wgsl decodes
MATMUL_ROWS = 8
ROWWISE_TILE = 8  # positions per invocation of cq_matmul_rows in prefill
ROWWISE_ROWS = 4  # rows per invocation of cq_matmul_rows (they share each activation load)


def check(group: int) -> None:
    """What every CQ kernel needs of a pack (called at load): the group is whole 32-code chunks."""
    if group % 32:
        raise UnsupportedModelError(f"cq: CQ group {group} is not a multiple of 32")


def prepare_cap(width: int, group: int) -> int:
    """cq_prepare's workgroup buffer (floats): in_pad rounded up to a power of two, at least 256."""
    in_pad = (width + group - 1) // group * group
    return max(256, 1 << (in_pad - 1).bit_length())


def check_prepare(width: int, group: int, workgroup_bytes: int) -> None:
    """cq_prepare of rows ``width`` wide fits the device's workgroup memory (called at load)."""
    if 4 * prepare_cap(width, group) > workgroup_bytes:
        raise UnsupportedModelError(f"cq_prepare: rows of {width} (group {group}) need "
                                    f"{4 * prepare_cap(width, group)} bytes of workgroup memory "
                                    f"(the device has {workgroup_bytes})")


def levels_bytes(cact: CactFile) -> bytes:
    """Level tables of every width, padded to 16 entries; ternary maps crumbs to levels (§5.2),
    1-bit codes 0 and 1 to ∓sqrt(2/π)/sqrt(G) (§U b). ``LEVELS_BYTES`` long."""
    out = bytearray()
    for bits in (2, 3, 4):
        table = list(cact.levels(bits))
        out += struct.pack("<16f", *(table + [0.0] * (16 - len(table))))
    group = next(t.group for t in cact.tensors.values() if t.is_cq)
    c = ternary_level(group)
    # crumb 0 -> 0, 1 -> +c, 2 -> invalid (0, as the Rust reader does), 3 -> -c
    out += struct.pack("<16f", 0.0, c, 0.0, -c, *([0.0] * 12))
    b = binary_level(group)
    out += struct.pack("<16f", -b, b, *([0.0] * 14))
    assert len(out) == LEVELS_BYTES
    return bytes(out)


def fwht_scale(group: int) -> float:
    """The f32 value of 1/sqrt(G) (§3), rounded once on the host."""
    return inv_sqrt(group)


# One buffer of whole pack rows: codes of its rows, then their FP16 norms.
CQSlice = RowPart


@dataclass
class CQPack:
    """CQ tensors with the same input width and group, concatenated along rows.

    Every record has its own width (§U b). A pack whose rows all share one width holds its
    buffers in ``slices``; otherwise ``bands`` lists (first pack row, uniform CQPack) for each
    run of rows of one width, and ``bits`` is 0. ``matmul`` dispatches once per band.
    """

    name: str
    slices: list
    rows: int
    cols: int
    group: int
    bits: int
    bands: list = field(default_factory=list)

    @property
    def in_pad(self) -> int:
        return (self.cols + self.group - 1) // self.group * self.group

    @property
    def groups(self) -> int:
        return self.in_pad // self.group

    @property
    def row_words(self) -> int:
        return self.in_pad * CODE_BITS[self.bits] // 32


def upload_pack(device: Device, name: str, parts: list) -> CQPack:
    """Upload CQ tensors straight from the file's memoryviews (no dequantised copy).

    ``parts`` are tensors or (tensor, first_row, end_row) row ranges, stacked in order (the mHC
    pack interleaves the three phi matrices layer by layer so one layer is one band). A pack
    larger than the device's storage-binding limit is split along rows into several buffers;
    ``matmul`` dispatches once per buffer.
    """
    segments = [p if isinstance(p, tuple) else (p, 0, p.rows) for p in parts]
    tensors = [t for t, _, _ in segments]
    first = tensors[0]
    for t in tensors:
        if (t.cols, t.group) != (first.cols, first.group):
            raise UnsupportedModelError(f"{name}: tensors of a pack differ in input width or group")
    runs = []  # consecutive segments of one bit width
    for segment in segments:
        if runs and runs[-1][-1][0].bits == segment[0].bits:
            runs[-1].append(segment)
        else:
            runs.append([segment])
    if len(runs) > 1:
        bands, first_row = [], 0
        for k, run in enumerate(runs):
            band = _upload_uniform(device, f"{name}.band{k}", run)
            bands.append((first_row, band))
            first_row += band.rows
        return CQPack(name, [], first_row, first.cols, first.group, 0, bands)
    return _upload_uniform(device, name, segments)


def _upload_uniform(device: Device, name: str, segments: list) -> CQPack:
    """One pack of row ranges that share input width, group and bits."""
    first = segments[0][0]
    t = first
    if first.group % 32:
        raise UnsupportedModelError(f"{t.name}: CQ group {first.group} is not a multiple of 32")
    total_rows = sum(hi - lo for _, lo, hi in segments)
    pack = CQPack(name, [], total_rows, first.cols, first.group, first.bits)
    row_bytes, norm_bytes = pack.row_words * 4, pack.groups * 2
    per_row = row_bytes + norm_bytes
    for start, rows in split_rows(name, total_rows, per_row, device.limits.max_storage_binding, multiple=2):
        norm_at = rows * row_bytes
        size = norm_at + (rows * norm_bytes + 3) // 4 * 4
        buffer = device.buffer(size, label=f"{name}[{start}:{start + rows}]", kind="weights")
        _write_rows(device, buffer, segments, start, rows, row_bytes, norm_bytes, norm_at)
        pack.slices.append(CQSlice(buffer, start, rows))
    return pack


def _write_rows(device, buffer, segments, start, rows, row_bytes, norm_bytes, norm_at):
    """Copy pack rows [start, start+rows) of the segments into one slice buffer."""
    offset_rows, written = 0, 0
    for t, first_row, end_row in segments:
        count = end_row - first_row
        lo, hi = max(start, offset_rows), min(start + rows, offset_rows + count)
        if lo < hi:
            a, b = lo - offset_rows + first_row, hi - offset_rows + first_row
            device.write(buffer, t.codes[a * row_bytes : b * row_bytes], written * row_bytes)
            norms = t.norms[a * norm_bytes : b * norm_bytes]
            at = norm_at + written * norm_bytes
            if at % 4 or len(norms) % 4:
                # Odd half-word alignment: merge with the neighbouring norm bytes on the host.
                _write_unaligned(device, buffer, at, bytes(norms))
            else:
                device.write(buffer, norms, at)
            written += b - a
        offset_rows += count


def _write_unaligned(device, buffer, at, data):
    begin = at // 4 * 4
    end = (at + len(data) + 3) // 4 * 4
    current = bytearray(device.read(buffer, end - begin, begin))
    current[at - begin : at - begin + len(data)] = data
    device.write(buffer, bytes(current), begin)


def prepare(plan: Plan, arena: UniformArena, x, xh, *, width: int, group: int, positions: int,
            x_stride: int, x_offset: int = 0, y_stride: int | None = None, y_offset: int = 0,
            act_quant: bool = False) -> None:
    """xh[t] = per-group normalised FWHT of x[t] padded to in_pad (§5.5.1); with ``act_quant``
    of A8(x[t]) instead (deploy numerics, §4.9; reference ``reference.ops.fake_quant``)."""
    in_pad = (width + group - 1) // group * group
    cap = prepare_cap(width, group)
    key = KernelKey("cq_prepare", consts=(("GROUP", group), ("CAP", cap), ("FWHT_SCALE", fwht_scale(group)),
                                          ("ACT_QUANT", bool(act_quant))))
    params = arena.struct(key, width=width, in_pad=in_pad, x_stride=x_stride, x_offset=x_offset,
                          y_stride=y_stride or in_pad, y_offset=y_offset)
    plan.add(key, [params, x, xh], (positions,), label="cq_prepare")


def matmul(plan: Plan, arena: UniformArena, pack: CQPack, levels, xh, y, *, positions: int,
           x_stride: int, y_stride: int, x_offset: int = 0, y_offset: int = 0, row_start: int = 0,
           rows: int | None = None, x_block_rows: int = 0, x_block_stride: int = 0,
           tile: int | None = None) -> None:
    """y[t, row - row_start] = W[row] . xh[t] for the pack rows [row_start, row_start + rows)."""
    rows = pack.rows - row_start if rows is None else rows
    if pack.bands:
        _matmul_bands(plan, arena, pack, levels, xh, y, positions=positions, x_stride=x_stride, y_stride=y_stride,
                      x_offset=x_offset, y_offset=y_offset, row_start=row_start, rows=rows,
                      x_block_rows=x_block_rows, x_block_stride=x_block_stride, tile=tile)
        return
    code_bits = CODE_BITS[pack.bits]
    # CPU adapters get the barrier-free row-per-invocation variant (cq_matmul_rows.wgsl).
    rowwise = plan.device.software_rasterizer and code_bits in ROWWISE_CODE_BITS
    if rowwise:
        # TT is 1, 4 or 8: a short chunk (a speculative verify) takes the 4-position variant
        tile = 1 if positions == 1 else 4 if positions <= 4 else ROWWISE_TILE
        if (x_stride | x_offset | x_block_stride) % 4:
            raise ValueError("cq_matmul_rows reads xh as vec4: strides and offsets must be multiples of 4")
        rows_each = 1 if x_block_rows > 0 else ROWWISE_ROWS  # a row's input block decides its x
        key = KernelKey("cq_matmul_rows", consts=(
            ("CODE_BITS", code_bits), ("LEVEL_BASE", LEVEL_BASE[pack.bits]), ("TT", tile), ("ROWS", rows_each),
            ("GROUPS", pack.groups), ("GROUP_CHUNKS", pack.group // 32), ("BLOCKED", x_block_rows > 0)))
        rows_per_group = 64 * rows_each
    else:
        tile = tile or (1 if positions == 1 else 8)
        key = KernelKey("cq_matmul", consts=(("CODE_BITS", code_bits), ("LEVEL_BASE", LEVEL_BASE[pack.bits]),
                                              ("TT", tile), ("ROWS", MATMUL_ROWS)))
        rows_per_group = MATMUL_ROWS
    end = row_start + rows
    for piece, lo, hi in pieces(pack.slices, row_start, end):
        done = lo - row_start
        if x_block_rows and done % x_block_rows and (hi - lo) > x_block_rows - done % x_block_rows:
            raise DeviceLimitError(f"{pack.name}: a split crosses an input block; raise the binding limit")
        block_shift = (done // x_block_rows) * x_block_stride if x_block_rows else 0
        params = arena.struct(key, rows=hi - lo, row_start=lo - piece.first, row_words=pack.row_words,
                              groups=pack.groups, norm_base=piece.rows * pack.row_words, group_chunks=pack.group // 32,
                              positions=positions, x_stride=x_stride, x_offset=x_offset + block_shift,
                              x_block_rows=x_block_rows, x_block_stride=x_block_stride, y_stride=y_stride,
                              y_offset=y_offset + done)
        groups = ((hi - lo + rows_per_group - 1) // rows_per_group, (positions + tile - 1) // tile)
        plan.add(key, [params, Binding(piece.buffer), levels, xh, y], groups, label=f"matmul {pack.name}")


def _matmul_bands(plan, arena, pack: CQPack, levels, xh, y, *, positions, x_stride, y_stride, x_offset, y_offset,
                  row_start, rows, x_block_rows, x_block_stride, tile) -> None:
    """``matmul`` over a pack of several widths: one dispatch per band the rows overlap.

    With input blocks (``x_block_rows``), a band is cut further at block boundaries so each
    dispatch reads one block of xh at its own offset.
    """
    end = row_start + rows
    for first, band in pack.bands:
        lo, hi = max(row_start, first), min(end, first + band.rows)
        cuts = [lo]
        if x_block_rows:
            step = (lo - row_start) // x_block_rows * x_block_rows + row_start
            cuts += [b for b in range(step + x_block_rows, hi, x_block_rows)]
        for a, b in zip(cuts, cuts[1:] + [hi]):
            if a >= b:
                continue
            shift = (a - row_start) // x_block_rows * x_block_stride if x_block_rows else 0
            matmul(plan, arena, band, levels, xh, y, positions=positions, x_stride=x_stride, y_stride=y_stride,
                   x_offset=x_offset + shift, y_offset=y_offset + a - row_start, row_start=a - first, rows=b - a,
                   tile=tile)
