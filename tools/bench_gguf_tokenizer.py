"""Construction time and encode speed of the GGUF tokenizers on the real files (spec §6), in
this interpreter. Prints one line per model; not a test.

    python3 tools/bench_gguf_tokenizer.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import gguf_tokenizer_files as files  # noqa: E402

from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402


def _text() -> str:
    """~200 KB of mixed text: the corpus, this repository's Python and Markdown."""
    parts = files.corpus()
    for pattern in ("needle_wgpu/**/*.py", "docs/*.md", "README.md"):
        parts += [p.read_text(encoding="utf-8") for p in sorted(ROOT.glob(pattern))]
    return "\n".join(parts)[:200_000]


def _best(f, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    text = _text()
    calibration = _best(lambda: sum(range(10_000_000)))
    print(f"calibration: sum(range(1e7)) {calibration * 1e3:.0f} ms "
          f"(~120 ms on an idle modern core)")
    for name, find in files.MODELS.items():
        path = find()
        if path is None:
            print(f"{name}: model file not found")
            continue
        metadata = files.tokenizer_metadata(path)
        build = _best(lambda: tokenizer_from_gguf(metadata))
        tokenizer = tokenizer_from_gguf(metadata)
        cold = time.perf_counter()
        n = len(tokenizer.encode(text))
        cold = time.perf_counter() - cold
        warm = _best(lambda: tokenizer.encode(text))
        decode = _best(lambda: tokenizer.decode(tokenizer.encode(text)))
        print(f"{name}: vocab {tokenizer.vocab_size}, build {build * 1e3:.0f} ms; "
              f"{len(text)} chars -> {n} tokens: first encode {n / cold:,.0f} tokens/s, "
              f"repeated {n / warm:,.0f} tokens/s; encode+decode {decode * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
