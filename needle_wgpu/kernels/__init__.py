"""The GPU ops: plain functions that add one kernel family's dispatches to a ``Plan``.

A kernel is one set: the op (bindings, workgroup counts, and its parameters named after the
kernel's WGSL ``struct Params``, ``UniformArena.struct``), its WGSL file in shaders/ (the helpers
it includes are in shaders/include/), the NumPy function of ``needle_wgpu.reference`` it must
match, and its parity test in tests/gpu/. Needle 3's own ops are in ``needle3/`` (their references in
``reference/needle3/``). The index, one op a line
(op -> WGSL -> reference -> test; tests/test_kernel_index.py keeps it whole):

norm.rms_norm -> rms_norm.wgsl -> ops.rms_norm -> test_norm_ffn.py
norm.add_rms_norm -> add_rms_norm.wgsl -> ops.rms_norm (after an f32 add) -> test_norm_ffn.py
norm.add_bias -> add_bias.wgsl -> (a NumPy add) -> test_norm_ffn.py
norm.scale_softcap -> scale_softcap.wgsl -> ops.scale_softcap -> test_norm_ffn.py
ffn.gated_activation (swiglu, gelu_gated) -> gated_act.wgsl -> ops.swiglu, ops.gelu_gated -> test_norm_ffn.py
moe.route -> moe_router.wgsl -> dense.moe_route -> test_moe.py
moe.routed_matmul -> q_matmul_routed.wgsl -> dense.moe_ffn -> test_moe.py
qmatmul.q_matmul -> q_matmul.wgsl, q_matmul_rows.wgsl -> qmatmul.matmul -> test_qmatmul.py
qmatmul.get_rows -> get_rows.wgsl -> qmatmul.get_rows -> test_qmatmul.py
conv.short_conv -> short_conv.wgsl -> ops.short_conv -> test_short_conv.py
attention.qk_rope -> qk_rope.wgsl -> dense_attention.position_heads -> test_attention_dense.py
attention.qkv_post -> qkv_post.wgsl -> needle3.attention.position_heads, ops.causal_conv -> test_attention.py
attention.attention -> attention.wgsl -> needle3.attention.attend (entry partial: tiles of queries over ranges of 256 cache slots; entry merge: the ranges' partial softmaxes, flash-decoding) -> test_attention.py, test_attention_long.py, test_kv_f16.py
cq.prepare -> cq_prepare.wgsl -> needle3.cq.prepare_input -> test_cq.py
cq.matmul -> cq_matmul.wgsl, cq_matmul_rows.wgsl -> needle3.cq.matmul_prepared -> test_cq.py
needle3.embed.embed -> embed.wgsl -> needle3.cq.dequantize_rows -> test_embed_engram.py
needle3.embed.final_norm -> final_norm.wgsl -> needle3.mhc.lane_mean, ops.zc_rms_norm -> test_embed_engram.py
needle3.engram.fetch -> engram.wgsl -> needle3.engram.hash_indices, needle3.engram.fetch -> test_embed_engram.py
needle3.engram.hashes -> engram.wgsl -> needle3.engram.hash_indices -> test_embed_engram.py
needle3.engram.conv -> engram.wgsl -> needle3.engram.value_conv -> test_embed_engram.py
needle3.mhc.mhc_norm -> mhc_norm.wgsl -> needle3.mhc.lane_norm, needle3.cq.prepare_input -> test_mhc.py
needle3.mhc.mhc_mix -> mhc_mix.wgsl -> needle3.mhc.mix_down, needle3.engram.gate, ops.zc_rms_norm -> test_mhc.py
needle3.mlp.mlp_mix -> mlp_mix.wgsl -> needle3.hada_mlp.hada_mlp, needle3.mhc.scatter_up -> test_mlp.py
needle3.probe.pool -> probe_pool.wgsl -> needle3.heads.ProbePool.update -> test_upstream.py
sample.process_logits -> logits_process.wgsl -> sampling.process_logits -> test_logits_process.py
sample.sample -> sample.wgsl, sample_staged.wgsl -> sampling.sample -> test_sample.py

Besides the ops: ``packs`` (row-split weight packs), ``needle3.fp16_store`` (the FP16 store and
the permutations), ``attention.KvCache``, ``cq.CQPack`` and ``qmatmul.QPack`` (weights as uploaded).
"""
