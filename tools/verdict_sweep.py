"""Calibrate the §7 verdict thresholds (spec dense-gguf §7) on our own kernels.

Runs the verdict battery (needle_wgpu/verdict_prompts.txt) batched and token by token on
- the real SmolLM2-135M file (Q4_1 matrices, Q8_0 tied head), when installed;
- a synthetic llama GGUF (synth_gguf.py: 2 layers, d 256, SmolLM2's tokenizer) per quantisation
  type, every matrix in that type: the eight types gguf-py writes, and the K-quants Q4_K, Q5_K,
  Q6_K as random valid blocks rescaled to the same weight spread;
- any file named with --file (the real Gemma-3-270M: Q8_0, Q5_0, Q4_K, Q6_K);
records every prompt's maxdiff and each first-token flip with its margin, and derives MAXDIFF /
MARGIN per type by ``verdict.derive`` (a type's numbers come from every run whose file holds it).

    XDG_RUNTIME_DIR=/tmp/xdg python3 tools/verdict_sweep.py --json /tmp/verdict_sweep.json

Prints one line per run and the table to paste into verdict.THRESHOLDS and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from needle_wgpu import verdict  # noqa: E402

PLAIN_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")  # synth_gguf writes these
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
UNBOUNDED = verdict.Thresholds(math.inf, math.inf)  # collect; classify afterwards


def synthetic_spec(qtype: str):
    from needle_wgpu.synth_gguf import SynthDense

    # d 256 so that K-quant rows (256-value super-blocks) fit; the head is the SmolLM2 vocabulary
    return SynthDense(arch="llama", n_layers=2, d=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                      qtype="F32" if qtype in K_TYPES else qtype, seed=7)


def write_synthetic(qtype: str, directory: Path) -> Path:
    from needle_wgpu.synth_gguf import write_dense_gguf

    path = directory / f"synthetic-llama-{qtype}.gguf"
    if qtype not in K_TYPES:
        return write_dense_gguf(path, synthetic_spec(qtype))
    return write_k_quant_copy(write_dense_gguf(directory / "synthetic-llama-F32.gguf", synthetic_spec("F32")),
                              qtype, path)


def random_k_blocks(rng, qtype: str, target: "object"):
    """Random valid K-quant blocks for an f32 matrix ``target``: random bits, the super-block
    scales set so that each row's values have the target row's standard deviation (gguf-py
    cannot quantise to the K-quants)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from needle_wgpu.kernels import qmatmul

    rows, cols = target.shape
    nbytes = qmatmul.QTYPES[qtype].nbytes
    blocks = rng.integers(0, 256, size=(rows * cols // 256, nbytes), dtype=np.uint8)
    # scale fields: Q6_K int8 sub-scales then d; Q4_K/Q5_K d, dmin first (spec §4.1)
    if qtype == "Q6_K":
        blocks[:, 192:208] = rng.integers(-40, 41, size=(len(blocks), 16)).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = np.full((len(blocks), 1), 0.002, "<f2").view(np.uint8)
        scaled = [(208, 210)]
    else:
        blocks[:, 0:2] = np.full((len(blocks), 1), 0.002, "<f2").view(np.uint8)
        blocks[:, 2:4] = np.full((len(blocks), 1), 0.001, "<f2").view(np.uint8)
        scaled = [(0, 2), (2, 4)]
    kind = GGMLQuantizationType[qtype]
    values = dequantize(blocks.reshape(rows, -1), kind).reshape(rows, cols)
    factor = target.std(axis=1) / np.maximum(values.std(axis=1), 1e-12)
    per_block = np.repeat(factor, cols // 256).astype(np.float32)
    for lo, hi in scaled:
        field = blocks[:, lo:hi].copy().view("<f2").astype(np.float32)[:, 0] * per_block
        blocks[:, lo:hi] = field.astype("<f2").reshape(-1, 1).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_k_quant_copy(source: Path, qtype: str, path: Path) -> Path:
    """The F32 synthetic file with every matrix replaced by random ``qtype`` blocks of the same
    per-row spread (norms stay F32)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(path), reader.get_field("general.architecture").contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(sum(map(ord, qtype)))
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        value = np.asarray(t.data, np.float32).reshape(shape)
        if value.ndim == 1:
            writer.add_tensor(t.name, value)
        else:
            writer.add_tensor(t.name, random_k_blocks(rng, qtype, value), raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sweep_file(path: Path, prompts: list, label: str, shape: str) -> dict:
    import needle_wgpu
    from needle_wgpu.gpu import open_device

    device = open_device()
    # the kernel shape of §8 follows the adapter; on lavapipe the GPU shape can be run by
    # telling the ops the adapter is not a CPU (same arithmetic a GPU runs, slower here)
    device.software_rasterizer = shape == "cpu"
    model = needle_wgpu.load(str(path), device=device)
    label = f"{label} ({shape} shape)"
    types = verdict.quant_types(model)
    results, seconds = verdict.timed_battery(model, prompts, UNBOUNDED)
    maxdiffs = [r.verdict.maxdiff for r in results]
    flips = [{"prompt": r.prompt, "margin": r.verdict.margin, "maxdiff": r.verdict.maxdiff}
             for r in results if r.verdict.tokenwise_top != r.verdict.batched_top]
    run = {"label": label, "file": str(path), "shape": shape, "types": types, "prompts": len(results),
           "tokens": sum(r.tokens for r in results), "seconds": round(seconds, 1),
           "maxdiff": {"max": max(maxdiffs), "median": sorted(maxdiffs)[len(maxdiffs) // 2],
                       "zero": sum(1 for m in maxdiffs if m == 0)},
           "flips": flips, "all_maxdiffs": maxdiffs}
    print(f"{label}: {run['prompts']} prompts, {run['tokens']} tokens, {run['seconds']} s; maxdiff max "
          f"{run['maxdiff']['max']:.3g} median {run['maxdiff']['median']:.3g} ({run['maxdiff']['zero']} exact); "
          f"{len(flips)} flips" + (f", margins <= {max(f['margin'] for f in flips):.3g}" if flips else ""),
          flush=True)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", help="battery file (default: the shipped one)")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only")
    parser.add_argument("--types", default=",".join(PLAIN_TYPES + K_TYPES), help="synthetic types to run")
    parser.add_argument("--smollm2-limit", type=int, default=None, help="first N prompts on SmolLM2")
    parser.add_argument("--no-smollm2", action="store_true")
    parser.add_argument("--file", action="append", default=[], help="also sweep this GGUF (e.g. Gemma-3-270M)")
    parser.add_argument("--shapes", default="cpu,gpu", help="kernel shapes of §8 to run")
    parser.add_argument("--merge", action="append", default=[], help="also derive from the runs of an earlier --json")
    parser.add_argument("--json", default="verdict_sweep.json")
    args = parser.parse_args(argv)
    prompts = verdict.read_battery(args.prompts)[: args.limit]
    runs = []
    shapes = [s for s in args.shapes.split(",") if s]
    for earlier in args.merge:
        runs += json.loads(Path(earlier).read_text())["runs"]
    save = lambda: Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rule": verdict.RULE,
                                                          "runs": runs}, indent=1))
    with tempfile.TemporaryDirectory() as directory:
        for qtype in [t for t in args.types.split(",") if t]:
            path = write_synthetic(qtype, Path(directory))
            for shape in shapes:
                runs.append(sweep_file(path, prompts, f"synthetic {qtype}", shape))
                save()  # after every run: a long sweep cut short keeps what it measured
    if not args.no_smollm2:
        from needle_wgpu.default_model import smollm2_path

        path = smollm2_path(verify_hash=False)
        for shape in shapes if path is not None else ():
            runs.append(sweep_file(path, prompts[: args.smollm2_limit], "SmolLM2-135M", shape))
            save()
    for named in args.file:
        for shape in shapes:
            runs.append(sweep_file(Path(named), prompts, Path(named).stem, shape))
            save()
    table = verdict.thresholds_from_sweep(runs)
    print(f"\nrule: {verdict.RULE} (floor {verdict.FLOOR}); {time.strftime('%Y-%m-%d')}")
    print("| type | runs | prompts | max healthy maxdiff | flips | max flip margin | MAXDIFF | MARGIN |")
    print("|---|---|---|---|---|---|---|---|")
    for qtype, t in table.items():
        holding = verdict.sweep_runs_holding(runs, qtype)
        flips = [f["margin"] for r in holding for f in r["flips"]]
        largest = max(m for r in holding for m in r["all_maxdiffs"])
        print(f"| {qtype} | {', '.join(r['label'] for r in holding)} | {sum(r['prompts'] for r in holding)} | "
              f"{largest:.3g} | {len(flips)} | {max(flips, default=0):.3g} | {t.maxdiff:g} | {t.margin:g} |")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
