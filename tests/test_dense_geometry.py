"""DenseGeometry from GGUF metadata and tensor shapes (spec §1, §2): every architecture, the
defaults of §1, and the per-architecture tensors. Malformed models: tests/test_gguf_malformed.py."""

import math

import pytest

from gguf_samples import ARCH_DEFAULTS, dense_gguf
from needle_wgpu.errors import ContainerError, UnsupportedModelError
from needle_wgpu.formats import gguf as G
from needle_wgpu.formats.dense_archs import ARCHITECTURES
from needle_wgpu.formats.dense_geometry import DenseGeometry
from needle_wgpu.formats.gguf import open_gguf
from needle_wgpu.formats.gguf_types import SUPPORTED

ARCHS = list(ARCHITECTURES)


def geometry_of(data) -> DenseGeometry:
    return DenseGeometry.from_gguf(open_gguf(data))


ADJACENT_ROPE = ("llama", "smollm3", "granite")  # llama.cpp's LLAMA_ROPE_TYPE_NORM archs (the converter permuted q/k)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_reads_its_geometry(arch):
    g = geometry_of(dense_gguf(arch))
    d = ARCH_DEFAULTS
    assert (g.arch, g.num_layers, g.d_model, g.ff_dim) == (arch, d["layers"], d["d"], d["ff"])
    assert (g.num_heads, g.num_kv_heads, g.key_dim, g.value_dim, g.rope_dims) == (4, 2, 16, 16, 16)
    assert (g.q_dim, g.k_dim, g.v_dim, g.attn_out, g.kv_repeat) == (64, 32, 32, 64, 2)
    assert (g.vocab, g.context_length, g.rope_base, g.rope_freq_scale) == (256, 512, 10000.0, 1.0)
    assert abs(g.rms_eps - 1e-6) < 1e-12 and g.attention_scale == 0.25
    assert g.rope_neox == (arch not in ADJACENT_ROPE)
    assert g.qk_norm == {"qwen3": "head", "qwen3moe": "head", "gemma3": "head", "olmoe": "full",
                         "olmo2": "full", "lfm2": "head"}.get(arch, "")
    assert g.is_moe == (arch in ("qwen3moe", "olmoe"))
    assert (g.num_experts, g.num_experts_used) == ((4, 2) if g.is_moe else (0, 0))
    untied = ARCHITECTURES[arch].output_required  # olmoe, olmo2
    assert g.tied_head == (not untied)
    assert g.head_tensor == ("output.weight" if untied else "token_embd.weight")
    assert g.qkv_bias == (arch == "qwen2") and not g.output_bias
    names = {name for name, _ in g.tensors()}
    fused = ARCHITECTURES[arch].fused_gate_up  # phi3: gate | up in ffn_up
    assert ("blk.1.ffn_gate_exps.weight" in names) == g.is_moe
    assert ("blk.1.ffn_gate.weight" in names) == (not g.is_moe and not fused)
    assert ("blk.1.attn_qkv.weight" in names) == ("blk.1.attn_q.weight" not in names) == fused
    assert ("blk.0.post_ffw_norm.weight" in names) == (arch in ("gemma3", "gemma2", "olmo2"))
    assert ("blk.0.attn_norm.weight" in names) == ("blk.0.ffn_norm.weight" in names) == (arch != "olmo2")
    assert ("blk.0.attn_v.bias" in names) == (arch == "qwen2")


def test_smollm3_leaves_every_fourth_layer_unrotated():
    """llama.cpp's smollm3 graph: RoPE unless (il + 1) % 4 == 0; the shape says "none" there."""
    from needle_wgpu.models.dense import attention_shape

    g = geometry_of(dense_gguf("smollm3", layers=8))
    assert [g.has_rope(i) for i in range(8)] == [True, True, True, False] * 2
    assert [attention_shape(g, i).rope for i in range(8)] == ["adjacent"] * 3 + ["none"] + ["adjacent"] * 3 + ["none"]
    assert all(geometry_of(dense_gguf("llama", layers=8)).has_rope(i) for i in range(8))


def test_granite_reads_its_multipliers_as_llamacpp_does():
    """logit_scale is required, the other three optional (0: none); attention.scale replaces
    1/sqrt(key_length); a file without RoPE (rope.scaling.finetuned false) is refused by name."""
    g = geometry_of(dense_gguf("granite"))
    assert (g.logit_scale, g.embedding_multiplier, g.residual_multiplier, g.attention_scale) == (8.0, 0.0, 0.0, 0.25)
    keys = {"granite.embedding_scale": (G.FLOAT32, 12.0), "granite.residual_scale": (G.FLOAT32, 0.25),
            "granite.attention.scale": (G.FLOAT32, 0.015625)}
    g = geometry_of(dense_gguf("granite", keys=keys))
    assert (g.embedding_multiplier, g.residual_multiplier, g.attention_scale) == (12.0, 0.25, 0.015625)
    with pytest.raises(ContainerError, match="granite.logit_scale"):
        geometry_of(dense_gguf("granite", keys={"granite.logit_scale": None}))
    with pytest.raises(UnsupportedModelError, match="granite.rope.scaling.finetuned"):
        geometry_of(dense_gguf("granite", keys={"granite.rope.scaling.finetuned": (G.BOOL, False)}))
    assert geometry_of(dense_gguf("llama", keys=keys)).attention_scale == 0.25  # other rows do not read them


