"""GGUF weights on the GPU (dense-gguf spec §4, §8): quantised packs, dequant-matmul, row gather.

Weights keep the file's quantised bits (§4.3): the single f16 of an unaligned block type (Q4_0,
Q5_0, Q8_0, Q6_K, Q3_K, IQ4_NL) moves to a side plane of f16 pairs, every other byte stays as u32
words in GGUF row-major block order; the other types (Q2_K and IQ4_XS blocks are whole words) are
uploaded as stored. Tensors above the binding
limit are split by whole rows (§4.4, ``packs.split_rows``).

Ops (plain functions over a Plan, as for CQ):
- ``q_matmul``: y[t][o] = sum_i W[o, i] x[t][i]; a GEMV or a chunked GEMM, in the CPU-adapter
  shape (``q_matmul_rows.wgsl``) or the GPU shape (``q_matmul.wgsl``), chosen from the adapter.
- ``get_rows``: the embedding gather, out[t] = scale * W[min(tokens[pos0 + t], rows - 1)].

Reference functions: ``needle_wgpu.reference.qmatmul.dequantize`` / ``matmul`` / ``get_rows``.
Everything here is pure Python (it runs in Pyodide).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..formats.gguf_types import BY_NAME
from ..gpu.device import Binding, Device, KernelKey, Plan, UniformArena
from .packs import RowPart, pieces, split_rows


@dataclass(frozen=True)
class QType:
    """One GGUF tensor type as the kernels see it (§4.1, §4.3).

    ``weights``/``nbytes``: a GGUF block. On the GPU a block is ``gpu_weights`` weights in
    ``words`` u32 words of the word plane (float types: one quad of 4 weights), plus one f16 in
    the side plane when ``side_half`` is not None (the f16's index among the block's halves).
    A block's weights share a scale by sub-blocks of ``sub_weights`` (K-quants: 32; Q6_K, Q3_K, Q2_K: 16).
    """

    name: str
    ggml: int            # GGMLQuantizationType value (also the WGSL QTYPE constant)
    weights: int
    nbytes: int
    words: int
    side_half: int | None = None
    sub_weights: int = 32

    @property
    def gpu_weights(self) -> int:
        return max(4, self.weights)

    @property
    def quads(self) -> int:
        return self.gpu_weights // 4

    @property
    def sub_quads(self) -> int:
        return min(self.sub_weights, self.gpu_weights) // 4


def _gpu_layout(name: str, words: int, side_half: int | None = None, sub_weights: int = 32) -> QType:
    """The GPU layout of a GGUF type; its block size, bytes and id are the format's own table."""
    t = BY_NAME[name]
    return QType(name, t.id, t.block_size, t.type_size, words, side_half, sub_weights)


QTYPES = {t.name: t for t in (
    _gpu_layout("F32", 4),
    _gpu_layout("F16", 2),
    _gpu_layout("BF16", 2),
    _gpu_layout("Q4_0", 4, side_half=0),
    _gpu_layout("Q4_1", 5),
    _gpu_layout("Q5_0", 5, side_half=0),
    _gpu_layout("Q5_1", 6),
    _gpu_layout("Q8_0", 8, side_half=0),
    _gpu_layout("Q4_K", 36),
    _gpu_layout("Q5_K", 44),
    _gpu_layout("Q6_K", 52, side_half=104, sub_weights=16),
    _gpu_layout("Q2_K", 21, sub_weights=16),
    _gpu_layout("Q3_K", 27, side_half=54, sub_weights=16),
    _gpu_layout("IQ4_NL", 4, side_half=0),
    _gpu_layout("IQ4_XS", 34),
)}
QTYPE_BY_ID = {t.ggml: t for t in QTYPES.values()}

CPU_TILE = 8        # positions per invocation of the CPU-shape GEMM (§8: 4-8)
SPLIT_TILE = 8      # CPU shape, gemm=False over several positions: entry split, 16 rows x 8 positions
#                     an invocation (2-4 positions: x 4, as 8 would cost more for nothing)
CPU_ROWS = 256      # CPU shape: rows a workgroup, main 64 invocations x 4 rows (q_matmul_rows.wgsl
#                     says why 4), split 16 x 16
GATHER_QUADS = 64   # get_rows: quads per workgroup
GEMV_ROWS = 4       # GPU shape GEMV: rows per 256-thread workgroup
GEMV_BATCH = 4      # GPU shape, gemm=False over several positions: positions per workgroup (gemv_batch)
GEMM_TILE = 32      # GPU shape GEMM: 32 rows x 32 positions per workgroup
MAX_GROUPS = 65535


def qtype_of(qtype) -> QType:
    """The QType for a name ("Q8_0") or a GGML type id; other types are refused by name (§4.2)."""
    if isinstance(qtype, QType):
        return qtype
    found = QTYPE_BY_ID.get(qtype) if isinstance(qtype, int) else QTYPES.get(str(qtype))
    if found is None:
        raise UnsupportedModelError(f"GGUF tensor type {qtype} is not supported "
                                    f"(supported: {', '.join(QTYPES)})")
    return found


