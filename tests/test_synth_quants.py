"""The test-time quantisers of `synth_quants` (Q2_K, Q3_K, IQ4_NL, IQ4_XS) write valid blocks:
`gguf.quants.dequantize` reads them back near the f32 original, and synth_gguf files of those
types hold them (spec dense-gguf.md §4.1, §9)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from needle_wgpu.formats.gguf_types import BY_NAME
from needle_wgpu.reference.dense import DenseReference
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf
from needle_wgpu.synth_quants import QUANTIZERS

# RMS error relative to the RMS of unit-normal weights: round-to-nearest on each grid (Q2_K's
# four levels per 16 weights are the coarsest; llama.cpp's own quantiser lands near 0.25).
ERROR = {"Q2_K": 0.4, "Q3_K": 0.22, "IQ4_NL": 0.11, "IQ4_XS": 0.11}


@pytest.mark.parametrize("qtype", list(QUANTIZERS))
def test_round_trip_through_gguf_dequantize(qtype):
    w = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    w[0] *= 0.0  # an all-zero row: scales of zero must not divide by zero
    raw = QUANTIZERS[qtype](w)
    t = BY_NAME[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (6, 512 // t.block_size * t.type_size)
    back = dequantize(raw, GGMLQuantizationType[qtype]).reshape(w.shape)
    assert np.all(back[0] == 0)
    error = np.sqrt(np.mean((back[1:] - w[1:]) ** 2))
    assert error <= ERROR[qtype], error


def test_synth_files_of_the_new_types(tmp_path):
    spec = SynthDense(arch="llama", d=256, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, qtype="Q3_K", n_layers=1)
    model = DenseReference(write_dense_gguf(tmp_path / "q3k.gguf", spec, tokenizer="bytes"))
    assert model.weights.qtype("blk.0.attn_q.weight") == "Q3_K"
    assert model.weights.qtype("blk.0.attn_norm.weight") == "F32"
    assert np.isfinite(model.next_logits([1, 2, 3])).all()
    with pytest.raises(ValueError, match="256-weight blocks"):
        SynthDense(qtype="IQ4_XS").resolved()  # d 64
