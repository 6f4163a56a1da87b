"""The dense family's layers over rows of scratch (spec dense-gguf §3), shared by a session's
chunk plan (``DenseSession._build``: one sequence, T positions) and the batched decode step
(``dense_batch.DenseBatch``: one position of each of B sequences). The scratch is any object
with the session's buffer names (x, h, qkv, o, branch, gate_up, act, logits; MoE:
router_logits, routes) and ``o_stride``, the floats per attention-output row."""

from __future__ import annotations

from ..constants import f32, sqrt
from ..gpu.device import Plan, UniformArena
from ..kernels import ffn as ffn_ops
from ..kernels import moe as moe_ops
from ..kernels import norm as norm_ops
from ..kernels import qmatmul


def qkv_width(g) -> int:
    """Floats of a row of q | k | v (lfm2's convolution blocks: b | c | x, when that is wider)."""
    return max(g.q_dim + g.k_dim + g.v_dim, 3 * g.d_model if g.conv_layers else 0)


def embedding_scale(g) -> float:
    """What the embedding rows are multiplied by: sqrt(d_model) (Gemma), the file's embedding
    multiplier (Granite), else 1."""
    return sqrt(g.d_model) if g.rules.embedding_scale else f32(g.embedding_multiplier or 1.0)


def layer_vectors(model, layer: int) -> dict:
    """The float offsets of a layer's q/k norm weights and q/k/v biases (those its shape has)."""
    shape, vectors = model.shapes[layer], {}
    name = lambda n: f"blk.{layer}.{n}"
    if shape.norm != "none":
        vectors.update(q_norm_at=model.vector(name("attn_q_norm.weight")),
                       k_norm_at=model.vector(name("attn_k_norm.weight")))
    if shape.bias:
        vectors.update(q_bias_at=model.vector(name("attn_q.bias")), k_bias_at=model.vector(name("attn_k.bias")),
                       v_bias_at=model.vector(name("attn_v.bias")))
    return vectors


def ffn_scratch(owner, dev, g, rows: int, s) -> None:
    """The rows ``build_layers`` and ``head`` write besides the attention's, on ``owner`` (a
    session or a batch) for ``rows`` positions: ``s(width, label)`` makes a scratch buffer of
    ``rows`` x ``width`` floats. MoE: each position's gate | up rows per selected expert."""
    routed = max(1, g.num_experts_used)
    owner.branch = s(g.d_model, "branch")  # Wo and Wdown outputs before the residual add
    owner.gate_up = s(2 * g.ff_dim * routed, "gate_up")
    owner.act = s(g.ff_dim * routed, "act")
    if g.is_moe:
        owner.router_logits = s(g.num_experts, "router_logits")
        owner.routes = dev.buffer(moe_ops.routes_bytes(rows, routed), label="routes", kind="scratch")
    owner.logits = s(g.head_rows, "logits")


def build_layers(plan: Plan, arena: UniformArena, m, rows, T: int, attend, gemm: bool | None = None) -> None:
    """Every layer over ``T`` rows of the scratch ``rows`` (a session's, or a batch's: the same
    attribute names, ``o_stride`` floats per attention output row), from the embedded rows in
    ``rows.x`` to the last layer's FFN output in ``rows.branch``. ``attend(plan, arena, layer,
    vectors)`` adds the layer's qk_rope and attention (q/k/v in ``rows.qkv`` to ``rows.o``): one
    sequence's chunk, or each sequence of a batch over its own cache. ``gemm``: q_matmul's
    choice (a batch of decode steps keeps the GEMV, each row with a solo step's arithmetic)."""
    g = m.geometry
    d = g.d_model
    vec = m.vector_buffer
    rules = g.rules
    width = qkv_width(g)
    residual_scale = g.residual_multiplier or None  # granite: each sublayer's output times it
    pre = rules.pre_norms  # olmo2: the sublayers read the residual stream x itself
    sublayer_in = rows.h if pre else rows.x
    for layer in range(g.num_layers):
        w = m.layers[layer]
        name = lambda n: f"blk.{layer}.{n}"
        norm = m.vector(name("attn_norm.weight")) if pre else 0
        if layer == 0 and pre:
            norm_ops.rms_norm(plan, arena, x=rows.x, weights=vec, y=rows.h, width=d, positions=T,
                              eps=g.rms_eps, weight_at=norm, label="attn_norm 0")
        elif layer:
            post = m.vector(f"blk.{layer - 1}.post_ffw_norm.weight") if rules.post_norms else None
            norm_ops.add_rms_norm(plan, arena, x=rows.x, residual=rows.branch, weights=vec, y=rows.h, width=d,
                                  positions=T, eps=g.rms_eps, weight_at=norm, residual_weight_at=post,
                                  residual_scale=residual_scale, normed=pre, label=f"ffn residual + attn_norm {layer}")
        for pack, row in w["qkv"]:
            qmatmul.q_matmul(plan, arena, pack, sublayer_in, rows.qkv, positions=T, x_stride=d, y_stride=width,
                             y_offset=row, gemm=gemm)
        conv = g.is_conv(layer)  # lfm2: a convolution block writes d_model floats a row
        attend(plan, arena, layer, {} if conv else layer_vectors(m, layer))
        qmatmul.q_matmul(plan, arena, w["out"], rows.o, rows.branch, positions=T, x_stride=d if conv else rows.o_stride,
                         y_stride=d, gemm=gemm)
        post = m.vector(name("post_attention_norm.weight")) if rules.post_norms else None
        norm_ops.add_rms_norm(plan, arena, x=rows.x, residual=rows.branch, weights=vec, y=rows.h, width=d,
                              positions=T, eps=g.rms_eps, weight_at=m.vector(name("ffn_norm.weight")) if pre else 0,
                              residual_weight_at=post, residual_scale=residual_scale, normed=pre,
                              label=f"attention residual + ffn_norm {layer}")
        if g.is_moe:
            _moe_ffn(plan, arena, m, rows, w, T, layer)
        else:
            _dense_ffn(plan, arena, m, rows, w, T, act=rules.activation, x=sublayer_in, label=f"ffn act {layer}",
                       gemm=gemm)