def row_bytes(qtype, cols: int) -> int:
    """File bytes of one row of ``cols`` weights."""
    t = qtype_of(qtype)
    return cols // t.weights * t.nbytes


def check(name: str, qtype, cols: int) -> QType:
    """Whether the kernels can serve a [rows x cols] tensor of this type (called at load)."""
    t = qtype_of(qtype)
    if cols <= 0 or cols % t.gpu_weights:
        raise UnsupportedModelError(f"{name}: {t.name} rows of {cols} weights are not whole "
                                    f"{t.gpu_weights}-weight blocks")
    return t


def repack(qtype, raw) -> tuple:
    """(word plane, side plane or None) of whole blocks of GGUF bytes, per §4.3.

    Types without a side plane come back as they are (a memoryview, no copy). For Q4_0, Q5_0,
    Q8_0, Q6_K, Q3_K and IQ4_NL the block's f16 scale goes to the side plane (block b at byte 2b)
    and its other halves, in order, to the word plane. Extended slices over 16-bit views: one C-speed copy per
    half of a block (Q8_0 49152 x 576, 28 MiB: ~0.15 s in CPython), no per-block Python loop.
    """
    t = qtype_of(qtype)
    raw = memoryview(raw).cast("B")
    if len(raw) % t.nbytes:
        raise UnsupportedModelError(f"{t.name}: {len(raw)} bytes are not whole {t.nbytes}-byte blocks")
    if t.side_half is None:
        return raw, None
    halves = t.nbytes // 2
    blocks = len(raw) // t.nbytes
    source = raw.cast("H")
    words = bytearray(blocks * (t.nbytes - 2))
    word_halves = memoryview(words).cast("H")
    kept = [h for h in range(halves) if h != t.side_half]
    for out, h in enumerate(kept):
        word_halves[out::halves - 1] = source[h::halves]
    side = bytearray((blocks * 2 + 3) // 4 * 4)
    memoryview(side).cast("H")[:blocks] = source[t.side_half::halves]
    return words, side


@dataclass
class QPart(RowPart):
    """Rows [first, first + rows) of a pack in one buffer: the word plane, then (at word
    ``side_base``, 0 when the type has none) the side plane of those rows' blocks."""

    side_base: int = 0


@dataclass
class QPack:
    """One GGUF tensor [rows x cols] of type ``qtype`` on the GPU, split into row parts."""

    name: str
    qtype: QType
    rows: int
    cols: int
    parts: list

    @property
    def row_blocks(self) -> int:
        """GPU blocks per row (float types: quads of 4 weights)."""
        return self.cols // self.qtype.gpu_weights

    @property
    def file_bytes(self) -> int:
        return self.rows * row_bytes(self.qtype.name, self.cols)

    @property
    def gpu_bytes(self) -> int:
        return sum(part.buffer.size for part in self.parts)


def upload(device: Device, name: str, qtype, raw, rows: int, cols: int) -> QPack:
    """Upload one tensor from its raw GGUF bytes (``rows * row_bytes`` of them, any buffer).

    Parts hold at most maxStorageBufferBindingSize bytes each (§4.4); each part is repacked on
    its own, so the host never holds more than one part's planes at a time.
    """
    t = check(name, qtype, cols)
    per_row = row_bytes(t.name, cols)
    raw = memoryview(raw).cast("B")
    if len(raw) != rows * per_row:
        raise UnsupportedModelError(f"{name}: {len(raw)} bytes for {rows} x {cols} {t.name} "
                                    f"(expected {rows * per_row})")
    pack = QPack(name, t, rows, cols, [])
    for first, count in split_rows(name, rows, per_row, device.limits.max_storage_binding):
        words, side = repack(t, raw[first * per_row:(first + count) * per_row])
        word_bytes = (len(words) + 15) // 16 * 16
        size = word_bytes + (len(side) if side is not None else 0)
        buffer = device.buffer(size, label=f"{name}[{first}:{first + count}]", kind="weights")
        device.write(buffer, words)
        if side is not None:
            device.write(buffer, side, word_bytes)
        pack.parts.append(QPart(buffer, first, count, word_bytes // 4 if side is not None else 0))
    return pack


def packed_bytes(name: str, qtype, rows: int, cols: int, limit: int) -> int:
    """The GPU bytes ``upload`` takes for a [rows x cols] tensor (its parts, planes and padding),
    without its data."""
    t = check(name, qtype, cols)
    per_row = row_bytes(t.name, cols)
    total = 0
    for _, count in split_rows(name, rows, per_row, limit):
        nbytes = count * per_row
        blocks = nbytes // t.nbytes
        words, side = (nbytes, 0) if t.side_half is None else (blocks * (t.nbytes - 2), (blocks * 2 + 3) // 4 * 4)
        total += max(16, ((words + 15) // 16 * 16 + side + 15) // 16 * 16)
    return total


def _fold(groups: int) -> tuple:
    """(x, z) workgroup counts covering ``groups`` (the kernels index x + z * num_workgroups.x)."""
    z = (groups + MAX_GROUPS - 1) // MAX_GROUPS
    return (groups + z - 1) // z, z


def _block_consts(pack: QPack) -> tuple:
    t = pack.qtype
    return (("QTYPE", t.ggml), ("BLOCK_WORDS", t.words), ("BLOCK_QUADS", t.quads), ("SUB_QUADS", t.sub_quads),
            ("ROW_BLOCKS", pack.row_blocks))


def default_shape(device: Device) -> str:
    """"cpu" on CPU adapters (lavapipe, SwiftShader), else "gpu" (§8)."""
    return "cpu" if device.software_rasterizer else "gpu"


def q_matmul(plan: Plan, arena: UniformArena, pack: QPack, x, y, *, positions: int, x_stride: int,
             y_stride: int, x_offset: int = 0, y_offset: int = 0, rows: int | None = None,
             row_start: int = 0, accumulate: bool = False, shape: str | None = None,
             gemm: bool | None = None) -> None:
    """y[y_offset + t*y_stride + o - row_start] (+)= sum_i W[o, i] x[x_offset + t*x_stride + i]
    for pack rows o in [row_start, row_start + rows) and positions t < ``positions``.

    ``gemm`` (default: positions > 1) picks the chunked GEMM over the per-position GEMV (with
    ``gemm`` False every position is summed exactly as a one-position GEMV sums it: a batch of
    decode steps, one position per sequence; the CPU shape still decodes each weight once per
    4 or 8 positions, ``SPLIT_TILE``, the GPU shape once per ``GEMV_BATCH``);
    ``shape`` ("cpu" or "gpu", default from the adapter) the kernel shape of §8. ``accumulate``
    adds to y instead of storing (a residual add). x and y are f32; x offsets and strides must
    be multiples of 4 (vec4 loads).
    """
    rows = pack.rows - row_start if rows is None else rows
    shape = shape or default_shape(plan.device)
    gemm = positions > 1 if gemm is None else gemm
    if (x_stride | x_offset) % 4:
        raise ValueError("q_matmul reads x as vec4: x_stride and x_offset must be multiples of 4")
    consts = _block_consts(pack) + (("ACCUMULATE", accumulate),)
    if shape == "cpu":
        if not gemm and positions > 1:  # entry split: 16 rows an invocation share each activation quad
            tile, entry = SPLIT_TILE if positions > SPLIT_TILE // 2 else SPLIT_TILE // 2, "split"
        else:
            tile, entry = CPU_TILE if gemm else 1, "main"
        rows_per_group = CPU_ROWS
        key = KernelKey("q_matmul_rows", entry=entry, consts=consts + (("TT", tile),))
        position_groups = (positions + tile - 1) // tile
    elif shape == "gpu":
        entry = "gemm" if gemm else "gemv_batch" if positions > 1 else "gemv"
        key = KernelKey("q_matmul", entry=entry, consts=consts)
        rows_per_group = GEMM_TILE if gemm else GEMV_ROWS
        tile = GEMM_TILE if gemm else GEMV_BATCH if positions > 1 else 1
        position_groups = (positions + tile - 1) // tile
    else:
        raise ValueError(f"shape must be 'cpu' or 'gpu', not {shape!r}")
    for part, lo, hi in pieces(pack.parts, row_start, row_start + rows):
        params = arena.struct(key, rows=hi - lo, row0=lo - part.first, side_base=part.side_base, positions=positions,
                              x_stride=x_stride, x_offset=x_offset, y_stride=y_stride, y_offset=y_offset + lo - row_start)
        gx, gz = _fold((hi - lo + rows_per_group - 1) // rows_per_group)
        plan.add(key, [params, Binding(part.buffer), x, y], (gx, position_groups, gz),
                 label=f"q_matmul {pack.name}[{lo}:{hi}]")


def get_rows(plan: Plan, arena: UniformArena, pack: QPack, tokens, out, *, step, positions: int,
             scale: float = 1.0, out_stride: int | None = None, out_offset: int = 0) -> None:
    """out[out_offset + t*out_stride + i] = scale * W[min(tokens[pos0 + t], rows - 1), i].

    ``step`` is the step uniform (``step.wgsl``: pos0); ``tokens`` u32 ids by absolute position.
    The id clamp keeps an out-of-range id from reading outside the pack (no-panic contract).
    One dispatch per part; positions whose row another part holds are skipped there. ``scale``
    is used as its f32 (Gemma's sqrt(d): pass the f32 the reference uses).
    """
    out_stride = pack.cols if out_stride is None else out_stride
    if (out_stride | out_offset) % 4:
        raise ValueError("get_rows writes vec4: out_stride and out_offset must be multiples of 4")
    key = KernelKey("get_rows", consts=_block_consts(pack))
    quad_groups = (pack.cols // 4 + GATHER_QUADS - 1) // GATHER_QUADS
    for part in pack.parts:
        params = arena.struct(key, part_first=part.first, part_rows=part.rows, total_rows=pack.rows,
                              side_base=part.side_base, out_stride=out_stride, out_offset=out_offset,
                              scale=float(scale))
        plan.add(key, [params, step, tokens, Binding(part.buffer), out], (quad_groups, positions),
                 label=f"get_rows {pack.name}[{part.first}:]")
