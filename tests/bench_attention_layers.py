"""A decode step's attention over the default model's 30 layers (not a test).

    XDG_RUNTIME_DIR=/tmp/xdg python3 tests/bench_attention_layers.py [--keys 128,1024,4096] [--mode f32] [--runs 15]

SmolLM2-135M's shape (9 query / 3 kv heads of 64): one plan of 30 ``attention`` dispatches (and
their merges), each over a cache of its own as in the model, so that the K/V stream from memory
(47 MB at 1,024 keys in f32) rather than from the processor's cache; then the same 30
dispatches over one cache, which stays in the cache (what the reads cost without the memory).
The cache holds finite random bits; the query attends the last position of ``keys``. Prints the
least wall and process CPU ms of ``runs`` (the process's CPU includes lavapipe's threads).
"""

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from needle_wgpu.gpu import Binding, Plan, UniformArena, open_device  # noqa: E402
from needle_wgpu.kernels import attention as ops  # noqa: E402
from needle_wgpu.kernels.attention import AttentionShape  # noqa: E402

LAYERS = 30
SHAPE = AttentionShape(9, 3, 64, 64)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(device, keys: int, mode: str, runs: int, shared: bool) -> tuple:
    context = keys + 64
    caches = [ops.KvCache(device, SHAPE, context, chunk=64, mode=mode) for _ in range(1 if shared else LAYERS)]
    bits = np.random.default_rng(1).integers(0, 1 << 30, caches[0].words, dtype=np.uint32)
    bits &= np.uint32(0x3C7F3C7F if mode == "f16" else 0x3E7FFFFF)  # finite halves / floats below 0.25
    for cache in caches:
        device.write(cache.buffer, bits.tobytes())
    caches = caches * LAYERS if shared else caches
    q = device.buffer(4 * SHAPE.q_width, label="q",
                      data=np.random.default_rng(2).normal(size=SHAPE.q_width).astype(np.float32).tobytes())
    o = device.buffer(4 * SHAPE.out_width, label="o")
    step = device.buffer(16, label="step", usage="uniform", data=np.array([keys - 1, 0, 0, 0], np.uint32).tobytes())
    arena, plan = UniformArena(device, capacity=1 << 16), Plan(device, "attention layers")
    partials = ops.attention_partials(device, [SHAPE] * LAYERS, caches, 1)
    for cache in caches:
        ops.attention(plan, arena, Binding(step), shape=SHAPE, q=q, cache=cache, o=o, positions=1, partials=partials)
    device.run(plan)
    device.read(o, 4)
    wall, cpu = float("inf"), float("inf")
    for _ in range(runs):
        c0, w0 = cpu_s(), time.perf_counter()
        device.run(plan)
        device.read(o, 4)
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, cpu_s() - c0)
    return 1e3 * wall, 1e3 * cpu, len(plan.dispatches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="128,1024,4096")
    parser.add_argument("--mode", default="f32", choices=("f32", "f16"))
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    device = open_device()
    print(f"{device.adapter_name}, {LAYERS} layers, {args.mode} K/V: least wall / CPU ms of {args.runs}")
    for keys in (int(k) for k in args.keys.split(",")):
        own = timed(device, keys, args.mode, args.runs, shared=False)
        one = timed(device, keys, args.mode, args.runs, shared=True)
        print(f"keys {keys:5d}: caches of their own {own[0]:7.2f} / {own[1]:7.2f}   one cache {one[0]:7.2f} / "
              f"{one[1]:7.2f}   ({own[2]} dispatches)", flush=True)


if __name__ == "__main__":
    main()
