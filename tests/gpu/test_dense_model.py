"""The dense GGUF family on the GPU against the NumPy reference of the same graph (dense spec §3):
every position of several prompts, decode after prefill, the head split by rows, and the
real SmolLM2 file when it is installed."""

from __future__ import annotations

import json

import numpy as np
import pytest

import needle_wgpu
from needle_wgpu.default_model import smollm2_path
from needle_wgpu.reference.dense import DenseReference
from needle_wgpu.sampling import Sampling
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

from .parity import rel

pytestmark = pytest.mark.gpu

PROMPTS = ([1, 17, 300, 42, 9, 5000, 77], [2, 2, 2, 2], [1] + list(range(100, 170)))  # the last spans two chunks


def assert_parity(model, reference, prompts, gate=1e-4):
    for ids in prompts:
        ours = np.array(model.logits(ids, context=len(ids)), np.float32)
        theirs = reference.logits(ids)
        assert ours.shape == theirs.shape
        assert rel(ours, theirs) <= gate, (ids[:5], rel(ours, theirs))
        assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("dense")
    for arch, qtype in (("llama", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "Q5_0")):
        out[arch] = write_dense_gguf(root / f"{arch}.gguf", SynthDense(arch=arch, qtype=qtype, seed=3),
                                     tokenizer="bytes")
    # 7 layers (layer 5 global), window 4 (every prompt exceeds it; the 71-token one wraps the
    # sliding layers' ring across two chunks), head_dim 32 != d / n_head, global RoPE base 1e6
    # scaled x8 against the local 1e4.
    out["gemma3"] = write_dense_gguf(root / "gemma3.gguf", SynthDense(
        arch="gemma3", qtype="Q8_0", seed=3, n_layers=7, head_dim=32, sliding_window=4, rope_base=1e6,
        rope_scaling=8.0), tokenizer="bytes")
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_synthetic_every_position_matches_the_reference(arch, synthetic, device):
    path = synthetic[arch]
    model = needle_wgpu.load(str(path), device=device)
    assert model.describe()["architecture"] == arch
    vocab = model.geometry.vocab
    prompts = [[i % vocab for i in ids] for ids in PROMPTS]
    assert_parity(model, DenseReference(path), prompts)


