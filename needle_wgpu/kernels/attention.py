"""Attention on the GPU: AttentionShape, KvCache, qkv_post (Needle 3), attention (both families).

Ops take an ``AttentionShape``, plain numbers each family builds for a layer (Needle 3:
``needle3_shape(geometry, layer)``; the dense family from its GGUF config), never a family's
geometry. Per layer and chunk Needle 3 runs ``qkv_post`` (qkvg -> conv, per-head norm, RoPE; q
out, K/V into the layer's ``KvCache``, raw q/k/v into the layer's ring) then ``attention`` (q,
cache, the gate part of qkvg -> o = attention ⊙ σ(g)). Prefill chunks and decode steps (T = 1)
use the same kernels, so a position's K/V and output do not depend on how the sequence was
chunked.

Reference functions: ``reference.ops.causal_conv``, ``reference.needle3.attention.position_heads``
(head_norm + rope), ``reference.ops.fake_quant`` / ``quantize_rows`` (int8 mode),
``reference.needle3.attention.attend`` (``attend_one`` / ``attend_one_int8``) and ``ops.sigmoid``; the
dense family's ``qk_rope``: ``reference.dense_attention.position_heads`` and ``kv_f16`` (f16 mode).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..constants import KV_CQ_GROUP, f32, inv_sqrt, pio2_parts, rope_frequencies
from ..errors import DeviceLimitError, UnsupportedModelError
from ..gpu.device import Binding, Device, KernelKey, Plan, UniformArena, recording

THREADS = 256
MAX_HEAD_DIM = 256  # q/k and v head widths: one workgroup array each
MAX_VECTORS = 256  # H + 2·KV per-head scales in qkv_post
MAX_FREQS = 128  # the Params struct holds 32 vec4 of RoPE frequencies
MAX_KV_LEVELS = 16  # qkv_post's Params hold 4 vec4 of CQ K/V levels (4 bits)
MAX_ROPE_POSITION = 1 << 16  # the angle reduction is exact for k·π/2 with k < 2^16
WORKGROUP_BYTES = 16384
STORAGE_OFFSET_ALIGN = 256  # WebGPU's minStorageBufferOffsetAlignment default (and maximum)
DEFAULT_CHUNK = 64  # the largest prefill chunk a cache is sized for (models.needle3.PREFILL_CHUNK)

ROPE_STYLES = ("none", "adjacent", "neox")
KV_MODES = ("f32", "int8", "f16")  # KvCache layouts; KV_MODE 0, 1, 2 in attention.wgsl / qk_rope.wgsl
NORM_KINDS = ("none", "zc", "head", "full")


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention in plain numbers: what qkv_post / qk_rope, attention and KvCache read.

    - ``window``: keys a query at p sees, itself included (p - window < s <= p); None: the
      whole causal past (global layers).
    - ``rope``: "neox" pairs (x_j, x_{j+R/2}), "adjacent" pairs (x_{2j}, x_{2j+1}) (llama
      GGUFs), "none"; R = ``rotary_dims`` (None: qk_dim), dims >= R are not rotated;
      f_j = ``constants.rope_frequencies(R, rope_base, rope_scale)`` (``rope_scale``: linear
      scaling, 1 / rope.scaling.factor), or ``rope_table`` when the family computed them on the
      host (Llama 3 frequency factors, YaRN, LongRoPE: ``rope.scaled_frequencies``); the
      rotated pairs are scaled by ``rope_mscale`` (YaRN / LongRoPE's attention factor).
    - ``scale``: the score scale (f32); None: 1/sqrt(qk_dim).
    - ``norm`` of q and k: "zc" (Needle 3: (1 + s)·x / sqrt(mean(x²) + eps), one [qk] vector
      shared by the heads), "head" (x·w / rms per head, [qk] weights: qwen3, gemma3), "full"
      (x·w / rms over all heads at once, [H·qk] / [KV·qk] weights: OLMoE) or "none".
    - ``bias``: q/k/v biases (qwen2); ``gate``: o ⊙ σ(g) (Needle 3); ``conv_taps``: the causal
      conv of q/k/v (Needle 3).
    """

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    window: int | None = None
    rope: str = "neox"
    rotary_dims: int | None = None
    rope_base: float = 10000.0
    rope_scale: float = 1.0
    rope_table: tuple | None = None  # the f32 frequencies themselves (Llama 3 / YaRN / LongRoPE)
    rope_mscale: float = 1.0
    scale: float | None = None
    norm: str = "none"
    eps: float = 1e-6
    bias: bool = False
    gate: bool = False
    conv_taps: int = 0
    softcap: float = 0.0  # > 0: scores soft-capped, tanh(s · f32(1/cap)) · cap, before the softmax (gemma2)

    def __post_init__(self):
        if self.rope not in ROPE_STYLES or self.norm not in NORM_KINDS:
            raise ValueError(f"AttentionShape: rope {self.rope!r} / norm {self.norm!r} "
                             f"(one of {ROPE_STYLES} / {NORM_KINDS})")
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"AttentionShape: {self.heads} query heads over {self.kv_heads} kv heads")
        if self.rotary_dims is not None and not (0 <= self.rotary_dims <= self.qk_dim and self.rotary_dims % 2 == 0):
            raise ValueError(f"AttentionShape: rotary_dims {self.rotary_dims} of a {self.qk_dim}-wide head")

    @property
    def q_width(self) -> int:
        return self.heads * self.qk_dim

    @property
    def k_width(self) -> int:
        return self.kv_heads * self.qk_dim

    @property
    def v_width(self) -> int:
        return self.kv_heads * self.v_dim

    @property
    def out_width(self) -> int:
        """Floats of one position's attention output (H · v_dim)."""
        return self.heads * self.v_dim

    @property
    def rope_dims(self) -> int:
        """Rotated dims per head (0 without RoPE)."""
        if self.rope == "none":
            return 0
        return self.qk_dim if self.rotary_dims is None else self.rotary_dims

    @property
    def score_scale(self) -> float:
        return inv_sqrt(self.qk_dim) if self.scale is None else self.scale

    def frequencies(self) -> list:
        """The RoPE inverse frequencies, padded to the Params struct's MAX_FREQS."""
        if self.rope_table is not None:
            freqs = list(self.rope_table)
            if len(freqs) != self.rope_dims // 2:
                raise ValueError(f"AttentionShape: {len(freqs)} RoPE frequencies for {self.rope_dims} rotated dims")
        else:
            freqs = list(rope_frequencies(self.rope_dims, self.rope_base, self.rope_scale))
        return freqs + [0.0] * (MAX_FREQS - len(freqs))

    def check(self) -> None:
        """What the kernels support (raised at load by the family, and again at plan build)."""
        if self.qk_dim > MAX_HEAD_DIM or self.v_dim > MAX_HEAD_DIM:
            raise UnsupportedModelError(f"attention: head widths {self.qk_dim}/{self.v_dim} (at most {MAX_HEAD_DIM})")
        if self.heads + 2 * self.kv_heads > MAX_VECTORS:
            raise UnsupportedModelError(f"attention: {self.heads} + 2·{self.kv_heads} heads (at most {MAX_VECTORS})")


