"""Attention on the GPU (spec §4.5 items 4-9, §6 items 1-2): qkv_post, attention, KvCache.

Per layer and chunk the model runs ``qkv_post`` (qkvg -> conv, per-head norm, RoPE; q out,
K/V into the layer's ``KvCache``, raw q/k/v into the layer's ring) then ``attention`` (q, cache,
the gate part of qkvg -> o = attention ⊙ σ(g)). Prefill chunks and decode steps (T = 1) use the
same two kernels, so a position's K/V and output do not depend on how the sequence was chunked.

Reference functions: ``reference.ops.causal_conv``, ``reference.attention.position_heads``
(head_norm + rope), ``reference.ops.fake_quant`` / ``quantize_rows`` (int8 mode),
``reference.attention.attend`` (``attend_one`` / ``attend_one_int8``) and ``ops.sigmoid``.
"""

from __future__ import annotations

import math
import struct

from ..errors import DeviceLimitError, UnsupportedModelError
from ..formats.geometry import Needle3Geometry
from ..gpu.device import Binding, Device, KernelKey, Plan, UniformArena
from .params import Fp16Store

THREADS = 256
MAX_HEAD_DIM = 256  # q/k and v head widths: one workgroup array each
MAX_VECTORS = 256  # H + 2·KV per-head scales in qkv_post
MAX_FREQS = 128  # the Params struct holds 32 vec4 of RoPE frequencies
MAX_ROPE_POSITION = 1 << 16  # the angle reduction is exact for k·π/2 with k < 2^16
WORKGROUP_BYTES = 16384
STORAGE_OFFSET_ALIGN = 256  # WebGPU's minStorageBufferOffsetAlignment default (and maximum)
DEFAULT_CHUNK = 64  # the largest prefill chunk a cache is sized for (models.needle3.PREFILL_CHUNK)


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def rope_frequencies(head_dim: int, theta: float) -> list:
    """f_i = 1 / theta^(2i / head_dim) for i < head_dim/2, each step rounded to f32 (§4.5 item 7).

    The power is evaluated in double and rounded once, i.e. the correctly rounded f32 powf;
    this equals ``reference.ops.rope_frequencies`` on the shipped and fixture geometries (the
    tests check it). A libm powf that is not correctly rounded can differ by one ulp elsewhere.
    """
    out = []
    for i in range(head_dim // 2):
        exponent = _f32(_f32(2 * i) / head_dim)
        out.append(_f32(1.0 / _f32(_f32(theta) ** exponent)))
    return out


def _round_bits(value: float, bits: int) -> float:
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * (1 << bits)), exponent - bits)


def pio2_parts() -> tuple:
    """π/2 as three 8-bit parts plus an f32 remainder, for the Cody-Waite angle reduction.

    k·part is exact in f32 for k < 2^16, so a RoPE angle below 2^16 reduces to [-π/4, π/4]
    with an absolute error near 1e-7 (qkv_post.wgsl, ``rope_cos_sin``).
    """
    rest, parts = math.pi / 2, []
    for _ in range(3):
        parts.append(_round_bits(rest, 8))
        rest -= parts[-1]
    return (*parts, _f32(rest))


