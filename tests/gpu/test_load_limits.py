"""Files that load must serve (docs/api.md, "What a model may use"): a geometry some kernel
cannot handle is refused at load with UnsupportedModelError naming the limit; the largest ones
it can handle (64 layers, 16 lanes, head width 256, 16400 logits) load and serve. And a file
whose weights are not finite is reported at load and refused at use.
"""

import dataclasses
import struct

import pytest

from needle_wgpu import synth
from needle_wgpu.engine import Needle3
from needle_wgpu.errors import NonFiniteWeightsError, UnsupportedModelError
from needle_wgpu.formats import cact
from needle_wgpu.formats.needle3_geometry import Needle3Geometry
from needle_wgpu.formats.needle3_tokenizer import synthetic_tokenizer_blob
from needle_wgpu.gpu.device import UniformArena

pytestmark = pytest.mark.gpu

# Small d so that every file is built and served in a few seconds on lavapipe.
BASE = Needle3Geometry(
    vocab=300, out_vocab=300, d_model=64, num_heads=2, num_kv_heads=1, num_layers=2,
    qk_head_dim=16, v_head_dim=16, max_seq_len=32, hada_n=64, mhc_lanes=2,
    sliding_window=8, global_layers=(1,), qkv_conv_taps=3, engram_slots=17,
    engram_sub_dim=32, num_engram_tables=2, engram_conv_taps=2, engram_conv_dilation=1,
    engram_seed_heads=0, engram_orders=(2,), engram_sites=(1,), rope_theta=10000.0)


def build(monkeypatch, group=128, heads=True, **changes) -> bytes:
    """A synthetic file of BASE with ``changes``; the tokenizer is capped at the synthetic
    maximum (a vocabulary larger than its tokenizer is still a valid file)."""
    monkeypatch.setattr(synth, "GROUP", group)
    monkeypatch.setattr(synth, "synthetic_tokenizer_blob", lambda vocab: synthetic_tokenizer_blob(min(vocab, 16384)))
    return synth.synthesize(dataclasses.replace(BASE, **changes), seed=1, heads=heads)


def serves(model) -> None:
    result = model.generate(ids=[2, 40, 41, 42], max_tokens=2)
    assert result.finish_reason == "length" and len(result.ids) == 2
    assert all(0 <= i < model.geometry.head_rows for i in result.ids)


@pytest.mark.parametrize("changes, pattern", [
    (dict(group=4096), r"workgroup memory"),
    (dict(mhc_lanes=17), r"17 mHC lanes \(at most 16"),
    (dict(mhc_lanes=16, d_model=256, hada_n=256, engram_sub_dim=128), r"mhc_norm: n·d = 4096"),
    (dict(qk_head_dim=258), r"head widths 258/16 \(at most 256\)"),
    (dict(v_head_dim=258), r"head widths 16/258 \(at most 256\)"),
    (dict(num_heads=256), r"256 \+ 2·1 heads \(at most 256\)"),
    (dict(num_heads=254), r"qkv_post: q\+k\+v = 4096 floats"),
])
def test_a_geometry_no_kernel_can_serve_is_refused_at_load(device, monkeypatch, changes, pattern):
    data = build(monkeypatch, **changes)
    cact.load(data)  # a valid file ...
    before = dict(device.counters.bytes_allocated)
    with pytest.raises(UnsupportedModelError, match=pattern):  # ... that this engine refuses at once
        Needle3.load(data, device=device)
    assert device.counters.bytes_allocated == before  # nothing was uploaded


@pytest.mark.parametrize("changes", [
    dict(num_layers=64, global_layers=(5, 63), engram_sites=(1, 40, 63)),  # the format's most layers
    dict(mhc_lanes=16),
    dict(qk_head_dim=256, v_head_dim=256, num_heads=2, num_kv_heads=2),
    dict(vocab=16384, out_vocab=16384),
    dict(vocab=16400, out_vocab=16400),  # past one sampler workgroup: the staged sampler
    dict(engram_slots=1, num_engram_tables=1, engram_sub_dim=64),  # a one-row CQ pack
])
def test_the_edge_sizes_serve(device, monkeypatch, changes):
    model = Needle3.load(build(monkeypatch, heads=False, **changes), device=device)
    assert model.warnings == []
    serves(model)


def test_a_plan_takes_as_many_uniform_blocks_as_it_needs(device):
    arena = UniformArena(device, capacity=1024, label="test")
    bindings = [arena.add(i, i + 1, i + 2) for i in range(9)]  # 256 bytes each: four per block
    assert len(arena.blocks) == 3
    assert [b.buffer for b in bindings[:4]] == [arena.blocks[0]] * 4 and bindings[8].buffer is arena.blocks[2]
    assert [b.offset for b in bindings[3:6]] == [768, 0, 256]
    assert all(b.buffer.size == 1024 for b in bindings)


def _with_nan(data: bytes, name: str, part: str = "data") -> bytes:
    t = cact.load(data)[name]
    at = t.offset + (t.rows * t.row_bytes if part == "norms" else 0)
    out = bytearray(data)
    struct.pack_into("<H", out, at, 0x7E00)
    return bytes(out)


@pytest.mark.parametrize("name, part", [("layers.0.norm_in", "data"), ("embedding", "norms")])
def test_non_finite_weights_are_reported_at_load_and_refused_at_use(device, monkeypatch, name, part):
    data = _with_nan(build(monkeypatch), name, part)
    model = Needle3.load(data, device=device)
    (warning,) = model.warnings
    assert f"{name} (1)" in warning
    for request in (lambda: model.generate(ids=[2, 5], max_tokens=2), lambda: model.logits([2, 5]),
                    lambda: model.confidence(ids=[2, 5])):
        with pytest.raises(NonFiniteWeightsError, match=f"cannot serve requests: weights: 1 NaN .*{name}"):
            request()
    assert model.generate(ids=[], max_tokens=2).finish_reason == "empty"  # nothing to run: no error
