"""A dense model's session: its KV caches (or lfm2's convolution rings), scratch rows for a
fixed context, and the dispatch plan of a chunk (spec dense-gguf §3), built from the layer code
it shares with the batched step (`dense_layers.py`); and what a session of a context takes."""

from __future__ import annotations

import struct

from ..constants import f32
from ..errors import ContextFullError, InputError, UnsupportedModelError
from ..formats.dense_geometry import DenseGeometry
from ..gpu.device import Binding, Plan, UniformArena
from ..kernels import attention as attention_ops
from ..kernels import conv as conv_ops
from ..kernels import qmatmul
from ..kernels import sample as sample_ops
from ..pooling import Pool, rows_needed
from .dense_layers import build_layers, embedding_scale, ffn_scratch, head, qkv_width
from .session import ChunkedSession, PlanKey, session_ids

PREFILL_CHUNK = 64
KV_MODES = ("f32", "f16")  # f16: IEEE halves packed in words (core WGSL, no shader-f16 needed)
DEFAULT_CONTEXT = 4096  # a session's KV cache unless a longer one is asked for (the file may allow 128k)
F32 = 4


def default_context(g: DenseGeometry) -> int:
    return min(g.max_seq_len, DEFAULT_CONTEXT)


def kv_bytes(g: DenseGeometry, context: int, mode: str = "f32") -> int:
    """K and V for every layer at ``context`` positions (sliding layers keep a ring; lfm2's
    convolution blocks only their ring of recent b·x rows, always f32)."""
    total = 0
    for layer in range(g.num_layers):
        if g.is_conv(layer):
            total += F32 * conv_ops.ring_slots(PREFILL_CHUNK, g.conv_taps) * g.d_model * (2 if mode == "f16" else 1)
            continue
        shape = attention_shape(g, layer)
        slots = context if shape.window is None else min(shape.window + PREFILL_CHUNK - 1, context)
        total += F32 * slots * g.num_kv_heads * (g.key_dim + g.value_dim)
    return total // 2 if mode == "f16" else total


def attention_shape(g: DenseGeometry, layer: int, context: int | None = None) -> attention_ops.AttentionShape:
    """One layer's attention for a session of ``context`` positions (LongRoPE's factors depend
    on it; None: the default context)."""
    base, scale = g.rope(layer)
    table, magnitude = g.rope_variant(layer, default_context(g) if context is None else context)
    rope = ("neox" if g.rope_neox else "adjacent") if g.has_rope(layer) else "none"
    if rope == "none":
        table, magnitude = None, 1.0
    return attention_ops.AttentionShape(
        heads=g.num_heads, kv_heads=g.num_kv_heads, qk_dim=g.key_dim, v_dim=g.value_dim,
        window=None if g.is_global(layer) else g.sliding_window, rope=rope,
        rotary_dims=g.rope_dims, rope_base=base, rope_scale=scale, rope_table=table, rope_mscale=magnitude,
        scale=f32(g.attention_scale),
        norm=g.qk_norm or "none", eps=g.rms_eps,
        bias=g.qkv_bias, softcap=g.attn_softcap)


