"""Non-finite weights (NaN, ±inf in FP16 tensors or CQ norms) are found at load and reported
(``CactFile.nonfinite`` / ``warnings``, ``needle-wgpu info``); requests then refuse to run."""

import json
import struct
import time

import pytest

from needle_wgpu.cli import main
from needle_wgpu.errors import ContainerError, NeedleError, NonFiniteWeightsError
from needle_wgpu.formats import cact
from needle_wgpu.synth import synthesize

VALID = synthesize("tiny", seed=0)
HALF_NAN, HALF_INF, HALF_NEG_INF, HALF_MAX = 0x7E00, 0x7C00, 0xFC00, 0x7BFF


def with_halves(edits) -> bytes:
    """VALID with FP16 values replaced: edits = [(tensor, "data" or "norms", index, half bits)]."""
    container = cact.load(VALID)
    out = bytearray(VALID)
    for name, part, index, bits in edits:
        t = container[name]
        at = t.offset + (t.rows * t.row_bytes if part == "norms" else 0) + 2 * index
        struct.pack_into("<H", out, at, bits)
    return bytes(out)


def test_a_sound_file_has_no_warnings():
    container = cact.load(VALID)
    assert container.nonfinite == () and container.warnings == []


def test_every_non_finite_half_is_counted_per_tensor():
    data = with_halves([("layers.0.norm_in", "data", 0, HALF_NAN), ("layers.0.norm_in", "data", 5, HALF_INF),
                        ("embedding", "norms", 3, HALF_NEG_INF), ("final_norm", "data", 1, HALF_MAX),
                        ("heads.0.row_bias", "data", 2, 0xFFFF)])
    container = cact.load(data)  # the file still loads: it is well formed
    assert dict(container.nonfinite) == {"layers.0.norm_in": 2, "embedding": 1, "heads.0.row_bias": 1}
    (warning,) = container.warnings
    assert warning.startswith("weights: 4 NaN or infinite FP16 values in ") and "layers.0.norm_in (2)" in warning


def test_the_count_is_exact_for_every_half_value():
    every = struct.pack("<65536H", *range(65536))
    expected = sum(1 for h in range(65536) if (h >> 10) & 0x1F == 0x1F)
    assert cact.count_nonfinite_halves(memoryview(every)) == expected == 2048
    # Odd starting offsets (CQ norms after 3-bit codes) read the right high bytes.
    assert cact.count_nonfinite_halves(memoryview(b"\x00" + every)[1:]) == expected


def test_the_scan_is_linear_and_cheap():
    data = synthesize("small", seed=0)
    started = time.perf_counter()
    cact.load(data)
    assert time.perf_counter() - started < 1.0


def test_info_reports_the_warning(tmp_path, capsys):
    path = tmp_path / "nan.cact"
    path.write_bytes(with_halves([("layers.1.q_norm", "data", 0, HALF_NAN)]))
    assert main(["info", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["warnings"] == ["weights: 1 NaN or infinite FP16 values in layers.1.q_norm (1)"]


def test_the_error_class_is_a_container_error():
    assert issubclass(NonFiniteWeightsError, ContainerError) and issubclass(NonFiniteWeightsError, NeedleError)
