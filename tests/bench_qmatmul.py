"""ms per dispatch of the GGUF dequant-matmuls, every type, both kernel shapes (not a test).

    XDG_RUNTIME_DIR=/tmp/xdg python3 tests/bench_qmatmul.py [--rows 576] [--cols 1536] [--repeat 20]

Each case records ``repeat`` identical dispatches into one plan and runs it once to warm up; the
cases of a type then run in turn ``rounds`` times (submit + a 4-byte read back to wait for the
queue) and each reports its best round, so a busy machine slows every case alike. Prints one
line per type: GEMV (T = 1) and the chunked GEMM at T = 8, in the CPU and GPU shapes, and the
per-position GEMV over 8 positions (``gemm=False``: a batch of 8 decode steps, each position
summed as one GEMV sums it) in the CPU shape.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from needle_wgpu.gpu import Plan, UniformArena, open_device  # noqa: E402
from needle_wgpu.kernels import qmatmul  # noqa: E402
from tests.gpu.test_qmatmul import random_tensor  # noqa: E402


def time_plans(device, plans, y, repeat, rounds):
    """Best ms per dispatch of each plan over ``rounds`` interleaved runs."""
    best = [float("inf")] * len(plans)
    for plan in plans:
        device.run(plan)
        device.read(y, 4)
    for _ in range(rounds):
        for i, plan in enumerate(plans):
            start = time.perf_counter()
            device.run(plan)
            device.read(y, 4)
            best[i] = min(best[i], time.perf_counter() - start)
    return [1000.0 * b / repeat for b in best]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=576)
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--types", default=",".join(qmatmul.QTYPES))
    args = parser.parse_args()
    device = open_device()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{device.adapter_name}; {args.rows} x {args.cols}; ms per dispatch (best of {args.rounds}, "
          f"{args.repeat} per submit); load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'type':6} {'cpu gemv':>9} {'gpu gemv':>9} {'cpu gemm8':>10} {'gpu gemm8':>10} {'cpu batch8':>11}")
    rng = np.random.default_rng(0)
    for qtype in args.types.split(","):
        raw = random_tensor(rng, qtype, args.rows, args.cols)
        pack = qmatmul.upload(device, qtype, qtype, raw, args.rows, args.cols)
        x = device.buffer(4 * 8 * args.cols, label="x", data=rng.normal(size=8 * args.cols).astype(np.float32).tobytes())
        y = device.buffer(4 * 8 * args.rows, label="y")
        plans = []
        for T, shape, gemm in ((1, "cpu", None), (1, "gpu", None), (8, "cpu", None), (8, "gpu", None), (8, "cpu", False)):
            arena, plan = UniformArena(device), Plan(device, "bench")
            for _ in range(args.repeat):
                qmatmul.q_matmul(plan, arena, pack, x, y, positions=T, x_stride=args.cols, y_stride=args.rows,
                                 shape=shape, gemm=gemm)
            plans.append(plan)
        cells = time_plans(device, plans, y, args.repeat, args.rounds)
        print(f"{qtype:6} {cells[0]:9.2f} {cells[1]:9.2f} {cells[2]:10.2f} {cells[3]:10.2f} {cells[4]:11.2f}", flush=True)


if __name__ == "__main__":
    main()
