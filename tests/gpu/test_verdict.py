"""The §7 verdict on the GPU: a healthy engine gives only Match / NearTieFlip on synthetic files,
a batched side that reads one swapped weight row lands in Structured, the CLI prints a line per
prompt and a summary, and SmolLM2 (slow) passes a few battery prompts."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest

import needle_wgpu
from needle_wgpu import cli, verdict
from needle_wgpu.formats.gguf import open_gguf
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

pytestmark = pytest.mark.gpu

HEALTHY = (verdict.MATCH, verdict.NEAR_TIE_FLIP)


def short_prompts(count: int) -> list:
    return [p for p in verdict.read_battery() if len(p) <= 60][:count]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdict")
    return {qtype: write_dense_gguf(root / f"{qtype}.gguf", SynthDense(arch=arch, qtype=qtype, seed=11))
            for arch, qtype in (("llama", "Q8_0"), ("qwen3", "Q4_0"))}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_healthy_engine_gives_only_match_or_near_tie_flip(qtype, files, device):
    model = needle_wgpu.load(str(files[qtype]), device=device)
    thresholds = verdict.thresholds_for(verdict.quant_types(model))
    assert thresholds == verdict.THRESHOLDS[qtype]
    results = verdict.run_battery(model, short_prompts(6) + [verdict.read_battery()[-2]], thresholds)
    assert len(results) == 7 and max(r.tokens for r in results) > 64  # the last one spans two chunks
    kinds = [r.verdict.kind for r in results]
    assert all(kind in HEALTHY for kind in kinds), [(r.prompt, r.verdict) for r in results]
    assert all(0 <= r.verdict.maxdiff <= thresholds.maxdiff for r in results)


def swapped_rows(path, tensor: str, a: int, b: int) -> bytes:
    """The file's bytes with rows ``a`` and ``b`` of ``tensor`` swapped."""
    data = bytearray(path.read_bytes())
    f = open_gguf(bytes(data))
    t = f[tensor]
    start, width = f.data_start + t.offset, t.nbytes // t.rows
    row = lambda i: slice(start + i * width, start + (i + 1) * width)
    data[row(a)], data[row(b)] = data[row(b)], data[row(a)]
    return bytes(data)


def test_a_swapped_weight_row_on_the_batched_side_is_structured(files, device):
    """As if the GEMM indexed one row of a layer's matrix wrongly: tokenwise logits from the
    healthy file, batched logits from a copy with two rows of blk.1.ffn_down swapped."""
    path = files["Q8_0"]
    healthy = needle_wgpu.load(str(path), device=device)
    broken = needle_wgpu.load(swapped_rows(path, "blk.1.ffn_down.weight", 3, 40), device=device)
    thresholds = verdict.THRESHOLDS["Q8_0"]
    kinds = []
    for prompt in short_prompts(4):
        ids = healthy.encode_request(prompt)
        tokenwise = verdict.both_logits(healthy, ids)[0]
        batched = verdict.both_logits(broken, ids)[1]
        v = verdict.classify(tokenwise, batched, thresholds)
        kinds.append(v.kind)
        assert v.maxdiff > 100 * thresholds.maxdiff  # orders of magnitude above a healthy pair
    assert verdict.STRUCTURED in kinds


def test_cli_verdict_prints_a_line_per_prompt_and_a_summary(files, tmp_path):
    battery = tmp_path / "battery.txt"
    battery.write_text("# two prompts\nThe capital of France is\n2 + 2 =\n", encoding="utf-8")
    out = io.StringIO()
    with redirect_stdout(out):
        status = cli.main(["verdict", str(files["Q8_0"]), "--prompts", str(battery), "--quiet"])
    lines = out.getvalue().splitlines()
    assert status == 0, lines
    assert lines[0].startswith("# ") and "MAXDIFF" in lines[0]
    assert [line.split()[0] for line in lines[1:3]] == ["1", "2"]
    assert all(line.split()[1] in HEALTHY for line in lines[1:3])
    assert lines[3].startswith("# 2 prompts:") and "0 Structured" in lines[3]


@pytest.mark.slow
def test_smollm2_battery_prompts_are_healthy(smollm2):
    model = smollm2
    types = verdict.quant_types(model)
    assert {"Q4_1", "Q8_0"} <= set(types)
    results = verdict.run_battery(model, short_prompts(3), verdict.thresholds_for(types))
    assert len(results) == 3 and all(r.verdict.kind in HEALTHY for r in results), [r.verdict for r in results]