def test_olmo2_refuses_sliding_window_layers():
    """llama.cpp's olmo2 applies OLMo 3's sliding layers when attention.sliding_window > 0: not
    implemented here, so refused by name (0 or absent: the plain olmo2 graph)."""
    with pytest.raises(UnsupportedModelError, match="olmo2.attention.sliding_window"):
        geometry_of(dense_gguf("olmo2", keys={"olmo2.attention.sliding_window": (G.UINT32, 4096)}))
    assert geometry_of(dense_gguf("olmo2", keys={"olmo2.attention.sliding_window": (G.UINT32, 0)})).arch == "olmo2"


def test_lfm2_reads_its_convolution_layers(tmp_path):
    """head_count_kv per layer, 0 marking a short-convolution block with its three tensors
    (the conv weights F32, read with the vectors); the final norm is token_embd_norm."""
    from needle_wgpu.models import dense as dense_model
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    path = write_dense_gguf(tmp_path / "lfm2.gguf", SynthDense(arch="lfm2", n_layers=5, conv_layers=(0, 1, 3)),
                            tokenizer="bytes")
    g = dense_model.read(str(path)).geometry
    assert (g.conv_layers, g.conv_taps, g.num_kv_heads) == ((0, 1, 3), 3, 2)
    assert [g.is_conv(i) for i in range(5)] == [True, True, False, True, False]
    names = dict(g.tensors())
    assert names["blk.1.shortconv.conv.weight"] == (3, 64) and names["blk.1.shortconv.in_proj.weight"] == (64, 192)
    assert "blk.1.attn_q.weight" not in names and names["blk.2.attn_q_norm.weight"] == (16,)
    assert "token_embd_norm.weight" in names and "output_norm.weight" not in names
    assert "blk.3.shortconv.conv.weight" in g.vector_tensors()
    assert dense_model.kv_bytes(g, 64) == 2 * 4 * 64 * 2 * 32 + 3 * 4 * (64 + 2) * 64
    keys = {"lfm2.attention.head_count_kv": (G.ARRAY, (G.UINT32, [0, 2]))}
    with pytest.raises(ContainerError):  # layer 0 declared a convolution block, but the file holds attention
        geometry_of(dense_gguf("lfm2", keys=keys))
    keys = {"lfm2.attention.head_count_kv": (G.ARRAY, (G.UINT32, [1, 2]))}
    with pytest.raises(UnsupportedModelError, match="vary by layer"):
        geometry_of(dense_gguf("lfm2", keys=keys))


def test_qk_norm_widths_per_architecture():
    shapes = dict(geometry_of(dense_gguf("qwen3")).tensors())
    assert shapes["blk.0.attn_q_norm.weight"] == shapes["blk.0.attn_k_norm.weight"] == (16,)
    shapes = dict(geometry_of(dense_gguf("olmoe")).tensors())
    assert shapes["blk.0.attn_q_norm.weight"] == (64,) and shapes["blk.0.attn_k_norm.weight"] == (32,)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (64, 4)
    assert shapes["blk.0.ffn_up_exps.weight"] == (64, 128, 4) and shapes["blk.0.ffn_down_exps.weight"] == (128, 64, 4)


def test_gemma3_layers_alternate_five_sliding_one_global():
    g = geometry_of(dense_gguf("gemma3", layers=18, keys={"gemma3.rope.freq_base": (G.FLOAT32, 1e6)}))
    assert [i for i in range(18) if g.is_global(i)] == [5, 11, 17]
    assert g.sliding_window == 8
    assert g.rope(0) == (10000.0, 1.0) and g.rope(5) == (1e6, 1.0)
    assert all(geometry_of(dense_gguf(a)).is_global(0) for a in ARCHS if not ARCHITECTURES[a].sliding_every)


