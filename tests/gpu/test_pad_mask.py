"""The heads' pass masks pad ids (0) inside the hidden cells as upstream's `hidden_cells` does
(§U a): attention keys at pads, q/k/v conv taps j >= 1 reading a pad, engram tables whose
n-gram starts at a pad and engram value-conv taps on a pad. Oracle: the reference's
``head_output(..., pad_masked=True)``; each case also checks that the mask changes the answer,
so a GPU that masked nothing would fail. The upstream fixture with all three heads:
tests/gpu/test_upstream.py, test_pad_positions_leave_the_gpu_probe_pools."""

import math

import numpy as np
import pytest

from needle_wgpu.engine import Needle3
from needle_wgpu.reference.needle3.heads import CONFIDENCE
from needle_wgpu.reference.needle3.model import ReferenceModel

pytestmark = pytest.mark.gpu


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_synthetic_confidence_masks_pads_across_chunks(device, tmp_path):
    from needle_wgpu.synth import synthesize

    path = tmp_path / "tiny-heads.cact"
    path.write_bytes(synthesize("tiny", 3))
    model, reference = Needle3.load(path, device=device), ReferenceModel.from_path(path)
    rng = np.random.default_rng(7)
    long_ids = [2] + rng.integers(4, reference.geometry.vocab, 90).tolist()
    for p in (3, 4, 30, 62, 63, 64, 65, 80):  # pads on both sides of the 64-position chunk edge
        long_ids[p] = 0
    # [0, ...]: position 0 sees only a pad key, so its attention is zeros (§U a)
    for ids in ([2, 17, 0, 40, 9, 0, 300, 12], [0, 5, 0, 7, 9, 11], long_ids):
        want = float(reference.head_output(CONFIDENCE, ids, pad_masked=True)[0])
        unmasked = float(reference.head_output(CONFIDENCE, ids)[0])
        assert abs(want - unmasked) > 1e-3  # the mask matters for this sequence
        assert abs(logit(model.confidence(ids)) - want) <= 1e-4 * max(1.0, abs(want)), (len(ids), want)
    free = [2, 17, 40, 9, 300, 12]  # no pad: the masked pass is the plain one
    assert abs(logit(model.confidence(free)) - reference.confidence_logit(free)) <= 1e-4
