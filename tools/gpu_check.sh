#!/usr/bin/env bash
# The device check for a machine with a real GPU (the workplace's device tool): one prepared
# script that installs from carried wheels, runs the GPU parity tests, and benchmarks the host
# cost and the decode speed at several contexts and round lengths, writing every figure to $OUT.
#
# Prepare here (once; both folders are ignored by git and carried to the machine):
#   bash tools/gpu_check.sh --prepare     # downloads the wheels into .whl/ and the Vulkan loader into .gl/
# Run there:  carry [".whl", ".gl"] and run `bash tools/gpu_check.sh` with a timeout of 540 s.
# The 64 MiB the device tool carries leave out the real SmolLM2 file (98 MB): the dense figures
# use a synthetic file of SmolLM2's geometry and quantisation (the same dispatches and bytes),
# Needle 3 its shipped geometry (synthetic weights). Record the results in BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
  grep -qx '/.gl/' .git/info/exclude || echo '/.gl/' >> .git/info/exclude
  platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms -d .whl wgpu==0.32.0 cffi numpy pycparser jinja2 markupsafe sniffio rubicon-objc \
    pytest pluggy iniconfig packaging gguf pyyaml tqdm 2>/dev/null || true
  mkdir -p .gl /tmp/amd64/partial
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  apt-get $o update -qq && (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
  du -sh .whl .gl
  exit 0
fi

OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
log() { echo "$*" | tee -a "$OUT/log.txt"; }
for f in .gl/*.deb; do dpkg -x "$f" / ; done
ldconfig
if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH="/tmp/site:$PWD" || { log "wheel install failed"; exit 1; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import needle_wgpu.gpu as g; d = g.open_device(); print(d.adapter_name, 'software' if d.software_rasterizer else 'hardware')" \
  | tee "$OUT/adapter.txt"

# Parity on the real GPU: kernels against their NumPy references, multi-token decoding, both families.
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention.py tests/gpu/test_attention_dense.py \
  tests/gpu/test_attention_long.py tests/gpu/test_qmatmul.py \
  tests/gpu/test_sample.py tests/gpu/test_rounds.py tests/gpu/test_model.py tests/gpu/test_dense_model.py \
  tests/gpu/test_batch.py > "$OUT/parity.txt" 2>&1
log "parity: $(tail -1 "$OUT/parity.txt")"
# 30 layers' decode attention alone at 128 / 1,024 / 4,096 keys (SmolLM2's shape).
timeout 60 python3 tests/bench_attention_layers.py --runs 30 > "$OUT/attention_layers.txt" 2>&1
log "attention layers: $(tail -1 "$OUT/attention_layers.txt")"

python3 - <<'PY' > "$OUT/bench.json" 2>> "$OUT/log.txt"
import json, os, sys, tempfile, time
import needle_wgpu
from needle_wgpu.cli.bench import host_cost
from needle_wgpu.synth import synthesize
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

results = {}
models = {"needle3-shipped": synthesize("shipped", 0)}
dense = os.path.join(tempfile.mkdtemp(), "smollm2-geometry.gguf")
# SmolLM2-135M's layers (30 x d 576, 9/3 heads of 64, ffn 1536, Q4_1, context 8192); the byte
# tokenizer makes the head smaller than SmolLM2's 49,152 rows, so the head's share is smaller.
write_dense_gguf(dense, SynthDense(arch="llama", n_layers=30, d=576, n_ff=1536, n_head=9, n_head_kv=3,
                                   head_dim=64, qtype="Q4_1", context=8192, seed=0), tokenizer="bytes")
models["dense-smollm2-layers"] = dense
for name, source in models.items():
    model = needle_wgpu.load(source)
    rows = []
    for context in (128, 1024, 4096):
        if context + 64 > model.geometry.max_seq_len:
            continue
        prompt = [1] + [100 + i % 900 for i in range(context - 1)]
        for k in (1, 4, 8):
            started = time.perf_counter()
            rows.append(dict(host_cost(model, prompt, 64, k), context=context,
                             seconds=round(time.perf_counter() - started, 2)))
            print(name, rows[-1], file=sys.stderr, flush=True)
    results[name] = {"adapter": model.gpu.device.adapter_name, "rows": rows}
# Concurrent streams through the server's batched step (GPU shape: gemv_batch, 4 rows a weight read).
from needle_wgpu.server.bench_streams import run_streams
results["streams"] = run_streams(needle_wgpu.load(dense), [1, 4, 8, 16], 32, 64)
print("streams", results["streams"], file=sys.stderr, flush=True)
print(json.dumps(results, indent=2))
PY
log "bench: $(wc -c < "$OUT/bench.json") bytes"