def test_gemma2_alternates_sliding_layers_with_one_rope_and_reads_its_caps():
    """llama.cpp's gemma2: layers 0, 2, 4, ... slide; every layer takes rope.freq_base (and its
    scaling); the caps default to 50 / 30 and are read from the file; 46 layers (the 27B) scale
    queries by 1/sqrt(d / n_head)."""
    from needle_wgpu.models.dense import attention_shape

    keys = {"gemma2.rope.freq_base": (G.FLOAT32, 1e4), "gemma2.rope.scaling.type": (G.STRING, "linear"),
            "gemma2.rope.scaling.factor": (G.FLOAT32, 2.0)}
    g = geometry_of(dense_gguf("gemma2", layers=6, keys=keys))
    assert [i for i in range(6) if g.is_global(i)] == [1, 3, 5]
    assert {g.rope(i) for i in range(6)} == {(1e4, 0.5)}
    assert attention_shape(g, 0).window == 8 and attention_shape(g, 1).window is None
    assert attention_shape(g, 0).frequencies() == attention_shape(g, 1).frequencies()
    assert (g.attn_softcap, g.final_softcap) == (50.0, 30.0) and attention_shape(g, 0).softcap == 50.0
    caps = {"gemma2.attn_logit_softcapping": (G.FLOAT32, 20.0), "gemma2.final_logit_softcapping": (G.FLOAT32, 15.0)}
    g = geometry_of(dense_gguf("gemma2", keys=caps))
    assert (g.attn_softcap, g.final_softcap) == (20.0, 15.0) and g.attention_scale == 0.25
    assert geometry_of(dense_gguf("gemma2", layers=46, d=64, heads=4, head_dim=32)).attention_scale == 0.25
    assert geometry_of(dense_gguf("gemma3", keys=caps)).attn_softcap == 0.0  # other rows do not read them


def test_linear_rope_scaling_applies_to_gemma3_global_layers_only():
    keys = {"gemma3.rope.scaling.type": (G.STRING, "linear"), "gemma3.rope.scaling.factor": (G.FLOAT32, 8.0)}
    g = geometry_of(dense_gguf("gemma3", layers=6, keys=keys))
    assert g.rope(5) == (10000.0, 0.125) and g.rope(0) == (10000.0, 1.0)
    g = geometry_of(dense_gguf("llama", keys={"llama.rope.scale_linear": (G.FLOAT32, 4.0)}))
    assert g.rope(0) == (10000.0, 0.25)


def test_the_gemma3_27b_query_scale():
    g = DenseGeometry(arch="gemma3", num_layers=62, d_model=5376, ff_dim=21504, num_heads=32, num_kv_heads=16,
                      key_dim=128, value_dim=128, rope_dims=128, rope_base=1e6, rope_freq_scale=0.125,
                      rms_eps=1e-6, vocab=262208, context_length=131072, tied_head=True, qkv_bias=False,
                      output_bias=False, sliding_window=1024)
    assert g.attention_scale == 1 / math.sqrt(168)


def test_defaults_of_spec_section_1():
    keys = {f"llama.{k}": None for k in ("attention.head_count_kv", "attention.key_length", "attention.value_length",
                                         "rope.freq_base", "attention.layer_norm_rms_epsilon")}
    g = geometry_of(dense_gguf("llama", kv_heads=4, keys=keys))
    assert (g.num_kv_heads, g.key_dim, g.value_dim, g.rope_dims) == (4, 16, 16, 16)
    assert (g.rope_base, g.rms_eps) == (10000.0, 1e-6)
    assert g.vocab == 256  # no vocab_size key: the embedding's rows
    g = geometry_of(dense_gguf("llama", keys={"llama.vocab_size": (G.UINT32, 256),
                                              "llama.rope.dimension_count": (G.UINT32, 8)}))
    assert g.vocab == 256 and g.rope_dims == 8


def test_head_widths_need_not_match_d():
    """Qwen3-0.6B: 16 heads x 128 = 2048 against d = 1024 (spec §1); here 8 x 16 = 128 against 64."""
    g = geometry_of(dense_gguf("qwen3", heads=8, kv_heads=4, head_dim=16))
    assert (g.q_dim, g.k_dim, g.attn_out, g.d_model) == (128, 64, 128, 64)
    assert dict(g.tensors())["blk.0.attn_output.weight"] == (128, 64)


def test_qwen3moe_expert_width_defaults_to_n_ff_over_used():
    g = geometry_of(dense_gguf("qwen3moe", keys={"qwen3moe.expert_feed_forward_length": None,
                                                 "qwen3moe.feed_forward_length": (G.UINT32, 256)}))
    assert g.ff_dim == 128


def test_untied_heads_and_the_optional_biases():
    g = geometry_of(dense_gguf("llama", tied=False))
    assert not g.tied_head and g.head_tensor == "output.weight"
    g = geometry_of(dense_gguf("qwen2", tied=False, output_bias=True))
    assert g.qkv_bias and g.output_bias and dict(g.tensors())["output.bias"] == (256,)
    g = geometry_of(dense_gguf("llama", qkv_bias=True))
    assert g.qkv_bias and dict(g.tensors())["blk.1.attn_k.bias"] == (32,)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_every_served_type_is_accepted_for_the_matrices(qtype):
    # K-quants need rows of whole 256-weight blocks.
    f = open_gguf(dense_gguf("llama", qtype=qtype, d=256, ff=256, heads=4, kv_heads=2, head_dim=64, vocab=32,
                             layers=1))
    g = DenseGeometry.from_gguf(f)
    assert g.d_model == 256 and f["blk.0.attn_q.weight"].type.name == qtype
    assert f["blk.0.attn_norm.weight"].type.name == "F32"
