"""For the GGUF tokenizer tests: hand-made vocabularies, the real files of dense-gguf spec §6
and their metadata, and llama.cpp's tokenizer (PyPI ``xllamacpp``, spec §9) as the oracle, on
the real files and on tiny synthetic models written around a hand-made vocabulary. Shared by
tests/test_{bpe,spm}_tokenizer.py, tests/test_gguf_tokenizer_llama_cpp.py and
tools/tokenizer_goldens.py.

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

from needle_wgpu import default_model

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "tokenizer_corpus.json"
GOLDEN = ROOT / "tests" / "data" / "tokenizer_golden.json"
CACHE = default_model.cache_dir()

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"

# Golden modes: (add_special, parse_special) as llama.cpp's /tokenize takes them.
MODES = {"plain": (False, False), "special": (True, True)}

# GGUF token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def _byte_chars() -> list[str]:
    from needle_wgpu.formats.bpe_tokenizer import byte_to_unicode

    table = byte_to_unicode()
    return [table[b] for b in range(256)]


BYTE_CHARS = _byte_chars()


def bpe_metadata(merged=(), merges=(), specials=(), pre="gpt-2", **keys) -> dict:
    """A gpt2 vocabulary: the 256 byte characters, then ``merged`` tokens, then ``specials``
    given as (text, token_type); ``keys`` are further ``tokenizer.ggml.*`` values."""
    tokens = BYTE_CHARS + list(merged) + [text for text, _ in specials]
    types = [NORMAL] * (256 + len(merged)) + [kind for _, kind in specials]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(merges)}
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    metadata.update({"tokenizer.ggml." + k: v for k, v in keys.items()})
    return metadata


SPM_HEAD = [("<pad>", CONTROL, 0.0), ("<eos>", CONTROL, 0.0), ("<bos>", CONTROL, 0.0),
            ("<unk>", UNKNOWN, 0.0)]
SPM_BYTES = [(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)]


def spm_metadata(pieces, *, byte_tokens=True, **keys) -> dict:
    """A llama vocabulary: pad, eos, bos, unk, the 256 byte tokens, then ``pieces`` given as
    (text, token_type, score) or (text, score) for normal pieces."""
    rows = SPM_HEAD + (SPM_BYTES if byte_tokens else []) + [
        p if len(p) == 3 else (p[0], NORMAL, p[1]) for p in pieces]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                "tokenizer.ggml.tokens": [r[0] for r in rows],
                "tokenizer.ggml.token_type": [r[1] for r in rows],
                "tokenizer.ggml.scores": [r[2] for r in rows],
                "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
                "tokenizer.ggml.unknown_token_id": 3}
    metadata.update({"tokenizer.ggml." + k: v for k, v in keys.items()})
    return metadata


def write_synthetic_gguf(path: Path, metadata: dict) -> Path:
    """A one-layer llama model (d 32, random f32 weights) around ``metadata``'s vocabulary,
    for llama.cpp to load (spec §9); only its tokenizer matters here."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    n_vocab, d, ff, heads = len(metadata["tokenizer.ggml.tokens"]), 32, 64, 4
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(d // heads)
    writer.add_vocab_size(n_vocab)
    adders = {"model": writer.add_tokenizer_model, "pre": writer.add_tokenizer_pre,
              "tokens": writer.add_token_list, "token_type": writer.add_token_types,
              "scores": writer.add_token_scores,
              # llama.cpp refuses a gpt2 file without merges; an unusable one changes nothing
              "merges": lambda merges: writer.add_token_merges(merges or ["\u0100 \u0101"])}
    for key, value in metadata.items():
        name = key.removeprefix("tokenizer.ggml.")
        if name in adders:
            adders[name](value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (n_vocab, d), "blk.0.attn_q.weight": (d, d),
              "blk.0.attn_k.weight": (d, d), "blk.0.attn_v.weight": (d, d),
              "blk.0.attn_output.weight": (d, d), "blk.0.ffn_gate.weight": (ff, d),
              "blk.0.ffn_up.weight": (ff, d), "blk.0.ffn_down.weight": (d, ff)}
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, np.ones(d, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def corpus() -> list[str]:
    return json.loads(CORPUS.read_text(encoding="utf-8"))["strings"]


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct.Q4_1.gguf from $NEEDLE_SMOLLM2_GGUF, else the installed package."""
    return _named("NEEDLE_SMOLLM2_GGUF") or default_model.smollm2_path()


def gemma3_path() -> Path | None:
    """gemma-3-270m-q4_k_m.gguf from $NEEDLE_GEMMA3_GGUF, else the one setup.sh assembles."""
    return _named("NEEDLE_GEMMA3_GGUF") or default_model.gemma3_path()


def _named(variable: str) -> Path | None:
    path = Path(os.environ.get(variable) or "/nonexistent")
    return path if path.is_file() else None


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


def installed_tokenizer(path: Path | None, missing: str) -> tuple:
    """(path, the tokenizer its metadata builds) of an installed model file; skips the test
    with ``missing`` (how to install it) when there is none."""
    import pytest

    from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf

    if path is None:
        pytest.skip(missing)
    return path, tokenizer_from_gguf(tokenizer_metadata(path))


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
        params.warmup = False
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


def without_double_bos(tokenizer, ids: list[int], add_special: bool) -> list[int]:
    """llama.cpp adds BOS even before a BOS the text already has (and warns); spec §5.1 says
    such a prompt gets no second one, so that is the one place our ids differ."""
    bos = tokenizer.bos_token_id
    if add_special and tokenizer.add_bos and ids[:2] == [bos, bos]:
        return ids[1:]
    return ids


def golden_ids(oracle: LlamaCppTokenizer, strings: list[str]) -> dict:
    return {mode: [oracle.tokenize(s, add_special=a, parse_special=p) for s in strings]
            for mode, (a, p) in MODES.items()}


def committed_golden() -> dict:
    """llama.cpp's ids of the corpus for both models (tests/data, made by tools/tokenizer_goldens.py)."""
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def checked_corpus() -> list[str]:
    strings = corpus()
    assert len(strings) >= 300
    return strings


def mismatches(tokenizer, strings, expected, mode) -> list:
    """(string, llama.cpp's ids, ours) for every string whose ids differ in ``mode``."""
    add_special, parse_special = MODES[mode]
    return [(s, want, got) for s, want in zip(strings, expected)
            if (got := tokenizer.encode(s, add_special=add_special, parse_special=parse_special))
            != without_double_bos(tokenizer, want, add_special)]
