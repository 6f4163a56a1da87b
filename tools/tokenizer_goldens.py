"""Write tests/data/tokenizer_golden.json: llama.cpp's token ids (via PyPI ``xllamacpp``) for
every string of tests/data/tokenizer_corpus.json, for SmolLM2 and Gemma-3-270M (spec §6), in
each mode of ``gguf_tokenizer_files.MODES``. The tokenizer tests compare against this file, so
they check llama.cpp's ids even where xllamacpp is not installed.

    python3 tools/tokenizer_goldens.py
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import gguf_tokenizer_files as files  # noqa: E402


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main() -> int:
    import xllamacpp._version

    strings = files.corpus()
    golden = {"about": "tools/tokenizer_goldens.py",
              "xllamacpp": xllamacpp._version.get_versions()["version"],
              "corpus_size": len(strings), "models": {}}
    for name, find in files.MODELS.items():
        path = find()
        if path is None:
            print(f"{name}: model file not found", file=sys.stderr)
            return 1
        oracle = files.LlamaCppTokenizer(path)
        try:
            golden["models"][name] = {"file": path.name, "sha256": _sha256(path),
                                      **files.golden_ids(oracle, strings)}
        finally:
            oracle.close()
    with open(files.GOLDEN, "w", encoding="utf-8") as f:
        f.write('{\n')
        head = {k: v for k, v in golden.items() if k != "models"}
        for key, value in head.items():
            f.write(f"{json.dumps(key)}: {json.dumps(value)},\n")
        f.write('"models": {\n')
        for m, (name, entry) in enumerate(golden["models"].items()):
            f.write(f"{json.dumps(name)}: {{\n")
            f.write(f'"file": {json.dumps(entry["file"])}, '
                    f'"sha256": {json.dumps(entry["sha256"])},\n')
            for k, mode in enumerate(files.MODES):
                rows = ",\n".join(json.dumps(ids) for ids in entry[mode])
                comma = "," if k < len(files.MODES) - 1 else ""
                f.write(f"{json.dumps(mode)}: [\n{rows}\n]{comma}\n")
            f.write("}" + ("," if m < len(golden["models"]) - 1 else "") + "\n")
        f.write("}\n}\n")
    print(f"wrote {files.GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
