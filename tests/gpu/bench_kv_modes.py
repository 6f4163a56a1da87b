"""Attention over an f32 vs an f16 K/V cache: ms per dispatch and cache bytes (a script, not a test).

    XDG_RUNTIME_DIR=/tmp/xdg python3 -m tests.gpu.bench_kv_modes [--keys 1024] [--out kv_modes.json]

For each dense shape and chunk length T, the queries of positions keys - T .. keys - 1 attend
over a cache already holding `keys` positions (random halves, identical in both modes), one
``attention`` dispatch per run, synchronised by a 4-byte read; the median of `--reps` runs after
a warm-up, the two modes interleaved (machine load hits both alike). Bytes are
``KvCache.nbytes`` for every layer of the model at `--context`. Numbers: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from needle_wgpu.gpu import Binding, Plan, UniformArena, open_device
from needle_wgpu.kernels import attention as ops
from needle_wgpu.kernels.attention import AttentionShape

# name: (layers, shape); head counts and widths of the real models (no weights are needed)
MODELS = {
    "smollm2-135m": (30, AttentionShape(9, 3, 64, 64, rope_base=1e5)),
    "qwen3-0.6b": (28, AttentionShape(16, 8, 128, 128, rope_base=1e6, norm="head")),
}


def attention_plan(device, shape, mode, keys, T, rng):
    """A one-dispatch plan over a cache holding `keys` positions of random halves; its output."""
    assert shape.qk_dim % 2 == 0 and shape.v_dim % 2 == 0, "rows are written as whole words"
    cache = ops.KvCache(device, shape, keys, chunk=T, mode=mode)
    rows = keys * shape.kv_heads
    k = rng.normal(size=(rows, shape.qk_dim)).astype(np.float16)
    v = rng.normal(size=(rows, shape.v_dim)).astype(np.float16)
    parts = (k, v) if mode == "f16" else (k.astype(np.float32), v.astype(np.float32))
    device.write(cache.buffer, b"".join(p.tobytes() for p in parts))
    q = device.buffer(4 * T * shape.q_width, label="q",
                      data=(rng.normal(size=T * shape.q_width) * 3).astype(np.float32).tobytes())
    o = device.buffer(4 * T * shape.out_width, label="o")
    step = device.buffer(16, label="step", usage="uniform", data=np.array([keys - T, 0, 0, 0], np.uint32).tobytes())
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, f"attention {mode}")
    partials = ops.attention_partials(device, [shape], [cache], T)
    ops.attention(plan, arena, Binding(step), shape=shape, q=q, cache=cache, o=o, positions=T, partials=partials)
    plan.arena = arena  # keep the uniforms alive with the plan
    return plan, o


def time_modes(device, plans, reps):
    """Median ms per run of each plan, the plans interleaved so machine load hits them alike."""
    times = {mode: [] for mode in plans}
    for _ in range(reps + 1):  # the first round compiles and warms up
        for mode, (plan, o) in plans.items():
            start = time.perf_counter()
            device.run(plan)
            device.read(o, 4)
            times[mode].append(1e3 * (time.perf_counter() - start))
    return {mode: float(np.median(t[1:])) for mode, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="kv_modes.json")
    args = parser.parse_args(argv)
    device = open_device()
    results = []
    for name, (layers, shape) in MODELS.items():
        nbytes = {mode: layers * ops.KvCache(device, shape, args.context, mode=mode).nbytes for mode in ("f32", "f16")}
        for T in args.chunks:
            row = {"model": name, "T": T, "keys": args.keys, "context": args.context,
                   "cache_bytes_f32": nbytes["f32"], "cache_bytes_f16": nbytes["f16"]}
            # The same halves and queries in both modes.
            plans = {mode: attention_plan(device, shape, mode, args.keys, T, np.random.default_rng(T))
                     for mode in ("f32", "f16")}
            for mode, ms in time_modes(device, plans, args.reps).items():
                row[f"ms_{mode}"] = ms
            f32_out, f16_out = (device.read(plans[mode][1]) for mode in ("f32", "f16"))
            row["outputs_equal"] = f32_out == f16_out
            results.append(row)
            print(f"{name:13s} T={T:3d} {args.keys} keys: f32 {row['ms_f32']:8.2f} ms  f16 {row['ms_f16']:8.2f} ms  "
                  f"(same output: {row['outputs_equal']}); cache at {args.context}: "
                  f"{nbytes['f32'] / 2**20:.0f} -> {nbytes['f16'] / 2**20:.0f} MiB")
    with open(args.out, "w") as f:
        json.dump({"adapter": getattr(device, "adapter_name", None), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