class KvCache:
    """One layer's K/V cache on the GPU (§6 item 1): one u32 storage buffer.

    ``slots``: the context for global layers; for local ones min(span + chunk - 1, context),
    span = the sliding window. A chunk writes its K/V before attending, so the ring needs
    chunk - 1 slots beyond the window: no key a query of the chunk still sees is overwritten.
    Position p lives in slot p mod slots.

    Layout, in 32-bit words: K rows [slots][kv_heads][k_row] at ``k_at``, V rows
    [slots][kv_heads][v_row] at ``v_at``. f32 mode: k_row = qk_head_dim, v_row = v_head_dim,
    f32 values. int8 mode: k_row = ceil(qk/4), v_row = ceil(vd/4), 4 signed bytes per word
    (element e in byte e % 4, padding bytes 0), then the f32 scales [slots][kv_heads] of K at
    ``k_scale_at`` and of V at ``v_scale_at``.
    """

    def __init__(self, device: Device, geometry: Needle3Geometry, layer: int, context: int, int8: bool = False,
                 chunk: int = DEFAULT_CHUNK):
        g = geometry
        self.layer, self.context, self.int8, self.chunk = layer, context, bool(int8), chunk
        self.kv_heads, self.qk_dim, self.v_dim = g.num_kv_heads, g.qk_head_dim, g.v_head_dim
        self.span = g.attention_span(layer)
        self.slots = context if g.is_global(layer) else min(self.span + chunk - 1, context)
        rows = self.slots * self.kv_heads
        if self.int8:
            self.k_row, self.v_row = -(-self.qk_dim // 4), -(-self.v_dim // 4)
        else:
            self.k_row, self.v_row = self.qk_dim, self.v_dim
        self.k_at = 0
        self.v_at = rows * self.k_row
        self.k_scale_at = self.v_at + rows * self.v_row
        self.v_scale_at = self.k_scale_at + (rows if self.int8 else 0)
        self.words = self.v_scale_at + (rows if self.int8 else 0)
        mode = "int8" if self.int8 else "f32"
        self.buffer = device.buffer(4 * self.words, label=f"kv_cache.{layer}.{mode}", kind="kv")

    @property
    def nbytes(self) -> int:
        """Bytes of cache data (the buffer may be padded up to 16 bytes)."""
        return 4 * self.words

    def check_chunk(self, positions: int) -> None:
        """Refuse chunks longer than this cache was sized for (a local ring would lose keys)."""
        if self.slots < min(self.span + positions - 1, self.context):
            raise DeviceLimitError(f"kv_cache.{self.layer}: {self.slots} slots cannot take chunks of {positions} "
                                   f"with a window of {self.span} (make the cache with chunk >= {positions})")


def check(g: Needle3Geometry, workgroup_bytes: int) -> None:
    """What qkv_post and attention need of the geometry (called at load; the ops check it too)."""
    _check_heads(g)
    width = g.q_dim + g.k_dim + g.v_dim
    cap = -(-width // THREADS) * THREADS
    limit = min(WORKGROUP_BYTES, workgroup_bytes)
    if 4 * (cap + MAX_VECTORS + 3 * MAX_FREQS) > limit:
        raise UnsupportedModelError(f"qkv_post: q+k+v = {width} floats exceed the workgroup memory ({limit} bytes)")


def _check_heads(g: Needle3Geometry) -> None:
    if g.qk_head_dim > MAX_HEAD_DIM or g.v_head_dim > MAX_HEAD_DIM:
        raise UnsupportedModelError(f"attention: head widths {g.qk_head_dim}/{g.v_head_dim} (at most {MAX_HEAD_DIM})")
    if g.num_heads + 2 * g.num_kv_heads > MAX_VECTORS:
        raise UnsupportedModelError(f"attention: {g.num_heads} + 2·{g.num_kv_heads} heads (at most {MAX_VECTORS})")


def _layer_fp16(store: Fp16Store, g: Needle3Geometry, layer: int) -> tuple:
    """The range of the FP16 buffer holding this layer's taps and q/k norms, and their half
    offsets inside it: binding only that range keeps qkv_post within any storage-binding limit."""
    counts = {"q_norm": g.qk_head_dim, "k_norm": g.qk_head_dim}
    if g.qkv_conv_taps:
        counts.update(q_taps=g.qkv_conv_taps * g.q_dim, k_taps=g.qkv_conv_taps * g.k_dim,
                      v_taps=g.qkv_conv_taps * g.v_dim)
    at = {name: store.offset(f"layers.{layer}.{name}") for name in counts}
    begin = 2 * min(at.values()) // STORAGE_OFFSET_ALIGN * STORAGE_OFFSET_ALIGN
    end = -(-2 * max(at[n] + counts[n] for n in at) // 4) * 4
    relative = [at[n] - begin // 2 if n in at else 0 for n in ("q_taps", "k_taps", "v_taps", "q_norm", "k_norm")]
    return Binding(store.buffer, begin, end - begin), relative


def qkv_post(plan: Plan, arena: UniformArena, step, *, geometry: Needle3Geometry, layer: int, fp16_store: Fp16Store,
             qkvg, ring, ring_size: int, q_out, cache: KvCache, positions: int, int8: bool | None = None,
             qkvg_stride: int | None = None, q_stride: int | None = None) -> None:
    """Conv, per-head norm and RoPE of one chunk; q out, K/V into the cache (§4.5 items 4-7, §6).

    For p = pos0 + t: x' = causal conv of the raw rows (taps ``layers.{l}.{q,k,v}_taps``
    [taps][dim], identity when the geometry has 0 taps; rows before 0 are zero), q and k per
    head ZCRMSNorm (division form, one ``q_norm`` / ``k_norm`` vector for all heads) then RoPE at
    the absolute position p; v only convolved. int8 mode: q is fake-quantised per head (A8,
    §4.9 item 4) and K, V are quantised per (slot, kv head) as ``reference.ops.quantize_rows``
    (IEEE division, round half to even; the shader emulates the correctly rounded division).

    Bindings (``qkv_post.wgsl``): 0 params (uniform, with the f32 RoPE frequencies), 1 ``step``
    (uniform Step, pos0), 2 ``qkvg`` f32 [T][qkvg_stride] (raw q | k | v | gate; read), 3 the
    range of ``fp16`` holding the layer's taps and norms (offsets in params are relative to it),
    4 ``ring`` f32 [ring_size][q+k+v] (raw rows by position mod ring_size; read, then this
    chunk's rows written), 5 ``q_out`` f32 [T][q_stride], 6 the cache buffer (see ``KvCache``).
    Workgroups: (T,), 256 invocations. Constants: CAP (q+k+v rounded up to 256), INT8, PIO2_1..4.
    Requires ring_size >= T + taps - 1 (no slot this chunk reads is written by it) and
    positions below 2^16 (the angle reduction).
    """
    g = geometry
    int8 = cache.int8 if int8 is None else bool(int8)
    if int8 != cache.int8:
        raise ValueError(f"qkv_post: int8={int8} but kv_cache.{layer} is {'int8' if cache.int8 else 'f32'}")
    _check_heads(g)
    cache.check_chunk(positions)
    taps = g.qkv_conv_taps
    if ring_size < positions + max(taps, 1) - 1:
        raise DeviceLimitError(f"qkv ring of {ring_size} slots is too small for chunks of {positions} "
                               f"(needs T + taps - 1 = {positions + max(taps, 1) - 1})")
    if cache.context > MAX_ROPE_POSITION:
        raise UnsupportedModelError(f"qkv_post: context {cache.context} exceeds {MAX_ROPE_POSITION} (RoPE reduction)")
    width = g.q_dim + g.k_dim + g.v_dim
    cap = -(-width // THREADS) * THREADS
    if 4 * (cap + MAX_VECTORS + 3 * MAX_FREQS) > WORKGROUP_BYTES:
        raise UnsupportedModelError(f"qkv_post: q+k+v = {width} floats exceed the workgroup memory")
    freqs = rope_frequencies(g.qk_head_dim, g.rope_theta)
    freqs += [0.0] * (MAX_FREQS - len(freqs))
    fp16, (q_taps_at, k_taps_at, v_taps_at, q_norm_at, k_norm_at) = _layer_fp16(fp16_store, g, layer)
    params = arena.add(g.num_heads, g.num_kv_heads, g.qk_head_dim, g.v_head_dim,
                       qkvg_stride or width + g.attn_out, taps, ring_size, cache.slots, q_stride or g.q_dim,
                       q_taps_at, k_taps_at, v_taps_at, q_norm_at, k_norm_at,
                       cache.k_at, cache.v_at, cache.k_scale_at, cache.v_scale_at, cache.k_row, cache.v_row,
                       0, 0, 0, 0, *freqs)
    parts = pio2_parts()
    key = KernelKey("qkv_post", consts=(("CAP", cap), ("INT8", int8), *((f"PIO2_{i + 1}", v) for i, v in
                                                                        enumerate(parts))))
    plan.add(key, [params, step, qkvg, fp16, ring, q_out, cache.buffer], (positions,),
             label=f"qkv_post {layer}")


def attention(plan: Plan, arena: UniformArena, step, *, geometry: Needle3Geometry, layer: int, q, cache: KvCache,
              qkvg, o, positions: int, int8: bool | None = None, q_stride: int | None = None,
              qkvg_stride: int | None = None, o_stride: int | None = None) -> None:
    """o[t][hq·vd + j] = attention(q_t, hq)_j · σ(g_t[hq·vd + j]) (§4.5 items 8-9, §6 item 1).

    Query head hq of position p = pos0 + t reads kv head hq // (H / KV) over the keys
    n in [max(0, p + 1 - span), p] (span = sliding window on local layers, the whole context on
    global ones) at cache slot n mod slots; scores q·k / sqrt(qk) (int8: (q·k8)·k_scale /
    sqrt(qk)), max-subtracted softmax (online over blocks of 256 keys, so any span works within
    4 KiB of workgroup memory), values weighted by the softmax (int8: times v_scale, then the i8
    values). g is the gate part of the qkvg row, at offset q + k + v widths.

    Bindings (``attention.wgsl``): 0 params, 1 ``step`` (uniform Step), 2 ``q`` f32
    [T][q_stride] (qkv_post's output), 3 the cache buffer, 4 ``qkvg`` f32 [T][qkvg_stride],
    5 ``o`` f32 [T][o_stride]. Workgroups: (H, T), 256 invocations. Constants: INT8, VCOLS
    (v head width rounded up to a power of two).
    """
    g = geometry
    int8 = cache.int8 if int8 is None else bool(int8)
    if int8 != cache.int8:
        raise ValueError(f"attention: int8={int8} but kv_cache.{layer} is {'int8' if cache.int8 else 'f32'}")
    _check_heads(g)
    cache.check_chunk(positions)
    width = g.q_dim + g.k_dim + g.v_dim
    vcols = 1 << max(0, (g.v_head_dim - 1).bit_length())
    params = arena.add(g.num_heads, g.num_kv_heads, g.qk_head_dim, g.v_head_dim, cache.span, cache.slots,
                       q_stride or g.q_dim, qkvg_stride or width + g.attn_out, width, o_stride or g.attn_out,
                       cache.k_at, cache.v_at, cache.k_scale_at, cache.v_scale_at, cache.k_row, cache.v_row,
                       _f32(1.0 / math.sqrt(g.qk_head_dim)), 0, 0, 0)
    key = KernelKey("attention", consts=(("INT8", int8), ("VCOLS", vcols), ("QK_DIM", g.qk_head_dim),
                                          ("K_ROW", cache.k_row)))
    plan.add(key, [params, step, q, cache.buffer, qkvg, o], (g.num_heads, positions), label=f"attention {layer}")
