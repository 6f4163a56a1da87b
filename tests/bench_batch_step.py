"""Step-level timing of a batched decode step (not a test).

    XDG_RUNTIME_DIR=/tmp/xdg python3 tests/bench_batch_step.py [--rows 4,8,16] [--context 66] [--rounds 8]

The default model's decode step alone, a batched step of B sessions with buffers of their own
(each row's qk_rope and attention dispatched on its own) and a batched step of B sessions the
batch made (``batch.session``: caches in its slab, one qk_rope and one attention dispatch a
layer for all rows), interleaved in one process so that a busy machine slows each alike. Each
session reads a 32-id prompt first. Prints best / median ms and B x solo / batched.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import needle_wgpu  # noqa: E402
from needle_wgpu.default_model import smollm2_path  # noqa: E402
from needle_wgpu.models.batch import StepRequest  # noqa: E402
from needle_wgpu.sampling import Sampling  # noqa: E402

PROMPT = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,8,16")
    parser.add_argument("--context", type=int, default=66)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    counts = [int(c) for c in args.rows.split(",")]
    gpu = needle_wgpu.load(smollm2_path()).gpu
    greedy, cap = Sampling(), max(counts)
    batch = gpu.batch(cap)
    kinds = {"rows one by one": [gpu.session(context=args.context) for _ in range(cap)],
             "one dispatch a layer": [batch.session(context=args.context) for _ in range(cap)]}
    solo = gpu.session(context=args.context)
    for sessions in (*kinds.values(), [solo]):
        for i, session in enumerate(sessions):
            session.prefill([2] + [(37 * i + 11 * k) % 40000 + 4 for k in range(PROMPT - 1)], greedy)

    def timed(work) -> float:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start

    def batched(sessions, B):
        return timed(lambda: batch.step([StepRequest(s, greedy) for s in sessions[:B]]))

    for B in counts:  # plans and pipelines made before timing
        for sessions in kinds.values():
            batched(sessions, B)
    solo.step(greedy)
    times = {"solo": [timed(lambda: solo.step(greedy))]}
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for _ in range(args.rounds):
        if max(solo.position, *(s[0].position for s in kinds.values())) >= args.context - 1:
            break
        for B in counts:
            for kind, sessions in kinds.items():
                times.setdefault((kind, B), []).append(batched(sessions, B))
            times["solo"].append(timed(lambda: solo.step(greedy)))
    print(f"load average {os.getloadavg()[0]:.2f}")
    solo_times = times.pop("solo")
    best, median = min(solo_times), statistics.median(solo_times)
    print(f"solo: best {1000 * best:.1f} median {1000 * median:.1f} ms")
    for (kind, B), values in times.items():
        print(f"B={B} {kind}: best {1000 * min(values):.1f} median {1000 * statistics.median(values):.1f} ms; "
              f"{B * best / min(values):.2f}x / {B * median / statistics.median(values):.2f}x")


if __name__ == "__main__":
    main()
