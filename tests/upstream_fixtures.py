"""The containers written by upstream's own exporter, with upstream's logits and head outputs
(../shared/fixtures/upstream/README.md): shared by the reference and the GPU tests."""

import json
from pathlib import Path

import numpy as np
import pytest

UPSTREAM = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "upstream"
NAMES = ("small", "small-allheads", "small-rung3")
SEQUENCES = ("len1", "len7", "len40", "len100")


def upstream_file(name: str) -> Path:
    path = UPSTREAM / f"{name}.cact"
    if not path.exists():
        pytest.skip(f"upstream fixtures not found at {UPSTREAM}")
    return path


def oracle(name: str) -> dict:
    upstream_file(name)
    with np.load(UPSTREAM / f"{name}.oracle.npz") as z:
        out = {key: z[key] for key in z.files}
    # Not every npz repeats the ids; FILE.ids.json always holds them.
    ids = json.loads((UPSTREAM / f"{name}.ids.json").read_text())
    for seq in SEQUENCES:
        if f"{seq}.ids" in out:
            assert out[f"{seq}.ids"].tolist() == ids[seq]
        out[f"{seq}.ids"] = np.array(ids[seq], dtype=np.int32)
    return out


def logit_error(got: np.ndarray, want: np.ndarray) -> tuple:
    """(max |Δ| / RMS(want), argmax mismatches) of two [T, rows] logit arrays."""
    rms = float(np.sqrt(np.mean(want.astype(np.float64) ** 2)))
    return float(np.max(np.abs(got - want)) / rms), int(np.sum(got.argmax(-1) != want.argmax(-1)))