def head(plan: Plan, arena: UniformArena, m, rows, T: int, scored: int, gemm: bool | None = None) -> None:
    """The last residual add and output norm over ``T`` rows, then the head over the last
    ``scored`` of them into ``rows.logits`` (``head_rows`` floats a row), its bias, and the
    logit scale or soft cap where the architecture has one."""
    g, d, vec = m.geometry, m.geometry.d_model, m.vector_buffer
    post = m.vector(f"blk.{g.num_layers - 1}.post_ffw_norm.weight") if g.rules.post_norms else None
    norm_ops.add_rms_norm(plan, arena, x=rows.x, residual=rows.branch, weights=vec, y=rows.h, width=d,
                          positions=T, eps=g.rms_eps, weight_at=m.vector(f"{g.rules.output_norm}.weight"),
                          residual_weight_at=post, residual_scale=g.residual_multiplier or None,
                          label="ffn residual + output_norm")
    qmatmul.q_matmul(plan, arena, m.head, rows.h, rows.logits, positions=scored, x_stride=d,
                     x_offset=(T - scored) * d, y_stride=g.head_rows, gemm=gemm)
    if g.output_bias:
        norm_ops.add_bias(plan, arena, y=rows.logits, bias=vec, width=g.head_rows, positions=scored,
                          bias_at=m.vector("output.bias"), label="output.bias")
    if g.logit_scale or g.final_softcap:  # granite: logits · f32(1 / logit_scale); gemma2: capped
        norm_ops.scale_softcap(plan, arena, y=rows.logits, width=g.head_rows, positions=scored,
                               scale=f32(1.0 / f32(g.logit_scale)) if g.logit_scale else None,
                               cap=g.final_softcap or None, label="logit scale / softcap")


def _dense_ffn(plan: Plan, arena: UniformArena, m, rows, w: dict, T: int, act: str, x, label: str,
               gemm: bool | None = None) -> None:
    """branch = Wdown (act(Wgate x) · Wup x) (§3.2); x is h, or the stream itself (olmo2)."""
    d, ff = m.geometry.d_model, m.geometry.ff_dim
    for pack, row in w["gate_up"]:
        qmatmul.q_matmul(plan, arena, pack, x, rows.gate_up, positions=T, x_stride=d, y_stride=2 * ff,
                         y_offset=row, gemm=gemm)
    ffn_ops.gated_activation(plan, arena, gate=rows.gate_up, up=rows.gate_up, out=rows.act, width=ff,
                             positions=T, act=act, gate_stride=2 * ff, up_stride=2 * ff, up_offset=ff,
                             label=label)
    qmatmul.q_matmul(plan, arena, w["down"], rows.act, rows.branch, positions=T, x_stride=ff,
                     y_stride=d, gemm=gemm)


def _moe_ffn(plan: Plan, arena: UniformArena, m, rows, w: dict, T: int, layer: int) -> None:
    """branch = Σ_j w_j Wdown_e (silu(Wgate_e h) · Wup_e h) over each position's top-k experts
    (§3.2 MoE); gate_up and act hold one row per (position, selected expert)."""
    g = m.geometry
    d, ff, experts, used = g.d_model, g.ff_dim, g.num_experts, g.num_experts_used
    qmatmul.q_matmul(plan, arena, w["ffn_gate_inp"], rows.h, rows.router_logits, positions=T, x_stride=d,
                     y_stride=experts)
    moe_ops.route(plan, arena, logits=rows.router_logits, routes=rows.routes, positions=T, experts=experts,
                  used=used, renormalise=g.rules.renormalise, label=f"moe route {layer}")
    for name, offset in (("ffn_gate_exps", 0), ("ffn_up_exps", ff)):
        moe_ops.routed_matmul(plan, arena, w[name], rows.routes, rows.h, rows.gate_up, experts=experts,
                              used=used, positions=T, combine=False, x_stride=d, y_stride=2 * ff, y_offset=offset)
    ffn_ops.gated_activation(plan, arena, gate=rows.gate_up, up=rows.gate_up, out=rows.act, width=ff,
                             positions=T * used, act=g.rules.activation, gate_stride=2 * ff, up_stride=2 * ff,
                             up_offset=ff, label=f"ffn act {layer}")
    moe_ops.routed_matmul(plan, arena, w["ffn_down_exps"], rows.routes, rows.act, rows.branch, experts=experts,
                          used=used, positions=T, combine=True, x_stride=ff, y_stride=d)