def needle3_shape(geometry, layer: int) -> AttentionShape:
    """Needle 3's layer as an AttentionShape (§4.5 items 4-9): conv, shared ZCRMSNorm, NeoX RoPE
    over the whole head, 1/sqrt(qk) scores, the sliding window on local layers, the σ gate."""
    g = geometry
    return AttentionShape(heads=g.num_heads, kv_heads=g.num_kv_heads, qk_dim=g.qk_head_dim, v_dim=g.v_head_dim,
                          window=None if g.is_global(layer) else g.attention_span(layer), rope="neox",
                          rope_base=g.rope_theta, norm="zc", gate=True, conv_taps=g.qkv_conv_taps)


class KvCache:
    """One layer's K/V cache on the GPU (Needle 3 §6 item 1, dense §3): one u32 storage buffer.

    ``slots``: the context for global layers (``shape.window`` None); for local ones
    min(span + chunk - 1, context), span = the window. A chunk writes its K/V before attending, so the ring needs
    chunk - 1 slots beyond the window: no key a query of the chunk still sees is overwritten.
    Position p lives in slot p mod slots.

    ``mode`` (one of ``KV_MODES``; default "int8" when ``int8`` is true, else "f32"). Layout, in
    32-bit words: K rows [slots][kv_heads][k_row] at ``k_at``, V rows [slots][kv_heads][v_row]
    at ``v_at``.

    - "f32": k_row = qk_head_dim, v_row = v_head_dim, f32 values.
    - "int8" (Needle 3): k_row = ceil(qk/4), v_row = ceil(vd/4), 4 signed bytes per word
      (element e in byte e % 4, padding bytes 0), then the f32 scales [slots][kv_heads] of K at
      ``k_scale_at`` and of V at ``v_scale_at``.
    - "f16" (dense family): k_row = ceil(qk/2), v_row = ceil(vd/2), two IEEE halves per word
      (element e in the low half of word e / 2 when e is even, the high half when odd; an odd
      width's last high half is 0). Written with ``pack2x16float`` and read with
      ``unpack2x16float``, which are core WGSL: no ``shader-f16`` feature is needed, so the mode
      works on every adapter (lavapipe and SwiftShader included). ``qk_rope`` saturates each
      value to ±65504 (the largest half) and rounds it to the nearest half, ties to even (reference:
      ``reference.dense_attention.kv_f16``); half the bytes of "f32".

    ``range_keys``: the slots ``attention`` attends per workgroup before merging (``tiling``);
    default ``SPLIT_KEYS``, on a CPU adapter (``device.software_rasterizer``) ``CPU_SPLIT_KEYS``
    (a decode step's 3-odd workgroups of one range leave one of lavapipe's 2 threads partly
    idle; ranges of 512 keep both busy past 512 slots, for a merge dispatch a layer and a
    slightly slower prefill chunk). The ranges follow the cache, never the chunk.
    """

    def __init__(self, device: Device, shape: AttentionShape, context: int, int8: bool = False,
                 chunk: int = DEFAULT_CHUNK, name: str = "kv_cache", mode: str | None = None,
                 range_keys: int | None = None, slot=None):
        mode = ("int8" if int8 else "f32") if mode is None else mode
        if mode not in KV_MODES or (int8 and mode != "int8"):
            raise ValueError(f"KvCache: mode {mode!r} with int8={int8} (modes: {KV_MODES})")
        self.name, self.context, self.mode, self.chunk = name, context, mode, chunk
        self.int8 = mode == "int8"
        self.kv_heads, self.qk_dim, self.v_dim = shape.kv_heads, shape.qk_dim, shape.v_dim
        self.span = context if shape.window is None else shape.window
        self.slots = context if shape.window is None else min(self.span + chunk - 1, context)
        if range_keys is None:  # CPU adapter: a chunk's query tiles keep its few threads busy; no merge
            range_keys = CPU_SPLIT_KEYS if getattr(device, "software_rasterizer", False) else SPLIT_KEYS
        self.range_keys = range_keys
        rows = self.slots * self.kv_heads
        per_word = {"f32": 1, "int8": 4, "f16": 2}[mode]
        self.k_row, self.v_row = -(-self.qk_dim // per_word), -(-self.v_dim // per_word)
        self.words = rows * (self.k_row + self.v_row) + (2 * rows if self.int8 else 0)
        # a slab's slot: (buffer, word offset, words between slots) inside a KvSlab page; else its own buffer
        self.buffer, self.base, self.slot_words = slot if slot is not None else (
            device.buffer(4 * self.words, label=f"{name}.{mode}", kind="kv"), 0, 0)
        self.k_at = self.base
        self.v_at = self.k_at + rows * self.k_row
        self.k_scale_at = self.v_at + rows * self.v_row
        self.v_scale_at = self.k_scale_at + (rows if self.int8 else 0)

    @property
    def nbytes(self) -> int:
        """Bytes of cache data (the buffer may be padded up to 16 bytes)."""
        return 4 * self.words

    @property
    def mode_code(self) -> int:
        """The KV_MODE constant of the shaders."""
        return KV_MODES.index(self.mode)

    def relative(self) -> dict:
        """The layout's word offsets from the start of the cache (a slab's rows add their slot's)."""
        return dict(k_at=self.k_at - self.base, v_at=self.v_at - self.base, k_scale_at=self.k_scale_at - self.base,
                    v_scale_at=self.v_scale_at - self.base)

    def check_chunk(self, positions: int) -> None:
        """Refuse chunks longer than this cache was sized for (a local ring would lose keys)."""
        if self.slots < min(self.span + positions - 1, self.context):
            raise DeviceLimitError(f"{self.name}: {self.slots} slots cannot take chunks of {positions} "
                                   f"with a window of {self.span} (make the cache with chunk >= {positions})")


class KvSlab:
    """The K/V caches of up to ``capacity`` sessions of one kind (the same layer shapes, context,
    prefill chunk and mode) in shared buffers, so that a batched decode step runs qk_rope and
    attention for all its rows of a page in one dispatch each (``Sequences``).

    Per layer the slots' caches lie one after another, ``slot_words[layer]`` words apart (the
    cache's words rounded up to a vec4), in pages of ``per_page`` slots (the last page holds what
    is left of ``capacity``): one buffer per page and layer, each within the device's
    storage-binding limit. A page's buffers are made when its first slot is taken and freed when
    its last is given back; so is ``partials`` (the merge's rows of a batch of ``capacity``, on
    caches of several ranges) with the slab's first and last slot. Pages are known to the
    shaders by id, ``first_page`` + the page's index: a batch gives each of its slabs its own
    ids. ``shapes``: per layer an ``AttentionShape``, or None for a layer without a cache."""

    def __init__(self, device: Device, shapes: list, context: int, chunk: int, mode: str, capacity: int,
                 name: str = "kv_slab", range_keys: int | None = None, per_page: int | None = None,
                 first_page: int = 0):
        self.device, self.shapes, self.capacity, self.name = device, list(shapes), capacity, name
        self.context, self.chunk, self.mode, self.range_keys = context, chunk, mode, range_keys
        self.first_page = first_page
        self.layouts = [None if shape is None else self._cache(shape, "layout", (None, 0, 0)) for shape in self.shapes]
        self.slot_words = [0 if c is None else -(-c.words // 4) * 4 for c in self.layouts]
        widest = 4 * max(self.slot_words, default=0) or 16
        fits = max(1, device.limits.max_storage_binding // widest)  # slots a page's buffer may hold
        self.per_page = min(capacity, fits, per_page or capacity)
        self.pages: dict = {}  # page index -> its buffers by layer (None for a layer without a cache)
        self.taken: set = set()
        self.partials = None
        attending = [i for i, c in enumerate(self.layouts) if c is not None]
        self._partials_floats = max((partials_floats(self.shapes[i], self.layouts[i], capacity) for i in attending),
                                    default=0)

    def _cache(self, shape: AttentionShape, name: str, slot: tuple) -> KvCache:
        return KvCache(self.device, shape, self.context, chunk=self.chunk, name=name, mode=self.mode,
                       range_keys=self.range_keys, slot=slot)

    @property
    def slot_bytes(self) -> int:
        """One slot's bytes over every layer."""
        return 4 * sum(self.slot_words)

    def _page_slots(self, index: int) -> int:
        return min(self.per_page, self.capacity - index * self.per_page)

    @property
    def idle_slots(self) -> int:
        """Slots whose memory is allocated (their page's) but that no session holds."""
        return sum(self._page_slots(index) for index in self.pages) - len(self.taken)

    def place(self, slot: int) -> tuple:
        """(slot inside its page, page id): a row's entry in a batch's ``sequences`` table."""
        return slot % self.per_page, self.first_page + slot // self.per_page

    def page_buffers(self, page: int) -> list | None:
        """The buffers of page id ``page`` by layer, None while the page is not made."""
        return self.pages.get(page - self.first_page)

    def take(self) -> int:
        """A free slot, its page's buffers made if it is the page's first."""
        free = [s for s in range(self.capacity) if s not in self.taken]
        if not free:
            raise DeviceLimitError(f"{self.name}: all {self.capacity} slots are taken")
        slot = free[0]
        index, dev, made = slot // self.per_page, self.device, []
        try:
            with recording(made):  # the slab's, not the session's being made
                if index not in self.pages:
                    slots = self._page_slots(index)
                    self.pages[index] = [None if words == 0 else
                                         dev.buffer(4 * words * slots, label=f"{self.name}.{index}.{layer}", kind="kv")
                                         for layer, words in enumerate(self.slot_words)]
                if self.partials is None:
                    self.partials = dev.buffer(4 * self._partials_floats, label=f"{self.name}.partials",
                                               kind="scratch")
        except BaseException:
            if not any(s // self.per_page == index for s in self.taken):
                self.pages.pop(index, None)
            if not self.taken:
                self.partials = None
            dev.free(made)
            raise
        self.taken.add(slot)
        return slot

    def caches(self, slot: int) -> list:
        """The slot's cache of every layer (None where a layer has none)."""
        at, page = self.place(slot)
        buffers = self.page_buffers(page)
        return [None if shape is None else
                self._cache(shape, f"{self.name}[{slot}].{i}", (buffers[i], at * self.slot_words[i], self.slot_words[i]))
                for i, shape in enumerate(self.shapes)]

    def page_cache(self, page: int, layer: int) -> KvCache:
        """Page id ``page``'s first slot of ``layer``: the layout a dispatch over the page's rows binds."""
        return self._cache(self.shapes[layer], f"{self.name}.{page}.{layer}",
                           (self.page_buffers(page)[layer], 0, self.slot_words[layer]))

    def give(self, slot: int) -> None:
        """Give a slot back; a page's buffers go with its last slot, ``partials`` with the slab's."""
        if slot not in self.taken:
            return
        self.taken.discard(slot)
        index = slot // self.per_page
        if not any(s // self.per_page == index for s in self.taken):
            self.device.free([b for b in self.pages.pop(index) if b is not None])
        if not self.taken and self.partials is not None:
            self.device.free([self.partials])
            self.partials = None


@dataclass(frozen=True)
class Sequences:
    """The rows of a batched decode step that qk_rope and attention take in one dispatch, each a
    sequence of its own: ``table`` a uniform of ``rows`` vec4<u32> (per batch row: its position,
    its slot inside its page, its page, 0), written before each step; the dispatch takes the rows
    of ``page`` (a row of another page, or 0xFFFFFFFF, is skipped). A row's cache is its slot's
    (``KvSlab``), its q/k/v, q and output rows are its batch row's."""

    table: object
    rows: int
    page: int


NO_PAGE = 0xFFFFFFFF  # a batch row whose cache is in no slab: attended on its own


def check(shape: AttentionShape, workgroup_bytes: int) -> None:
    """What qkv_post and attention need of a layer's shape (called at load; the ops check it too)."""
    shape.check()
    width = shape.q_width + shape.k_width + shape.v_width
    cap = -(-width // THREADS) * THREADS
    limit = min(WORKGROUP_BYTES, workgroup_bytes)
    if 4 * (cap + MAX_VECTORS + 3 * MAX_FREQS) > limit:
        raise UnsupportedModelError(f"qkv_post: q+k+v = {width} floats exceed the workgroup memory ({limit} bytes)")


def _layer_fp16(store, shape: AttentionShape, layer: int) -> tuple:
    """The range of the FP16 buffer holding this layer's taps and q/k norms, and their half
    offsets inside it: binding only that range keeps qkv_post within any storage-binding limit."""
    sh = shape
    counts = {"q_norm": sh.qk_dim, "k_norm": sh.qk_dim}
    if sh.conv_taps:
        counts.update(q_taps=sh.conv_taps * sh.q_width, k_taps=sh.conv_taps * sh.k_width,
                      v_taps=sh.conv_taps * sh.v_width)
    at = {name: store.offset(f"layers.{layer}.{name}") for name in counts}
    begin = 2 * min(at.values()) // STORAGE_OFFSET_ALIGN * STORAGE_OFFSET_ALIGN
    end = -(-2 * max(at[n] + counts[n] for n in at) // 4) * 4
    relative = [at[n] - begin // 2 if n in at else 0 for n in ("q_taps", "k_taps", "v_taps", "q_norm", "k_norm")]
    return Binding(store.buffer, begin, end - begin), relative


def _cache_mode(op: str, cache: KvCache, int8: bool | None) -> bool:
    int8 = cache.int8 if int8 is None else bool(int8)
    if int8 != cache.int8:
        raise ValueError(f"{op}: int8={int8} but {cache.name} is {cache.mode}")
    return int8


def qkv_post(plan: Plan, arena: UniformArena, step, *, shape: AttentionShape, fp16_store, layer: int,
             qkvg, ring, ring_size: int, q_out, cache: KvCache, positions: int, int8: bool | None = None,
             qkvg_stride: int | None = None, q_stride: int | None = None, q_quant: bool = False,
             kv_levels: tuple = (), pad_tokens=None) -> None:
    """Needle 3's conv, per-head norm and RoPE of one chunk; q out, K/V into the cache (§4.5
    items 4-7, §6). ``shape``: ``needle3_shape(geometry, layer)``; ``fp16_store`` (an
    ``Fp16Store``) holds ``layers.{layer}.{q,k,v}_taps`` and ``q_norm`` / ``k_norm``.

    For p = pos0 + t: x' = causal conv of the raw rows (taps [taps][dim], identity when the
    shape has 0 taps; rows before 0 are zero), q and k per head ZCRMSNorm (division form, one
    ``q_norm`` / ``k_norm`` vector for all heads) then NeoX RoPE at the absolute position p; v
    only convolved. int8 mode: q is fake-quantised per head (A8, §4.9 item 4) and K, V are
    quantised per (slot, kv head) as ``reference.ops.quantize_rows`` (IEEE division, round half
    to even; the shader emulates the correctly rounded division). Deploy numerics with an f32
    cache (§4.9 points 4-5): ``q_quant`` fake-quantises q per head as int8 mode does, and
    ``kv_levels`` (the 2^b CQ levels at group 64, ``constants.kv_cq_levels``; empty: none)
    replaces each K and V head vector by its CQ round trip (``reference.ops.cq_fake_quant``)
    before it is stored; head widths must then be at most 64.

    Bindings (``qkv_post.wgsl``): 0 params (uniform, with the f32 RoPE frequencies), 1 ``step``
    (uniform Step, pos0), 2 ``qkvg`` f32 [T][qkvg_stride] (raw q | k | v | gate; read), 3 the
    range of ``fp16`` holding the layer's taps and norms (offsets in params are relative to it),
    4 ``ring`` f32 [ring_size][q+k+v] (raw rows by position mod ring_size; read, then this
    chunk's rows written), 5 ``q_out`` f32 [T][q_stride], 6 the cache buffer (see ``KvCache``),
    7 ``pad_tokens`` u32 [context] when given (PAD_MASK: conv taps j >= 1 reading the pad id 0
    are skipped, §U a; otherwise ``qkvg`` is bound again and never read).
    Workgroups: (T,), 256 invocations. Constants: CAP (q+k+v rounded up to 256), INT8, Q_QUANT,
    KV_CQ (b, or 0), PIO2_1..4, PAD_MASK.
    Requires ring_size >= T + taps - 1 (no slot this chunk reads is written by it) and
    positions below 2^16 (the angle reduction).
    """
    sh = shape
    if (sh.norm, sh.rope, sh.rope_dims, sh.bias) != ("zc", "neox", sh.qk_dim, False):
        raise UnsupportedModelError(f"qkv_post: Needle 3 shapes only (norm {sh.norm}, rope {sh.rope}); "
                                    "dense layers use qk_rope")
    int8 = _cache_mode("qkv_post", cache, int8)
    if cache.mode == "f16":
        raise UnsupportedModelError(f"qkv_post: {cache.name} is f16; Needle 3 caches are f32 or int8 (§6 item 1)")
    sh.check()
    cache.check_chunk(positions)
    taps = sh.conv_taps
    if ring_size < positions + max(taps, 1) - 1:
        raise DeviceLimitError(f"qkv ring of {ring_size} slots is too small for chunks of {positions} "
                               f"(needs T + taps - 1 = {positions + max(taps, 1) - 1})")
    if cache.context > MAX_ROPE_POSITION:
        raise UnsupportedModelError(f"qkv_post: context {cache.context} exceeds {MAX_ROPE_POSITION} (RoPE reduction)")
    width = sh.q_width + sh.k_width + sh.v_width
    cap = -(-width // THREADS) * THREADS
    if 4 * (cap + MAX_VECTORS + 3 * MAX_FREQS) > WORKGROUP_BYTES:
        raise UnsupportedModelError(f"qkv_post: q+k+v = {width} floats exceed the workgroup memory")
    kv_bits = check_kv_cq(sh, kv_levels)
    if int8 and (q_quant or kv_bits):
        raise ValueError("qkv_post: int8 mode quantises q and K/V itself (q_quant / kv_levels are for f32 caches)")
    fp16, (q_taps_at, k_taps_at, v_taps_at, q_norm_at, k_norm_at) = _layer_fp16(fp16_store, sh, layer)
    parts = pio2_parts()
    key = KernelKey("qkv_post", consts=(("CAP", cap), ("INT8", int8), ("Q_QUANT", bool(q_quant)), ("KV_CQ", kv_bits),
                                        *((f"PIO2_{i + 1}", v) for i, v in enumerate(parts)),
                                        ("PAD_MASK", pad_tokens is not None)))
    params = arena.struct(
        key, heads=sh.heads, kv_heads=sh.kv_heads, qk_dim=sh.qk_dim, v_dim=sh.v_dim,
        qkvg_stride=qkvg_stride or width + sh.out_width, taps=taps, ring_slots=ring_size, cache_slots=cache.slots,
        q_stride=q_stride or sh.q_width, q_taps_at=q_taps_at, k_taps_at=k_taps_at, v_taps_at=v_taps_at,
        q_norm_at=q_norm_at, k_norm_at=k_norm_at, k_at=cache.k_at, v_at=cache.v_at, k_scale_at=cache.k_scale_at,
        v_scale_at=cache.v_scale_at, k_row=cache.k_row, v_row=cache.v_row, freqs=sh.frequencies(),
        kv_levels=[*kv_levels, *[0.0] * (MAX_KV_LEVELS - len(kv_levels))])
    plan.add(key, [params, step, qkvg, fp16, ring, q_out, cache.buffer, qkvg if pad_tokens is None else pad_tokens],
             (positions,), label=f"qkv_post {layer}")


def check_kv_cq(shape: AttentionShape, kv_levels: tuple) -> int:
    """The CQ width of a K/V level table (0 when empty); refuses what qkv_post cannot do:
    other than 4, 8 or 16 levels, or head widths above the group of 64 (§4.9 point 5)."""
    if not kv_levels:
        return 0
    bits = {4: 2, 8: 3, 16: 4}.get(len(kv_levels))
    if bits is None:
        raise UnsupportedModelError(f"qkv_post: {len(kv_levels)} CQ K/V levels (2, 3 or 4 bits: 4, 8 or 16)")
    if max(shape.qk_dim, shape.v_dim) > KV_CQ_GROUP:
        raise UnsupportedModelError(f"CQ K/V: head widths {shape.qk_dim}/{shape.v_dim} exceed the group of "
                                    f"{KV_CQ_GROUP} (§4.9 point 5)")
    return bits


BLOCK = 256  # keys per block of attention.wgsl (4 per invocation): one running-max update (4 barriers) each
SPLIT_KEYS = 256  # cache slots per split range on a GPU: a decode step's work per workgroup
# on a CPU adapter (lavapipe, 2 threads; BENCHMARKS.md "Attention that scales"): 30 layers' decode
# attention over 1,024 keys 33.8 ms in ranges of 512, 36.1 in ranges of 256, 39.0 in one range
CPU_SPLIT_KEYS = 512
MAX_SPLITS = 32  # longer caches get longer ranges, so the partials stay T·H·32 rows
MAX_ROWS = 32  # rows (query, head) of a tile: one bit each in a key's visibility mask


@dataclass(frozen=True)
class Tiling:
    """How ``attention`` cuts a layer's work (attention.wgsl): the cache's slots into
    ``splits`` ranges of ``split_blocks`` blocks of ``BLOCK`` slots, a chunk's queries into
    tiles of ``query_tile``, a kv head's query heads into ``head_tiles`` tiles of ``head_tile``.
    One range (a cache of at most ``cache.range_keys`` slots) is one pass; more add the merge."""

    splits: int
    split_blocks: int
    head_tile: int
    head_tiles: int
    query_tile: int

    @property
    def rows(self) -> int:
        return self.head_tile * self.query_tile


def tiling(shape: AttentionShape, cache: KvCache, positions: int, workgroup_bytes: int = WORKGROUP_BYTES,
           sequences: bool = False) -> Tiling:
    """The tiling of ``attention`` for a chunk of ``positions`` queries (or, with ``sequences``, a
    batch's rows: one query a tile, as a decode step alone). The ranges depend on the cache alone
    (never on the chunk), so a position's output is the same in any chunk."""
    blocks = -(-cache.slots // BLOCK)
    split_blocks = max(-(-cache.range_keys // BLOCK), -(-blocks // MAX_SPLITS))
    splits = -(-blocks // split_blocks)
    # workgroup memory: per row its query (in vec4s), a block of scores, 64 + 6 words; per key 1
    # word; and up to 3 words of each of the 6 per-row arrays, which WebGPU rounds up to 16 bytes
    budget = min(WORKGROUP_BYTES, workgroup_bytes) // 4 - BLOCK - 6 * 3
    rows = min(MAX_ROWS, budget // (4 * -(-shape.qk_dim // 4) + BLOCK + 70))
    if rows < 1:
        raise UnsupportedModelError(f"attention: a {shape.qk_dim}-wide query row exceeds the workgroup memory")
    group = shape.heads // shape.kv_heads
    head_tile = min(group, rows)
    head_tiles = -(-group // head_tile)
    query_tile = 1 if sequences else max(1, min(positions, rows // head_tile))
    query_tile = -(-positions // -(-positions // query_tile))  # tiles of equal size
    return Tiling(splits, split_blocks, head_tile, head_tiles, query_tile)


def partials_floats(shape: AttentionShape, cache: KvCache, positions: int) -> int:
    """Floats of the ``partials`` buffer ``attention`` needs for a chunk (0: one pass, none)."""
    splits = tiling(shape, cache, positions).splits
    return 0 if splits == 1 else positions * shape.heads * splits * (shape.v_dim + 2)


def attention_partials(device: Device, shapes: list, caches: list, chunk: int):
    """The one ``partials`` buffer a session's layers share (16 bytes when every layer is one pass:
    the binding is there, never written)."""
    floats = max((partials_floats(shape, cache, chunk) for shape, cache in zip(shapes, caches)), default=0)
    return device.buffer(4 * floats, label="attention_partials", kind="scratch")


def attention(plan: Plan, arena: UniformArena, step, *, shape: AttentionShape, q, cache: KvCache, o,
              positions: int, gate=None, gate_stride: int | None = None, gate_offset: int | None = None,
              int8: bool | None = None, q_stride: int | None = None, o_stride: int | None = None,
              pad_tokens=None, partials=None, sequences: Sequences | None = None, label: str = "attention") -> None:
    """Causal GQA attention of one chunk: o[t][hq·vd + j] = attention(q_t, hq)_j, times
    σ(g[t][gate_offset + hq·vd + j]) when ``shape.gate`` (Needle 3 §4.5 items 8-9, §6 item 1;
    dense §3).

    Query head hq of position p = pos0 + t reads kv head hq // (H / KV) over the keys
    n in [max(0, p + 1 - span), p] (span = ``shape.window``, or the whole context) at cache slot
    n mod slots; scores (q·k)·scale (int8: ((q·k8)·k_scale)·scale; f16: the halves widened to
    f32, summed in the f32 mode's order; scale = ``shape.score_scale``), max-subtracted softmax
    (online over blocks of 256 keys), values weighted by the softmax (int8: the i8 values times
    v_scale; with ``shape.softcap`` each score becomes tanh(s · f32(1/cap)) · cap first). Every
    ``KvCache`` mode is read; Needle 3 uses f32 or int8, the dense family f32 or
    f16.

    The work is tiled (``tiling``, attention.wgsl): each workgroup takes a tile of
    queries and query heads of one kv head over one range of cache slots, so its work is
    bounded whatever the context. A cache of more than ``cache.range_keys`` slots has several ranges:
    each workgroup writes its partial softmax (max, sum, weighted values) to ``partials``
    (``partials_floats`` floats; one buffer serves every layer, as the layers run in turn) and
    a second dispatch merges them (flash-decoding). A position's output has the same bits
    whichever chunk it is in (prefill = decode).

    Bindings (entry ``partial``): 0 params, 1 ``step`` (uniform Step), 2 ``q`` f32
    [T][q_stride] (qkv_post's / qk_rope's output), 3 the cache buffer, 4 ``gate`` f32
    [T][gate_stride] (Needle 3: the qkvg rows, gate at offset q + k + v widths, the defaults;
    without a gate, ``q`` is bound again and never read), 5 ``o`` f32 [T][o_stride], 6
    ``pad_tokens`` u32 [context] when given (PAD_MASK: keys at the pad id 0 are skipped, Needle
    3 §U a; otherwise ``q`` is bound again and never read), 7 ``partials`` (in one pass any
    buffer no other binding writes: never written; a 16-byte one is made when none is given), 8
    the cache buffer again (read as vec4s), 9 the ``Sequences`` table (uniform; without
    ``sequences``, ``step`` again, never read). Workgroups: (splits, KV · head tiles, query
    tiles), 64 invocations. Entry ``merge`` (with several ranges): bindings 0, 4, 5, 7 and 9;
    workgroups (H, T). Constants: KV_MODE (``cache.mode_code``), GATE, PAD_MASK, QK_DIM, K_ROW,
    V_DIM, GROUP, the ``Tiling``, SEQUENCES, SEQ_ROWS and TOUCH_VALUES (on a CPU adapter: the
    values' memory lines are read ahead, with the keys; the bits are the same).

    With ``sequences`` the T = ``positions`` queries are a batch's rows, each a sequence of its
    own (a decode step each): query t is at its table row's position and reads the cache at its
    slot (``cache``: the page's first slot, ``KvSlab.page_cache``), one query a tile, so each row
    gets the bits of its own decode step alone. No PAD_MASK there.
    """
    sh = shape
    int8 = _cache_mode("attention", cache, int8)
    sh.check()
    cache.check_chunk(positions)
    if sh.gate and gate is None:
        raise ValueError("attention: a gated shape needs the gate rows")
    if sequences is not None and (pad_tokens is not None or sequences.rows < positions):
        raise ValueError(f"{label}: a batch's rows take no pad mask, and at most {sequences.rows} of them")
    tiles = tiling(sh, cache, positions, plan.device.limits.max_workgroup_storage, sequences is not None)
    needed = partials_floats(sh, cache, positions)
    if needed and (partials is None or 4 * needed > _bound_bytes(partials)):
        raise ValueError(f"{label}: {cache.name} needs a partials buffer of {4 * needed} bytes "
                         "(attention.partials_floats)")
    width = sh.q_width + sh.k_width + sh.v_width
    quads = cache.mode == "f32" and cache.k_row % 4 == 0 and cache.v_row % 4 == 0  # rows of whole vec4s
    consts = (("KV_MODE", cache.mode_code), ("GATE", sh.gate), ("PAD_MASK", pad_tokens is not None),
              ("QK_DIM", sh.qk_dim), ("K_ROW", cache.k_row), ("V_DIM", sh.v_dim), ("V_ROW", cache.v_row),
              ("QUADS", quads), ("GROUP", sh.heads // sh.kv_heads), ("HEAD_TILE", tiles.head_tile),
              ("HEAD_TILES", tiles.head_tiles), ("QUERY_TILE", tiles.query_tile), ("BLOCK", BLOCK),
              ("SPLITS", tiles.splits), ("SPLIT_BLOCKS", tiles.split_blocks),
              ("SOFTCAP", f32(sh.softcap)), ("SOFTCAP_INV", f32(1.0 / f32(sh.softcap)) if sh.softcap else 0.0),
              ("SEQUENCES", sequences is not None), ("SEQ_ROWS", 1 if sequences is None else sequences.rows),
              ("TOUCH_VALUES", plan.device.software_rasterizer))
    key = KernelKey("attention", "partial", consts)
    at = cache.relative() if sequences is not None else dict(k_at=cache.k_at, v_at=cache.v_at,
                                                             k_scale_at=cache.k_scale_at, v_scale_at=cache.v_scale_at)
    params = arena.struct(
        key, heads=sh.heads, kv_heads=sh.kv_heads, span=cache.span, cache_slots=cache.slots, positions=positions,
        q_stride=q_stride or sh.q_width, gate_stride=gate_stride or width + sh.out_width,
        gate_offset=width if gate_offset is None else gate_offset, o_stride=o_stride or sh.out_width,
        k_at=at["k_at"], v_at=at["v_at"], k_scale_at=at["k_scale_at"], v_scale_at=at["v_scale_at"],
        acc_at=2 * positions * sh.heads * tiles.splits, scale=sh.score_scale, slot_words=cache.slot_words,
        page=0 if sequences is None else sequences.page, zero=0)
    gates = gate if sh.gate else q
    table = step if sequences is None else sequences.table
    # one pass: a binding never written, but not o again (WebGPU forbids writable aliases)
    scratch = partials if partials is not None else plan.device.buffer(16, label="attention_partials")
    plan.add(key, [params, step, q, cache.buffer, gates, o, q if pad_tokens is None else pad_tokens, scratch,
                   cache.buffer, table],
             (tiles.splits, sh.kv_heads * tiles.head_tiles, -(-positions // tiles.query_tile)), label=label)
    if needed:
        merge = KernelKey("attention", "merge", consts)
        plan.add(merge, [params, None, None, None, gates, o, None, partials, None, table], (sh.heads, positions),
                 label=f"{label} merge")


def _bound_bytes(binding) -> int:
    if not isinstance(binding, Binding):
        return binding.size
    return binding.buffer.size - binding.offset if binding.size is None else binding.size


ROPE_CODES = {"none": 0, "adjacent": 1, "neox": 2}
NORM_CODES = {"none": 0, "head": 1, "full": 2}


def qk_rope(plan: Plan, arena: UniformArena, step, *, shape: AttentionShape, qkv, q_out, cache: KvCache,
            positions: int, vectors=None, q_norm_at: int = 0, k_norm_at: int = 0, q_bias_at: int = 0,
            k_bias_at: int = 0, v_bias_at: int = 0, qkv_stride: int | None = None, q_offset: int = 0,
            k_offset: int | None = None, v_offset: int | None = None, q_stride: int | None = None,
            sequences: Sequences | None = None, label: str = "qk_rope") -> None:
    """The dense family's q/k/v after the projections (dense §3): biases, q/k norm, RoPE at the
    absolute position, q out and K/V into the f32 or f16 cache. Reference: ``reference
    .dense_attention.position_heads`` (and ``kv_f16`` of its k and v for an f16 cache).

    Per position p = pos0 + t and head: x += bias (``shape.bias``: qwen2); q and k normed as
    ``shape.norm`` ("head": x·w/rms per head with [qk] weights, qwen3/gemma3; "full": the rms
    over all of q or k, weights [H·qk] / [KV·qk], OLMoE; eps ``shape.eps``); RoPE of the first
    ``shape.rope_dims`` dims of each q/k head in ``shape.rope`` pairing ("adjacent": llama
    GGUFs, "neox": qwen2/qwen3/gemma3) with ``shape.frequencies()``; v only biased. An f16
    cache gets each K/V value clamped to ±65504 (a huge activation saturates rather than
    becoming inf: WGSL leaves ``pack2x16float`` of out-of-range values indeterminate, and an inf
    key would turn the softmax into NaN) and rounded in f32 to the nearest half, ties to even,
    before ``pack2x16float``, whose own rounding WGSL lets each adapter choose: the value is
    exact by then, so every adapter stores the same bits. NaN gives an unspecified half.

    Bindings (``qk_rope.wgsl``): 0 params (uniform, with the RoPE frequencies), 1 ``step``
    (uniform Step, pos0), 2 ``qkv`` f32 [T][qkv_stride] (q at ``q_offset``, k at ``k_offset``,
    v at ``v_offset`` floats; defaults: one q | k | v row), 3 ``vectors`` f32 holding the
    layer's norm weights and biases at the given float offsets (``qkv`` is bound again when the
    shape has neither), 4 ``q_out`` f32 [T][q_stride], 5 the cache buffer (f32 or f16, see
    ``KvCache``), 6 the ``Sequences`` table (uniform; without ``sequences``, ``step`` again,
    never read). Workgroups: (H + 2·KV, T), 64 invocations. Requires positions below 2^16 when
    RoPE is on (the angle reduction).

    With ``sequences`` the T rows are a batch's, each a sequence of its own: row t is at its
    table row's position and writes its K/V into its slot's cache (``cache``: the page's first
    slot, ``KvSlab.page_cache``); rows of another page are skipped.
    """
    sh = shape
    if sh.norm == "zc" or sh.conv_taps:
        raise UnsupportedModelError("qk_rope: Needle 3 shapes (conv, ZCRMSNorm) use qkv_post")
    if cache.int8:
        raise UnsupportedModelError(f"qk_rope: {cache.name} is int8; dense layers use an f32 or f16 cache")
    sh.check()
    cache.check_chunk(positions)
    if sh.rope != "none" and cache.context > MAX_ROPE_POSITION:
        raise UnsupportedModelError(f"qk_rope: context {cache.context} exceeds {MAX_ROPE_POSITION} (RoPE reduction)")
    needs_vectors = sh.bias or sh.norm != "none"
    if needs_vectors and vectors is None:
        raise ValueError(f"{label}: the shape has biases or norms but no vectors buffer was given")
    k_offset = sh.q_width if k_offset is None else k_offset
    v_offset = k_offset + sh.k_width if v_offset is None else v_offset
    consts = (("HEADS", sh.heads), ("KV_HEADS", sh.kv_heads), ("QK_DIM", sh.qk_dim), ("V_DIM", sh.v_dim),
              ("ROPE", ROPE_CODES[sh.rope]), ("ROPE_HALF", sh.rope_dims // 2), ("NORM", NORM_CODES[sh.norm]),
              ("BIAS", sh.bias), ("KV_MODE", cache.mode_code), ("K_ROW", cache.k_row), ("V_ROW", cache.v_row),
              *((f"PIO2_{i + 1}", v) for i, v in enumerate(pio2_parts())),
              ("SEQUENCES", sequences is not None), ("SEQ_ROWS", 1 if sequences is None else sequences.rows))
    if sequences is not None and sequences.rows < positions:
        raise ValueError(f"{label}: {positions} rows, more than the {sequences.rows} of the sequences table")
    key = KernelKey("qk_rope", consts=consts)
    layout = cache.relative() if sequences is not None else dict(k_at=cache.k_at, v_at=cache.v_at)
    params = arena.struct(
        key, qkv_stride=qkv_stride or sh.q_width + sh.k_width + sh.v_width, q_offset=q_offset, k_offset=k_offset,
        v_offset=v_offset, q_stride=q_stride or sh.q_width, cache_slots=cache.slots, k_at=layout["k_at"],
        v_at=layout["v_at"], q_norm_at=q_norm_at, k_norm_at=k_norm_at, q_bias_at=q_bias_at, k_bias_at=k_bias_at,
        v_bias_at=v_bias_at, eps=float(sh.eps), rope_mscale=float(sh.rope_mscale), slot_words=cache.slot_words,
        page=0 if sequences is None else sequences.page, freqs=sh.frequencies())
    bindings = [params, step, qkv, vectors if needs_vectors else qkv, q_out, cache.buffer,
                step if sequences is None else sequences.table]
    plan.add(key, bindings, (sh.heads + 2 * sh.kv_heads, positions), label=label)
