"""The dense family's batched decode step (``models/batch.py``): ``build_layers`` over B rows,
with each row's embedding gather, qk_rope, attention and sampler run on its own session.

Per layer: the norms, q/k/v, Wo and the FFN once over the B rows (q_matmul's GEMV over B
positions: each row summed exactly as a solo step sums it), then qk_rope (each row's q/k/v row,
its position, its cache) and attention over each row's own cache into its attention-output row:
one dispatch each for the rows whose caches share a page of the batch's ``KvSlab`` (the
sessions the batch's ``session`` makes: the server's pool), one per row for any other session.
"""

from __future__ import annotations

from ..gpu.device import Binding, Plan, UniformArena, recording
from ..errors import UnsupportedModelError
from ..kernels import attention as attention_ops
from ..kernels import qmatmul
from .batch import DecodeBatch
from .dense_layers import build_layers, embedding_scale, ffn_scratch, head, qkv_width

F32 = 4
ROW_ALIGN = 64  # floats: a row bound on its own starts on a 256-byte boundary (WebGPU's largest
#              minStorageBufferOffsetAlignment)


class DenseBatch(DecodeBatch):
    """Scratch rows for ``capacity`` sequences of one ``DenseGpu``."""

    groups_rows = True  # the slab's rows: qk_rope and attention once a layer per page (_group)

    def __init__(self, model, capacity: int):
        g = model.geometry
        if g.conv_layers:  # each row would need its own convolution ring: such sessions step one by one
            raise UnsupportedModelError(f"{g.arch}: the batched step has no convolution blocks (lfm2)")
        self.model, self.device, self.capacity = model, model.device, capacity
        self.logit_rows = g.head_rows
        self._start()
        dev, B = self.device, capacity
        self.o_stride = -(-g.attn_out // ROW_ALIGN) * ROW_ALIGN

        def s(width, label):
            return dev.buffer(F32 * B * width, label=f"batch_{label}", kind="scratch")

        with recording(self._owned):
            self.x = s(g.d_model, "residual")
            self.h = s(g.d_model, "normed")
            self.qkv = s(qkv_width(g), "qkv")
            self.q = s(g.q_dim, "q")  # a row attended alone uses row 0
            self.o = s(self.o_stride, "attention")
            ffn_scratch(self, dev, g, B, s)
        self._vectors: dict = {}  # layer -> its qk_rope vectors (norm weights, biases), found by _shared

    def _layers(self) -> int:
        return self.model.geometry.num_layers

    def _shared(self, plan: Plan, arena: UniformArena, B: int, attend) -> None:
        m = self.model

        def mark(plan: Plan, arena: UniformArena, layer: int, vectors: dict) -> None:
            self._vectors[layer] = vectors
            attend(plan, arena, layer)

        build_layers(plan, arena, m, self, B, mark, gemm=False)
        head(plan, arena, m, self, B, B, gemm=False)

    def _group(self, plan: Plan, arena: UniformArena, slab, page: int, B: int, layer: int) -> None:
        """qk_rope and attention of layer ``layer`` for the B rows whose caches are in ``page``."""
        m, g = self.model, self.model.geometry
        width, vectors = qkv_width(g), self._vectors[layer]
        shape, cache = slab.shapes[layer], slab.page_cache(page, layer)
        rows = attention_ops.Sequences(Binding(self.sequences), self.capacity, page)
        table = Binding(self.sequences, 0, 16)  # the step binding: read only without sequences
        attention_ops.qk_rope(plan, arena, table, shape=shape, qkv=self.qkv, q_out=self.q, cache=cache, positions=B,
                              vectors=m.vector_buffer if vectors else None, qkv_stride=width,
                              k_offset=g.q_dim, v_offset=g.q_dim + g.k_dim, sequences=rows,
                              label=f"qk_rope {layer} page {page}", **vectors)
        attention_ops.attention(plan, arena, table, shape=shape, q=self.q, cache=cache, o=self.o, positions=B,
                                o_stride=self.o_stride, partials=slab.partials, sequences=rows,
                                label=f"attention {layer} page {page}")

    def _row(self, plan: Plan, arena: UniformArena, session, b: int, layer: int | None) -> None:
        m, g = self.model, self.model.geometry
        step = Binding(session.step_uniform)
        if layer is None:
            qmatmul.get_rows(plan, arena, m.embedding, session.tokens, self.x, step=step, positions=1,
                             scale=embedding_scale(g), out_stride=g.d_model,
                             out_offset=b * g.d_model)
            return
        if self._slot(session) is not None:  # attended with its page's rows (_grouped)
            return
        width = qkv_width(g)
        at = b * width
        shape, cache, vectors = session.shapes[layer], session.caches[layer], self._vectors[layer]
        attention_ops.qk_rope(plan, arena, step, shape=shape, qkv=self.qkv, q_out=self.q, cache=cache,
                              positions=1, vectors=m.vector_buffer if vectors else None, qkv_stride=width,
                              q_offset=at, k_offset=at + g.q_dim, v_offset=at + g.q_dim + g.k_dim,
                              label=f"qk_rope {layer}.{b}", **vectors)
        o_row = Binding(self.o, F32 * b * self.o_stride, F32 * g.attn_out)
        attention_ops.attention(plan, arena, step, shape=shape, q=self.q, cache=cache, o=o_row, positions=1,
                                partials=session.partials, label=f"attention {layer}.{b}")