ROPE_VARIANTS = {  # the RoPE variants of tests/test_dense_reference.py's SYNTH, on the GPU
    "llama3": SynthDense(arch="llama", rope_freqs=True, rope_base=5e5, seed=3),
    "yarn": SynthDense(arch="qwen2", rope_scaling=4.0, rope_scaling_type="yarn", rope_orig_context=64,
                       rope_attn_factor=1.1, seed=3),
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_every_position_and_decode(variant, tmp_path, device):
    """Llama 3 frequency factors and YaRN (factor, original context, attention factor): every
    position of every prompt, and greedy decode steps equal the reference's argmax chain."""
    every_position_and_greedy(ROPE_VARIANTS[variant], tmp_path / f"{variant}.gguf", device)


def every_position_and_greedy(spec, path, device) -> tuple:
    """Every position of every prompt against the reference, and greedy prefill + decode steps
    equal to the reference's argmax chain. Returns (model, prompt, greedy ids)."""
    path = write_dense_gguf(path, spec, tokenizer="bytes")
    model = needle_wgpu.load(str(path), device=device)
    reference = DenseReference(path)
    vocab = model.geometry.vocab
    assert_parity(model, reference, [[i % vocab for i in ids] for ids in PROMPTS])
    prompt = [1, 40, 41, 42, 43]
    ours = model.generate(ids=prompt, max_tokens=8, context=32).ids
    assert ours == reference.greedy(prompt, 8)[: len(ours)] and len(ours) >= 1
    return model, prompt, ours


ARCHITECTURES = {  # the architectures of tests/test_dense_reference.py's SYNTH added after the first six
    "smollm3": SynthDense(arch="smollm3", n_layers=4, seed=3),  # layer 3 without RoPE
    "granite": SynthDense(arch="granite", seed=3),  # its four multipliers
    "olmo2": SynthDense(arch="olmo2", seed=3),  # post-norms only
    # soft-capped scores and logits, sliding layers 0 and 2 (the 71-token prompt wraps their ring)
    "gemma2": SynthDense(arch="gemma2", n_layers=4, head_dim=32, sliding_window=4, seed=3),
    # phi3, partial rotary: LongRoPE's long factors for every context here (original context 2),
    # and its short ones (512, the reference's context too)
    "phi3": SynthDense(arch="phi3", rope_dims=12, rope_orig_context=2, rope_attn_factor=1.19, seed=3),
    "phi3-short": SynthDense(arch="phi3", rope_dims=12, rope_orig_context=512, rope_attn_factor=1.19, seed=3),
    # convolution blocks at 0, 1 and 3 (two in a row), attention at 2; the 71-token prompt
    # crosses a chunk boundary, where the blocks read the rows before the chunk from their rings
    "lfm2": SynthDense(arch="lfm2", n_layers=4, conv_layers=(0, 1, 3), seed=3),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_architectures_every_position_and_decode(arch, tmp_path, device):
    """Every position of every prompt against the reference; greedy prefill + decode steps equal
    the reference's argmax chain, and each decode step's logits equal the prefill's row."""
    model, prompt, ours = every_position_and_greedy(ARCHITECTURES[arch], tmp_path / f"{arch}.gguf", device)
    assert model.describe()["architecture"] == ARCHITECTURES[arch].arch
    rows = np.array(model.logits(prompt + ours[:3], context=32), np.float32)
    session = model.gpu.session(context=32)
    try:
        session.prefill(prompt, Sampling.saturate(0.0))
        steps = [session.step(Sampling.saturate(0.0)) for _ in range(3)]
    finally:
        session.close()
    assert steps == ours[1:4] == [int(np.argmax(row)) for row in rows[len(prompt):len(prompt) + 3]]


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_new_quant_types_every_position_match_the_reference(qtype, tmp_path, device):
    """A model whose matrices are all of one of the types synth_quants writes (rows of 256
    weights), uploaded in its file bits (GPU bytes = tensor bytes) and run at every position."""
    spec = SynthDense(arch="llama", d=256, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, qtype=qtype, seed=3)
    path = write_dense_gguf(tmp_path / f"{qtype}.gguf", spec, tokenizer="bytes")
    model = needle_wgpu.load(str(path), device=device)
    described = model.describe()
    assert set(described["quant_bytes"]) == {qtype, "F32"}
    assert described["gpu_weight_bytes"] <= 1.02 * described["tensor_bytes"]
    assert_parity(model, DenseReference(path), [[i % model.geometry.vocab for i in PROMPTS[0]]])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_decode_after_prefill_equals_prefill(arch, synthetic, device):
    """Greedy ids from prefill + decode steps equal the reference's argmax chain, and each decode
    step's logits row equals the all-positions prefill of the same ids."""
    path = synthetic[arch]
    model = needle_wgpu.load(str(path), device=device)
    reference = DenseReference(path)
    prompt = [1, 40, 41, 42, 43]
    ours = model.generate(ids=prompt, max_tokens=12, context=32).ids
    theirs = reference.greedy(prompt, 12)
    assert ours == theirs[: len(ours)] and len(ours) >= 1
    session = model.gpu.session(context=32)
    try:
        session.prefill(prompt, Sampling.saturate(0.0))
        steps = [session.step(Sampling.saturate(0.0)) for _ in range(3)]
    finally:
        session.close()
    assert steps == ours[1:4]


def test_head_and_embedding_split_by_rows(synthetic):
    """A binding limit below the head's size splits the tied embedding/head into parts; logits
    are unchanged."""
    path = synthetic["llama"]
    from needle_wgpu.gpu import open_device

    small = open_device(max_storage_binding=6144)  # the 17,952-byte tied embedding: 3 parts
    model = needle_wgpu.load(str(path), device=small)
    assert len(model.gpu.embedding.parts) >= 3
    assert_parity(model, DenseReference(path), [[1, 17, 200, 42, 9, 263, 0]])


@pytest.mark.slow
def test_smollm2_every_position_matches_the_reference(smollm2):
    model, reference = smollm2, DenseReference(smollm2_path(verify_hash=False))
    prompts = [model.encode_request(text) for text in (
        "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,",
        "def fibonacci(n):\n    return",
        "Paris is the capital of")]
    assert_parity(model, reference, prompts)


def test_f16_kv_cache_stays_within_half_precision(synthetic, device):
    """kv="f16" stores K/V as IEEE halves (2^-11 relative): the logits move by about that much
    (the f32 gate of 1e-4 does not apply; 5e-3 is ~10x the measured f16-vs-f32 attention
    difference) and the argmax does not flip on these prompts; the cache is half the bytes."""
    path = synthetic["qwen3"]
    model = needle_wgpu.load(str(path), device=device)
    reference = DenseReference(path)
    ids = [i % model.geometry.vocab for i in PROMPTS[0]]
    ours = np.array(model.logits(ids, kv="f16", context=len(ids)), np.float32)
    theirs = reference.logits(ids)
    assert 0 < rel(ours, theirs) <= 5e-3
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()
    f32, f16 = (model.gpu.session(context=64, kv=kv) for kv in ("f32", "f16"))
    assert sum(c.nbytes for c in f16.caches) * 2 == sum(c.nbytes for c in f32.caches)
    with pytest.raises(needle_wgpu.UnsupportedModelError):
        model.gpu.session(kv="int8")


def test_cli_generate_json_and_info_on_a_gguf(synthetic, capsys):
    from needle_wgpu import cli

    path = str(synthetic["llama"])
    assert cli.main(["generate", path, "--prompt", "ab", "--max-tokens", "3", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] in ("length", "eos") and 1 <= len(out["ids"]) <= 3
    assert out["prompt_tokens"] >= 1 and set(out["timings"]) >= {"prefill_tokens_per_s", "decode_tokens_per_s"}
    assert cli.main(["generate", path, "--prompt", "ab", "--max-tokens", "3", "--kv", "int8", "--quiet"]) == 2
    assert "f32 or f16" in capsys.readouterr().err
    assert cli.main(["info", path, "--context", "100"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "llama" and info["context"] == 100
    assert info["kv_bytes"]["f16"] * 2 == info["kv_bytes"]["f32"] == 2 * 100 * 2 * (16 + 16) * 4
    assert info["quant_bytes"]["Q8_0"] > 0 and sum(info["quant_bytes"].values()) == info["tensor_bytes"]


def test_a_decode_step_is_one_submit_and_a_4_byte_readback(synthetic, device):
    """9 dispatches per layer when q/k/v and gate/up share a quant type (stacked packs), plus
    the embedding, the final norm, the head and the sampler; one submit; the sampled id is the
    only readback."""
    model = needle_wgpu.load(str(synthetic["llama"]), device=device)
    session = model.gpu.session(context=16)
    try:
        session.prefill([1, 2, 3], Sampling.saturate(0.0))
        c = device.counters
        before = (c.dispatches, c.submits, c.bytes_read)
        session.step(Sampling.saturate(0.0))
        dispatches, submits, read = (a - b for a, b in zip((c.dispatches, c.submits, c.bytes_read), before))
    finally:
        session.close()
    assert (submits, read) == (1, 4)
    layers = model.geometry.num_layers
    assert dispatches <= 9 * layers + 5, dispatches
    assert all(len(w["qkv"]) == 1 and len(w["gate_up"]) == 1 for w in model.gpu.layers)


def test_a_mask_restricts_every_sampled_id(synthetic, device):
    """Constrained decoding's bitmask on the dense sampler: with only a few ids allowed, every
    id sampled (greedy or at a high temperature) is one of them; still one submit per step."""
    model = needle_wgpu.load(str(synthetic["llama"]), device=device)
    rows = model.geometry.head_rows
    allowed = {3, 40, 41, 200}
    words = [0] * (-(-rows // 32))
    for i in allowed:
        words[i // 32] |= 1 << (i % 32)
    mask = b"".join(w.to_bytes(4, "little") for w in words)
    for sampling in (Sampling.saturate(0.0), Sampling.saturate(2.0, seed=7)):
        session = model.gpu.session(context=32)
        try:
            got = [session.prefill([1, 2, 3], sampling, mask=mask)]
            c = device.counters
            submits = c.submits
            got += [session.step(sampling, mask=mask) for _ in range(8)]
            assert c.submits - submits == 8
        finally:
            session.close()
        assert set(got) <= allowed, got
