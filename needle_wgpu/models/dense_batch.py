"""The dense family's batched decode step (``models/batch.py``): ``build_layers`` over B rows,
with each row's embedding gather, qk_rope, attention and sampler run on its own session.

Per layer: the norms, q/k/v, Wo and the FFN once over the B rows (q_matmul's GEMV over B
positions: each row summed exactly as a solo step sums it), then per row qk_rope (its q/k/v
row, its position, its cache) and attention over its own cache into its attention-output row.
"""

from __future__ import annotations

from ..constants import sqrt
from ..gpu.device import Binding, Plan, UniformArena, recording
from ..kernels import attention as attention_ops
from ..kernels import moe as moe_ops
from ..kernels import qmatmul
from ..kernels import sample as sample_ops
from .batch import BatchKey, DecodeBatch
from .dense_layers import build_layers, head

F32 = 4
ROW_ALIGN = 64  # floats: a row bound on its own starts on a 256-byte boundary (WebGPU's largest
#              minStorageBufferOffsetAlignment)


class DenseBatch(DecodeBatch):
    """Scratch rows for ``capacity`` sequences of one ``DenseGpu``."""

    def __init__(self, model, capacity: int):
        g = model.geometry
        self.model, self.device, self.capacity = model, model.device, capacity
        self.logit_rows = g.head_rows
        self._start()
        dev, B = self.device, capacity
        routed = max(1, g.num_experts_used)
        self.o_stride = -(-g.attn_out // ROW_ALIGN) * ROW_ALIGN

        def s(width, label):
            return dev.buffer(F32 * B * width, label=f"batch_{label}", kind="scratch")

        with recording(self._owned):
            self.x = s(g.d_model, "residual")
            self.h = s(g.d_model, "normed")
            self.qkv = s(g.q_dim + g.k_dim + g.v_dim, "qkv")
            self.q = dev.buffer(F32 * g.q_dim, label="batch_q", kind="scratch")  # one row: used row by row
            self.o = s(self.o_stride, "attention")
            self.branch = s(g.d_model, "branch")
            self.gate_up = s(2 * g.ff_dim * routed, "gate_up")
            self.act = s(g.ff_dim * routed, "act")
            if g.is_moe:
                self.router_logits = s(g.num_experts, "router_logits")
                self.routes = dev.buffer(moe_ops.routes_bytes(B, routed), label="batch_routes", kind="scratch")
            self.logits = s(g.head_rows, "logits")
            self._arena = UniformArena(dev, capacity=1 << 16, label="uniforms.batch_rows")  # the rows' pieces
        self._shared_plans: dict = {}  # B -> (dispatches, attention marks, their arena)
        self._rows: dict = {}  # (session, row) -> [embedding gather, per layer qk_rope + attention]
        self._samplers: dict = {}  # (session, row, sampling, masked) -> the sampler's dispatches
        self._vectors: dict = {}  # layer -> its qk_rope vectors (norm weights, biases)

    def _build(self, key: BatchKey) -> Plan:
        """The composition's plan, put together from cached pieces: the shared dispatches for B
        rows (``_shared``), each row's pieces for its session at its row (``_row``) between them,
        and each row's sampler; a new composition costs no new bind group once its pieces exist."""
        B = len(key.rows)
        shared, marks = self._shared(B)
        rows = [self._row(row.session, b) for b, row in enumerate(key.rows)]
        dispatches = [d for row in rows for d in row[0]]  # the embedding gathers
        start = 0
        for layer, mark in enumerate(marks):
            dispatches += shared[start:mark]
            for row in rows:
                dispatches += row[1 + layer]
            start = mark
        dispatches += shared[start:]
        for b, row in enumerate(key.rows):
            dispatches += self._sampler(row, b)
        plan = Plan(self.device, f"dense batch B={B}")
        plan.dispatches = dispatches
        return plan

    def forget(self, session) -> None:
        super().forget(session)
        for cache in (self._rows, self._samplers):
            for key in [key for key in cache if key[0] is session]:
                del cache[key]

    def close(self) -> None:
        for cache in (self._shared_plans, self._rows, self._samplers):
            cache.clear()
        super().close()

    def _shared(self, B: int) -> tuple:
        """The layers and head over B rows without the per-sequence ops: (dispatches, the index
        where each layer's attention goes)."""
        held = self._shared_plans.get(B)
        if held is None:
            m, dev = self.model, self.device
            arena = UniformArena(dev, capacity=max(1 << 14, 4096 * (m.geometry.num_layers + 2) * 16),
                                 label=f"uniforms.batch{B}")
            plan, marks = Plan(dev, f"dense batch B={B} shared"), []

            def attend(plan: Plan, arena: UniformArena, layer: int, vectors: dict) -> None:
                marks.append(len(plan.dispatches))
                self._vectors[layer] = vectors

            with recording(self._owned):
                build_layers(plan, arena, m, self, B, attend, gemm=False)
                head(plan, arena, m, self, B, B, gemm=False)
            held = self._shared_plans[B] = (plan.dispatches, marks, arena)
        return held[0], held[1]

    def _row(self, session, b: int) -> list:
        """Row ``b`` as ``session``: [its embedding gather, then per layer its qk_rope and
        attention], each a list of dispatches."""
        held = self._rows.get((session, b))
        if held is not None:
            return held
        m, g = self.model, self.model.geometry
        qkv_width = g.q_dim + g.k_dim + g.v_dim
        step = Binding(session.step_uniform)
        plan, pieces = Plan(self.device, f"batch row {b}"), []
        with recording(self._owned):
            qmatmul.get_rows(plan, self._arena, m.embedding, session.tokens, self.x, step=step, positions=1,
                             scale=sqrt(g.d_model) if g.rules.embedding_scale else 1.0, out_stride=g.d_model,
                             out_offset=b * g.d_model)
            pieces.append(plan.dispatches)
            at = b * qkv_width
            o_row = Binding(self.o, F32 * b * self.o_stride, F32 * g.attn_out)
            for layer in range(g.num_layers):
                plan.dispatches = []
                shape, cache, vectors = session.shapes[layer], session.caches[layer], self._vectors[layer]
                attention_ops.qk_rope(plan, self._arena, step, shape=shape, qkv=self.qkv, q_out=self.q, cache=cache,
                                      positions=1, vectors=m.vector_buffer if vectors else None,
                                      qkv_stride=qkv_width, q_offset=at, k_offset=at + g.q_dim,
                                      v_offset=at + g.q_dim + g.k_dim, label=f"qk_rope {layer}.{b}", **vectors)
                attention_ops.attention(plan, self._arena, step, shape=shape, q=self.q, cache=cache, o=o_row,
                                        positions=1, partials=session.partials, label=f"attention {layer}.{b}")
                pieces.append(plan.dispatches)
        self._rows[(session, b)] = pieces
        return pieces

    def _sampler(self, row, b: int) -> list:
        key = (row.session, b, row.sampling, row.masked)
        held = self._samplers.get(key)
        if held is None:
            session, g = row.session, self.model.geometry
            plan = Plan(self.device, f"batch sampler {b}")
            with recording(self._owned):
                sample_ops.sample(plan, self._arena, Binding(session.step_uniform), logits=self.logits,
                                  logits_offset=b * g.head_rows, rows=g.head_rows, tokens=session.tokens,
                                  result=session.result, context=session.context, positions=1, sampling=row.sampling,
                                  mask=session.mask if row.masked else None)
            held = self._samplers[key] = plan.dispatches
        return held
