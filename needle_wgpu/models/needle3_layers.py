"""Needle 3's blocks and head over rows of scratch (spec §4), shared by a session's chunk plan
(``Needle3Session._build``: one sequence, T positions) and the batched decode step
(``needle3_batch.Needle3Batch``: one position of each of B sequences). The scratch is any object
with the session's buffer names (lanes, nxh, mix, state, hh, qkvg, o, oh, a, xfh, logits) and
``qkvg_stride`` / ``o_stride``, the floats per q|k|v|gate row and per attention-output row."""

from __future__ import annotations

from ..gpu.device import Plan, UniformArena
from ..kernels import cq
from ..kernels.needle3 import embed as embed_ops, engram as engram_ops, mhc as mhc_ops, mlp as mlp_ops
from .needle3_support import _pad


def build_engram(plan: Plan, arena: UniformArena, m, session, step, T: int, *, ekv, ev) -> None:
    """Engram keys and values for every site, once per chunk (§4.2): ``session``'s own ids, its
    ``eh`` scratch and conv ring, into ``ekv`` and ``ev`` (its own rows, or its row of a batch's)."""
    g, d = m.geometry, m.geometry.d_model
    sites = len(g.engram_sites)
    stored_sites = m.rung.sites  # site s runs the stored site stored_sites[s] (§U f)
    eh, width = session.eh, session.eh_width
    for s, kept in enumerate(stored_sites):
        engram_ops.fetch(plan, arena, step, geometry=g, site=s, tables=m.engram_tables[kept], levels=m.levels,
                         tokens=session.tokens, eh=eh, positions=T, act_quant=m.deploy, pad_mask=session.pad_masked)
    if sites and m.rung.full:
        cq.matmul(plan, arena, m.engram_kv, m.levels, eh, ekv, positions=T, x_stride=width,
                  y_stride=sites * 2 * d, x_block_rows=2 * d, x_block_stride=T * width)
    else:  # a rung: each kept site's band of the stored key/value projections
        for s, kept in enumerate(stored_sites):
            cq.matmul(plan, arena, m.engram_kv, m.levels, eh, ekv, positions=T, x_stride=width,
                      x_offset=s * T * width, y_stride=sites * 2 * d, y_offset=s * 2 * d,
                      row_start=kept * 2 * d, rows=2 * d)
    pads = session.tokens if session.pad_masked else None  # the ids the pad mask reads (§U a)
    engram_ops.conv(plan, arena, step, geometry=g, fp16_store=m.fp16, ekv=ekv, ring=session.engram_ring,
                    ring_size=session.ring, ev=ev, positions=T, stored_sites=stored_sites, pad_tokens=pads)


def build_blocks(plan: Plan, arena: UniformArena, m, rows, T: int, attend, cells=None) -> None:
    """Every block over ``T`` rows, from the lanes to the lanes. ``attend(plan, arena, layer,
    kept)`` adds the block's qkv_post and attention (q|k|v|gate rows in ``rows.qkvg`` to
    ``rows.o``): one sequence's chunk, or each sequence of a batch over its own rings and cache.
    ``cells``: the hidden cells the probe heads read (a session that runs heads)."""
    g, dev = m.geometry, plan.device
    G, d, n = m.group, g.d_model, g.mhc_lanes
    d_pad = _pad(d, G)
    sites = len(g.engram_sites)
    deploy = m.deploy  # A8 inside the kernels that prepare a CQ product's input (§4.9)
    compiled = dev.pipeline_count
    # Block ``layer`` runs stored layer ``kept`` (the same at full depth; a rung's blocks
    # are its kept layers, §U f): stored tensors by ``kept``, lane and cell by ``layer``.
    for layer, kept in enumerate(m.rung.blocks):
        if dev.pipeline_count != compiled:  # only report while new pipelines are compiling
            m.report("compile", layer, g.num_layers)
        weights = m.layers[layer]
        mhc_ops.mhc_norm(plan, arena, rows.lanes, rows.nxh, lanes_n=n, width=d, group=G, positions=T,
                         act_quant=deploy)
        cq.matmul(plan, arena, m.mhc, m.levels, rows.nxh, rows.mix, positions=T, x_stride=_pad(g.mhc_width, G),
                  y_stride=m.mix_width, row_start=kept * m.mix_width, rows=m.mix_width)
        site = g.engram_site(layer)
        gate = mhc_ops.EngramGateInputs(rows.ekv, rows.ev, site, sites) if site >= 0 else None
        mhc_ops.mhc_mix(plan, arena, m.fp16, rows.lanes, rows.mix, rows.state, rows.hh, layer=kept,
                        lanes_n=n, width=d, group=G, positions=T, engram=gate, active_lane=layer % n,
                        act_quant=deploy)
        cq.matmul(plan, arena, weights["qkvg"], m.levels, rows.hh, rows.qkvg, positions=T, x_stride=d_pad,
                  y_stride=rows.qkvg_stride)
        attend(plan, arena, layer, kept)
        cq.prepare(plan, arena, rows.o, rows.oh, width=g.attn_out, group=G, positions=T, x_stride=rows.o_stride,
                   act_quant=deploy)
        cq.matmul(plan, arena, weights["out"], m.levels, rows.oh, rows.a, positions=T,
                  x_stride=_pad(g.attn_out, G), y_stride=d)
        mlp_ops.mlp_mix(plan, arena, m.fp16, m.perm, rows.a, rows.state, rows.lanes, layer=kept,
                        shape=m.hada_shape, lanes_n=n, positions=T, cells=cells, cell_index=layer + 1,
                        cell_stride=(g.num_layers + 1) * d)


def build_head(plan: Plan, arena: UniformArena, m, rows, T: int, scored: int) -> None:
    """The final norm over ``T`` rows, then the tied head over the last ``scored`` of them."""
    g, G = m.geometry, m.group
    d_pad = _pad(g.d_model, G)
    embed_ops.final_norm(plan, arena, geometry=g, fp16_store=m.fp16, lanes=rows.lanes, xfh=rows.xfh,
                         positions=T, group=G, act_quant=m.deploy)
    cq.matmul(plan, arena, m.embedding, m.levels, rows.xfh, rows.logits, positions=scored, x_stride=d_pad,
              x_offset=(T - scored) * d_pad, y_stride=g.head_rows, rows=g.head_rows)
