"""Needle 3's batched decode step (``models/batch.py``): ``build_blocks`` over B rows, with each
row's embedding, engram section, qkv_post, attention and sampler run on its own session.

Per block: the mHC norm and mix, the q|k|v|gate projection, the output projection and the MLP
once over the B rows (the CQ matmuls give each row the bits it has alone,
``tests/gpu/test_cq.py``), then per row qkv_post (its conv rings, its position, its cache), and
attention over each row's own cache into its attention-output row: one dispatch for the rows
whose caches share a page of the batch's ``KvSlab`` (the sessions ``session`` makes: the
server's pool), one per row for any other session. Per row before the blocks: its
embedding into its lanes row and its engram keys and values (its own ids, eh scratch and conv
ring) into its ekv / ev rows. Rows a kernel binds on their own start on 256-byte boundaries.
"""

from __future__ import annotations

from ..errors import InputError, UnsupportedModelError
from ..gpu.device import Binding, Plan, UniformArena, recording
from ..kernels import attention as attention_ops
from ..kernels.needle3 import embed as embed_ops, mhc as mhc_ops
from .batch import DecodeBatch
from .needle3_layers import build_blocks, build_engram, build_head
from .needle3_support import _pad

F32 = 4
ROW_ALIGN = 64  # floats: 256 bytes, WebGPU's largest minStorageBufferOffsetAlignment


class Needle3Batch(DecodeBatch):
    """Scratch rows for ``capacity`` sequences of one ``Needle3Gpu``."""

    groups_rows = True  # the slab's rows: attention once a layer per page (_group), after each row's qkv_post

    def __init__(self, model, capacity: int):
        g = model.geometry
        self.model, self.device, self.capacity = model, model.device, capacity
        self.logit_rows = g.head_rows
        G, d, n, sites = model.group, g.d_model, g.mhc_lanes, len(g.engram_sites)
        for name, width in (("lanes", n * d), ("engram keys and values", sites * 2 * d), ("engram values", sites * d)):
            if width % ROW_ALIGN:
                raise UnsupportedModelError(f"batched decoding: a row of {name} ({width} floats) does not start on a "
                                            "256-byte boundary; this geometry's sequences step one by one")
        self._start()
        dev, B = self.device, capacity
        pad = lambda width: -(-width // ROW_ALIGN) * ROW_ALIGN
        self.qkvg_stride = pad(g.q_dim + g.k_dim + g.v_dim + g.attn_out)
        self.o_stride = pad(g.attn_out)
        self.q_stride = pad(g.q_dim)

        def s(width, label):
            return dev.buffer(F32 * B * max(1, width), label=f"batch_{label}", kind="scratch")

        with recording(self._owned):
            self.lanes = s(n * d, "lanes")
            self.nxh = s(_pad(g.mhc_width, G), "nxh")
            self.mix = s(model.mix_width, "mix")
            self.state = mhc_ops.mhc_state(dev, B, d, n, label="batch_mhc_state")
            self.hh = s(_pad(d, G), "hh")
            self.qkvg = s(self.qkvg_stride, "qkvg")
            self.q = s(self.q_stride, "q")
            self.o = s(self.o_stride, "o")
            self.oh = s(_pad(g.attn_out, G), "oh")
            self.a = s(d, "a")
            self.xfh = s(_pad(d, G), "xfh")
            self.ekv = s(sites * 2 * d, "ekv")
            self.ev = s(sites * d, "ev")
            self.logits = s(g.head_rows, "logits")

    def step(self, requests: list) -> list:
        for request in requests:
            session = request.session
            if session.cells is not None or session.pad_masked:
                raise InputError("batched decoding takes plain sessions (no probe heads, no pad mask)")
        return super().step(requests)

    def _layers(self) -> int:
        return len(self.model.rung.blocks)

    def _shared(self, plan: Plan, arena: UniformArena, B: int, attend) -> None:
        m = self.model
        build_blocks(plan, arena, m, self, B, lambda plan, arena, layer, kept: attend(plan, arena, layer))
        build_head(plan, arena, m, self, B, B)

    def _row(self, plan: Plan, arena: UniformArena, session, b: int, layer: int | None) -> None:
        m, g = self.model, self.model.geometry
        d, n, sites = g.d_model, g.mhc_lanes, len(g.engram_sites)
        step = Binding(session.step_uniform)
        if layer is None:
            embed_ops.embed(plan, arena, step, geometry=g, pack=m.embedding, levels=m.levels, tokens=session.tokens,
                            lanes=Binding(self.lanes, F32 * b * n * d, F32 * n * d), positions=1)
            build_engram(plan, arena, m, session, step, 1, ekv=Binding(self.ekv, F32 * b * sites * 2 * d),
                         ev=Binding(self.ev, F32 * b * sites * d))
            return
        kept = m.rung.blocks[layer]
        shape = attention_ops.needle3_shape(g, layer)
        cache = session.caches[layer]
        qkvg = Binding(self.qkvg, F32 * b * self.qkvg_stride, F32 * self.qkvg_stride)
        q_row = Binding(self.q, F32 * b * self.q_stride, F32 * g.q_dim)
        attention_ops.qkv_post(plan, arena, step, shape=shape, layer=kept, fp16_store=m.fp16, qkvg=qkvg,
                               ring=session.qkv_rings[layer], ring_size=session.ring, q_out=q_row, cache=cache,
                               positions=1, int8=session.int8, q_quant=m.deploy and not session.int8,
                               kv_levels=session.kv_levels)
        if self._slot(session) is not None:  # attended with its page's rows (_group)
            return
        o_row = Binding(self.o, F32 * b * self.o_stride, F32 * g.attn_out)
        attention_ops.attention(plan, arena, step, shape=shape, q=q_row, cache=cache, gate=qkvg, o=o_row,
                                positions=1, int8=session.int8, partials=session.partials,
                                label=f"attention {layer}.{b}")

    def _group(self, plan: Plan, arena: UniformArena, slab, page: int, B: int, layer: int) -> None:
        """Attention of layer ``layer`` for the B rows whose caches are in ``page`` (each row's
        qkv_post ran before, into its q row and its slot's cache)."""
        rows = attention_ops.Sequences(Binding(self.sequences), self.capacity, page)
        attention_ops.attention(plan, arena, Binding(self.sequences, 0, 16), shape=slab.shapes[layer], q=self.q,
                                cache=slab.page_cache(page, layer), gate=self.qkvg, gate_stride=self.qkvg_stride,
                                o=self.o, positions=B, q_stride=self.q_stride, o_stride=self.o_stride,
                                partials=slab.partials, sequences=rows, label=f"attention {layer} page {page}")