class DenseSession(ChunkedSession):
    """One conversation of a ``dense.DenseGpu``: f32 or f16 K/V caches and scratch rows for a fixed
    context, cached plans."""

    supports_mask = True  # the sampler reads self.mask when the plan key says so

    def __init__(self, model, context=None, kv="f32", slabs=None):
        """``slabs``: where a batch keeps its sessions' caches (``DenseBatch.slab_for``: a
        ``KvSlab`` for the session's shapes, context, chunk and mode, or None when full); None:
        the session's own buffers."""
        g = model.geometry
        self.model = model
        self._open(model.device, default_context(g) if context is None else context, g.max_seq_len)
        self.shapes = [attention_shape(g, layer, self.context) for layer in range(g.num_layers)]
        # a ring forgets keys (sliding layers) and b·x rows (lfm2's convolution blocks)
        self.rewindable = all(shape.window is None for shape in self.shapes) and not g.conv_layers
        mode = "f32" if kv is None else str(kv).lower()
        if mode not in KV_MODES:
            raise UnsupportedModelError(f"kv={kv!r}: dense models keep an f32 or f16 KV cache")
        dev = self.device
        self.logit_rows = g.head_rows
        qkv = qkv_width(g)
        routed = max(1, g.num_experts_used)  # MoE: each position's gate | up rows per selected expert
        widest = F32 * max(g.head_rows, qkv, 2 * g.ff_dim * routed, g.d_model)
        self.chunk = T = max(1, min(PREFILL_CHUNK, self.context, dev.limits.max_storage_binding // widest))
        s = lambda width, label: dev.buffer(F32 * T * width, label=label, kind="scratch")
        self.x = s(g.d_model, "residual")
        self.h = s(g.d_model, "normed")
        self.qkv = s(qkv, "qkv")
        self.q = s(g.q_dim, "q")
        self.o = s(max(g.attn_out, g.d_model if g.conv_layers else 0), "attention")  # lfm2: the gated conv
        self.o_stride = g.attn_out  # floats per attention-output row (a convolution block's rows: d_model)
        ffn_scratch(self, dev, g, T, s)
        slab = None if slabs is None or g.conv_layers else slabs(self.shapes, self.context, T, mode)
        if slab is None:
            self.caches = [None if g.is_conv(i) else
                           attention_ops.KvCache(dev, shape, self.context, chunk=T, name=f"kv_cache.{i}", mode=mode)
                           for i, shape in enumerate(self.shapes)]
        attending = [i for i in range(g.num_layers) if not g.is_conv(i)]
        layouts = self.caches if slab is None else slab.layouts
        self.partials = attention_ops.attention_partials(dev, [self.shapes[i] for i in attending],
                                                         [layouts[i] for i in attending], T)
        self.conv_slots = conv_ops.ring_slots(T, g.conv_taps) if g.conv_layers else 0
        self.conv_rings = {i: dev.buffer(F32 * self.conv_slots * g.d_model, label=f"conv_ring.{i}", kind="kv")
                           for i in g.conv_layers}  # lfm2: each block's b·x rows by position (its state)
        if slab is not None:  # its rows attend with the batch's
            self.caches = self._take_slot(slab)

    def embedding(self, ids: list) -> list:
        """The model's pooling of the final hidden states (after the output norm) over ``ids``,
        L2-normalised (``pooling.py``, as llama.cpp's embeddings): chunks run without a sampler,
        and the rows the pooling needs are read back after each."""
        self._check()
        ids = session_ids(ids)
        if not ids:
            raise InputError("an embedding needs at least one token")
        if self.position + len(ids) > self.context:
            raise ContextFullError(f"embedding: {len(ids)} ids, more than the context of {self.context}")
        d = self.model.geometry.d_model
        pool, needed = Pool(self.model.pooling, d), rows_needed(self.model.pooling, len(ids))
        length = min(self.chunk, self.device.prefill_chunk or self.chunk)
        for start in range(0, len(ids), length):
            part = ids[start : start + length]
            self._run_chunk(part, None)
            rows = [r - start for r in needed if start <= r < start + len(part)]
            if rows:
                first, count = rows[0], rows[-1] - rows[0] + 1
                data = struct.unpack(f"<{count * d}f", self.device.read(self.h, 4 * count * d, 4 * first * d))
                for r in range(count):
                    pool.add(data[r * d : (r + 1) * d])
        return pool.vector()

    def _build(self, key: PlanKey) -> Plan:
        m, g, dev = self.model, self.model.geometry, self.device
        T = key.positions
        arena = UniformArena(dev, capacity=max(1 << 14, 4096 * (g.num_layers + 2) * 16), label=f"uniforms.T{T}")
        plan = Plan(dev, f"dense chunk T={T}")
        step = Binding(self.step_uniform)
        vec = m.vector_buffer
        qmatmul.get_rows(plan, arena, m.embedding, self.tokens, self.x, step=step, positions=T,
                         scale=embedding_scale(g))
        stride = qkv_width(g)

        def attend(plan: Plan, arena: UniformArena, layer: int, vectors: dict) -> None:
            if g.is_conv(layer):  # lfm2: o = c ⊙ conv(b ⊙ x) over the block's ring
                conv_ops.short_conv(plan, arena, step, bcx=self.qkv, weights=vec, ring=self.conv_rings[layer],
                                    y=self.o, width=g.d_model, taps=g.conv_taps, positions=T, slots=self.conv_slots,
                                    weight_at=m.vector(f"blk.{layer}.shortconv.conv.weight"), bcx_stride=stride,
                                    label=f"short_conv {layer}")
                return
            shape = self.shapes[layer]
            attention_ops.qk_rope(plan, arena, step, shape=shape, qkv=self.qkv, q_out=self.q,
                                  cache=self.caches[layer], positions=T, vectors=vec if vectors else None,
                                  qkv_stride=stride, label=f"qk_rope {layer}", **vectors)
            attention_ops.attention(plan, arena, step, shape=shape, q=self.q, cache=self.caches[layer], o=self.o,
                                    positions=T, partials=self.partials, label=f"attention {layer}")

        scored = T if key.all_logits else 1
        build_layers(plan, arena, m, self, T, attend, gemm=None)
        head(plan, arena, m, self, T, scored)
        if key.sample is not None:
            sample_ops.sample(plan, arena, step, logits=self.logits, logits_offset=(scored - 1) * g.head_rows,
                              rows=g.head_rows, tokens=self.tokens, result=self.result, context=self.context,
                              positions=T, sampling=key.sample, mask=self.mask if key.mask else None)
        return plan
