"""Load time and peak host memory of dense GGUF files of growing size (issue: larger files).

Writes synthetic llama files that differ only in their layer count (d 2048, FFN 5632, 16 heads,
4 KV heads, Q4_0 matrices, a 256-id byte vocabulary), then loads each in a fresh process on the
default device and prints, per file: its size, the load's wall time, and the process's peak
resident memory before and after the load (``VmHWM``, Linux). On a software adapter (lavapipe)
the "GPU" buffers live in host memory too, so the growth counts them once more.

    python3 tools/load_cost.py [OUT_DIR] [--layers 3 6 12 24]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, sys, time
import needle_wgpu
from needle_wgpu.gpu import open_device
def peak_kib():  # this process's own high-water mark (ru_maxrss would count the parent's from before exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
device = open_device()
before = peak_kib()
start = time.perf_counter()
model = needle_wgpu.load(sys.argv[1], device=device)
seconds = time.perf_counter() - start
after = peak_kib()
print(json.dumps({"load_s": seconds, "rss_before_kib": before, "rss_peak_kib": after,
                  "weights_gpu_bytes": device.counters.bytes_allocated.get("weights", 0),
                  "binding": device.limits.max_storage_binding}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="load_cost")
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 6, 12, 24])
    args = parser.parse_args()
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layers in args.layers:
        path = out / f"llama-{layers}.gguf"
        if not path.exists():
            write_dense_gguf(path, SynthDense(arch="llama", n_layers=layers, d=2048, n_ff=5632, n_head=16,
                                              n_head_kv=4, head_dim=128, qtype="Q4_0", context=2048),
                             tokenizer="bytes")
        probe = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, check=True)
        row = {"layers": layers, "file_bytes": os.path.getsize(path)} | json.loads(probe.stdout.strip().splitlines()[-1])
        row["rss_growth_mib"] = (row["rss_peak_kib"] - row["rss_before_kib"]) / 1024
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| layers | file | load | peak RSS growth | growth / file |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['file_bytes'] / 2**20:.0f} MiB | {r['load_s']:.2f} s | "
              f"{r['rss_growth_mib']:.0f} MiB | {r['rss_growth_mib'] * 2**20 / r['file_bytes']:.2f} |")


if __name__ == "__main__":
    main()
