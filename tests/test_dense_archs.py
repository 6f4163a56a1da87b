"""The dense architecture tables (spec dense-gguf.md §1-§3): the engine's
(`formats/dense_archs.py`) and the reference's (`reference/dense.py`) are written apart on
purpose, so an oracle does not share the rules it checks; these tests catch the two drifting
apart, and show that an architecture is one row in each, read everywhere without its name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gguf_samples import dense_gguf
from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.formats import dense_archs
from needle_wgpu.formats.dense_geometry import DenseGeometry
from needle_wgpu.formats.gguf import open_gguf
from needle_wgpu.models import dense as dense_model
from needle_wgpu.reference import dense as reference
from needle_wgpu.reference.dense import DenseReference
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

ARCHS = list(dense_archs.ARCHITECTURES)
# The reference's FFN kind of each (moe, activation) of the engine; a pair missing here has no
# reference graph to be checked against.
FFN_KINDS = {(False, "silu"): "dense", (False, "gelu_tanh"): "gelu", (True, "silu"): "moe"}


def shared_facts(engine: dense_archs.ArchRules, ref: reference.ArchRules) -> dict:
    """{reference field: (engine's value, reference's value)} for every fact both tables hold."""
    return {
        "rope_style": (engine.rope_style, ref.rope_style),
        "qk_norm": (engine.qk_norm, ref.qk_norm),
        "qkv_bias": (engine.qkv_bias == "required", ref.qkv_bias),
        "ffn": (FFN_KINDS.get((engine.moe, engine.activation)), ref.ffn),
        "renormalise": (engine.renormalise, ref.renormalise),
        "embedding_scale": (engine.embedding_scale, ref.embedding_scale),
        "post_norms": (engine.post_norms, ref.post_norms),
        "expert_width_key": (engine.expert_width_key, ref.expert_width_key),
        "sliding_every": (engine.sliding_every, ref.sliding_every),
        "local_rope_base": (engine.local_rope_base, ref.local_rope_base),
        "d_query_scale_layers": (engine.d_query_scale_layers, ref.d_query_scale_layers),
        "rope_factor_tensors": (engine.rope_factor_tensors, ref.rope_factor_tensors),
        "fused": (engine.fused_qkv and engine.fused_gate_up, ref.fused),
        "nope_every": (engine.nope_every, ref.nope_every),
        "multipliers": (engine.multipliers, ref.multipliers),
        "pre_norms": (engine.pre_norms, ref.pre_norms),
        "softcaps": (engine.softcaps, ref.softcaps),
        "short_conv": (engine.short_conv, ref.short_conv),
        "output_norm": (engine.output_norm, ref.output_norm),
    }


def test_both_tables_name_the_same_architectures():
    """The engine serves no architecture its oracle cannot run, and the oracle none the engine
    lacks."""
    assert list(dense_archs.ARCHITECTURES) == list(reference.ARCHITECTURES)


@pytest.mark.parametrize("arch", sorted(set(dense_archs.ARCHITECTURES) & set(reference.ARCHITECTURES)))
def test_the_two_tables_agree_on_every_fact_both_hold(arch):
    facts = shared_facts(dense_archs.ARCHITECTURES[arch], reference.ARCHITECTURES[arch])
    disagree = {name: pair for name, pair in facts.items() if pair[0] != pair[1]}
    assert not disagree, f"{arch}: engine vs reference {disagree}"


def test_every_reference_rule_is_compared():
    """A rule added to the reference's table must be added to the comparison (and to the
    engine's table) too."""
    compared = set(shared_facts(dense_archs.ArchRules(), reference.ArchRules(rope_style="neox")))
    assert compared == {f.name for f in dataclasses.fields(reference.ArchRules)}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_new_architecture_is_one_row_in_each_table(arch, tmp_path, monkeypatch):
    """A copy of a row under a new name (one row in each table, no code change) is read by the
    geometry and the graph's description, written by the synthetic writer and run by the
    reference exactly as the original: nothing tests an architecture's name. Taking the rows
    out again makes all of them refuse it."""
    new = f"new{arch}"
    monkeypatch.setitem(dense_archs.ARCHITECTURES, new, dense_archs.ARCHITECTURES[arch])
    monkeypatch.setitem(reference.ARCHITECTURES, new, reference.ARCHITECTURES[arch])
    rules = dense_archs.ARCHITECTURES[arch]
    spec = SynthDense(arch=arch, n_layers=max(2, rules.sliding_every, rules.nope_every), seed=4)
    paths = {a: write_dense_gguf(tmp_path / f"{a}.gguf", dataclasses.replace(spec, arch=a), tokenizer="bytes")
             for a in (arch, new)}

    files = {a: dense_model.read(str(path)) for a, path in paths.items()}
    original, copied = files[arch].geometry, files[new].geometry
    assert copied.arch == new and dataclasses.replace(copied, arch=arch) == original
    assert copied.tensors() == original.tensors()
    described = {a: dense_model.describe(f) for a, f in files.items()}
    for entry in ("experts", "tensor_bytes", "quant_bytes", "context", "kv_bytes"):
        assert described[new][entry] == described[arch][entry], entry
    assert described[new]["architecture"] == new
    sample = DenseGeometry.from_gguf(open_gguf(dense_gguf(new)))
    assert dataclasses.replace(sample, arch=arch) == DenseGeometry.from_gguf(open_gguf(dense_gguf(arch)))

    ids = [1, 17, 200, 42, 9, 5, 77, 130]
    assert np.array_equal(DenseReference(paths[new]).logits(ids), DenseReference(paths[arch]).logits(ids))

    monkeypatch.delitem(dense_archs.ARCHITECTURES, new)
    monkeypatch.delitem(reference.ARCHITECTURES, new)
    with pytest.raises(UnsupportedModelError, match=f"architecture '{new}' is not supported"):
        dense_model.read(str(paths[new]))
    with pytest.raises(UnsupportedModelError, match=f"architecture '{new}' is not supported"):
        DenseReference(paths[new])
    with pytest.raises(ValueError, match=f"got '{new}'"):
        SynthDense(arch=new).resolved()


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_the_docs_list_what_the_table_serves(doc):
    """README.md and docs/api.md hold `supported_markdown` verbatim between their markers:
    a row added to or changed in the table must be added to the docs (paste the function's text)."""
    from pathlib import Path

    from needle_wgpu.formats.gguf_types import SUPPORTED

    text = (Path(__file__).resolve().parents[1] / doc).read_text()
    begin = text.index("<!-- supported: generated from needle_wgpu/formats/dense_archs.py")
    begin = text.index("\n", begin) + 1
    end = text.index("\n<!-- end supported -->", begin)
    assert text[begin:end] == dense_archs.supported_markdown(SUPPORTED)
    assert all(f"| `{name}` |" in text for name in dense_archs.ARCHITECTURES)
