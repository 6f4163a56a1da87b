"""Seeded synthetic Needle 3 models, written as real ``.cact`` v3 containers (spec §2, §8).

The weights are random but scaled so that a forward pass stays O(1) through every layer and
the logits have a real spread: unit-RMS projections, near-identity convolution taps, norm
offsets near 0 (except the final norm, see ``FINAL_NORM_OFFSET``), orthogonal Kronecker
factors, and mHC parameters near the upstream initialisation (§4.7 note), where lane mixing is
almost the identity and each block adds a bounded delta. The bit scheme is the shipped one
(§2): embedding, mHC phi and probe heads CQ-4, every other CQ tensor CQ-2, group 128.

``synthesize("tiny", seed)`` has the geometry of the independent fixture
(``tests/fixtures/needle3/README.md``), ``"small"`` is sized for GPU tests, and
``"shipped"`` is exactly §2 (581 records with the confidence head and the tokenizer).
A seed fixes the file byte for byte on a given NumPy build (NumPy's random streams and BLAS
do not promise identical low-order bits across builds).
"""

from __future__ import annotations

import numpy as np

from .formats.cact_writer import Record, write_cact
from .formats.needle3_geometry import Needle3Geometry
from .formats.needle3_tokenizer import synthetic_tokenizer_blob
from .sampling import saturate_seed

GROUP = 128
EMBEDDING_BITS = MHC_BITS = HEAD_BITS = 4
DEFAULT_BITS = 2
CONFIDENCE_HEAD = 2.0  # manifest code (§7)
PROBES_PER_CELL = 4
HEAD_QUERIES = 4
COND_RANK = 8

# Scales that shape the residual stream. The head is the tied embedding (§4.8), so the logit
# spread is |E row| * (1 + final_norm) while x0 = E[t] * sqrt(d) has RMS |E row|: a small
# embedding (x0 RMS 0.3) with a final gain of 3 keeps the logits ~N(0, 1) without the current
# token's own row dominating them. Blocks add deltas of RMS ~1.7 (attention through
# sigmoid(1) ~ 0.73, the MLP through d4 ~ 3), so the lanes grow to RMS ~2 over 20 layers.
EMBEDDING_ROW_NORM = 0.3
FINAL_NORM_OFFSET = 2.0
ATTN_GATE_LOGIT = 1.0
MLP_OUT_GAIN = 3.0

GEOMETRIES = {
    # The fixture's geometry (fixtures/needle3/README.md).
    "tiny": Needle3Geometry(
        vocab=512, out_vocab=512, d_model=256, num_heads=4, num_kv_heads=2, num_layers=4,
        qk_head_dim=32, v_head_dim=64, max_seq_len=256, hada_n=256, mhc_lanes=4,
        sliding_window=16, global_layers=(2,), qkv_conv_taps=3, engram_slots=257,
        engram_sub_dim=64, num_engram_tables=4, engram_conv_taps=4, engram_conv_dilation=3,
        engram_seed_heads=0, engram_orders=(2, 3), engram_sites=(1, 3), rope_theta=10000.0,
        kv_window=8, kv_bits=8),
    # Between tiny and shipped, for GPU tests: Kronecker 16 x 32 (ba != bb), 3 engram heads.
    "small": Needle3Geometry(
        vocab=1024, out_vocab=1024, d_model=384, num_heads=6, num_kv_heads=2, num_layers=6,
        qk_head_dim=32, v_head_dim=64, max_seq_len=512, hada_n=512, mhc_lanes=4,
        sliding_window=32, global_layers=(2, 5), qkv_conv_taps=3, engram_slots=1021,
        engram_sub_dim=64, num_engram_tables=6, engram_conv_taps=4, engram_conv_dilation=3,
        engram_seed_heads=0, engram_orders=(2, 3), engram_sites=(1, 3, 5), rope_theta=10000.0,
        kv_window=16, kv_bits=8),
    # §2, read from the real needle3.cact header.
    "shipped": Needle3Geometry(
        vocab=8192, out_vocab=8192, d_model=768, num_heads=12, num_kv_heads=2, num_layers=20,
        qk_head_dim=48, v_head_dim=64, max_seq_len=8192, hada_n=1024, mhc_lanes=4,
        sliding_window=1024, global_layers=(4, 9, 14, 19), qkv_conv_taps=3, engram_slots=18432,
        engram_sub_dim=128, num_engram_tables=6, engram_conv_taps=4, engram_conv_dilation=3,
        engram_seed_heads=0, engram_orders=(2, 3), engram_sites=(3, 7, 11, 15, 19),
        rope_theta=100000.0, kv_window=256, kv_bits=8),
}


def geometry_named(geometry) -> Needle3Geometry:
    """A preset name ("tiny", "small", "shipped") or a geometry, validated."""
    if isinstance(geometry, str):
        if geometry not in GEOMETRIES:
            raise ValueError(f"unknown geometry {geometry!r} (choose from {', '.join(GEOMETRIES)})")
        geometry = GEOMETRIES[geometry]
    geometry.validate()
    return geometry


class _Draws:
    """The seeded random source; every tensor is drawn in canon order, so a seed fixes a file."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(saturate_seed(seed))  # any number: the sampling seed rule

    def normal(self, shape, std: float, mean: float = 0.0) -> np.ndarray:
        values = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        return values + np.float32(mean) if mean else values

    def taps(self, taps: int, width: int) -> np.ndarray:
        """Causal conv taps near identity: tap 0 (the current position) ~1, older taps small."""
        values = self.normal((taps, width), 0.1)
        values[0] += 1.0
        return values

    def orthogonal(self, size: int) -> np.ndarray:
        """A random orthogonal matrix plus a little noise: a Kronecker stage keeps the norm."""
        q, r = np.linalg.qr(self.rng.standard_normal((size, size)))
        q *= np.sign(np.diag(r))
        return q.astype(np.float32) + self.normal((size, size), 0.02 / np.sqrt(size))


def _cq(name: str, matrix: np.ndarray, bits: int = DEFAULT_BITS) -> Record:
    return Record.cq(name, matrix, bits, GROUP)


def _layer_records(g: Needle3Geometry, i: int, draw: _Draws) -> list:
    """One block's records in the order of ``cact.layer_canon`` (§8)."""
    d, prefix = g.d_model, f"layers.{i}."
    unit = 1.0 / np.sqrt(d)  # rows of unit norm: a projection of a unit-RMS vector is unit-RMS
    records = [
        Record.fp16(prefix + "norm_in", draw.normal(d, 0.05)),
        _cq(prefix + "q_proj", draw.normal((g.q_dim, d), unit)),
        _cq(prefix + "k_proj", draw.normal((g.k_dim, d), unit)),
        _cq(prefix + "v_proj", draw.normal((g.v_dim, d), unit)),
    ]
    if g.qkv_conv_taps:
        records += [
            Record.fp16(prefix + "q_taps", draw.taps(g.qkv_conv_taps, g.q_dim)),
            Record.fp16(prefix + "k_taps", draw.taps(g.qkv_conv_taps, g.k_dim)),
            Record.fp16(prefix + "v_taps", draw.taps(g.qkv_conv_taps, g.v_dim)),
        ]
    records += [
        Record.fp16(prefix + "q_norm", draw.normal(g.qk_head_dim, 0.05)),
        Record.fp16(prefix + "k_norm", draw.normal(g.qk_head_dim, 0.05)),
        _cq(prefix + "gate_proj", draw.normal((g.attn_out, d), unit)),
        _cq(prefix + "out_proj", draw.normal((d, g.attn_out), 1.0 / np.sqrt(g.attn_out))),
        Record.fp16(prefix + "post_norm", draw.normal(d, 0.05)),
        Record.fp16(prefix + "attn_gate", draw.normal(1, 0.3, ATTN_GATE_LOGIT)),
        Record.fp16(prefix + "pre_hada", draw.normal(d, 0.05)),
    ]
    # HadaMLP (§4.6): diagonal scales near 1 (d4 sets the output gain), a small bias,
    # orthogonal Kronecker factors (norm-preserving stages), a weak cond.
    for name, center in (("d1", 1.0), ("d2", 1.0), ("b2", 0.0), ("d3", 1.0), ("d4", MLP_OUT_GAIN)):
        records.append(Record.fp16(prefix + name, draw.normal(g.hada_n, 0.05, center)))
    for stage in (1, 2, 3):
        records += [
            Record.fp16(prefix + f"w{stage}a", draw.orthogonal(g.kron_a)),
            Record.fp16(prefix + f"w{stage}b", draw.orthogonal(g.kron_b)),
        ]
    records += [
        Record.fp16(prefix + "cond_v", draw.normal((d, COND_RANK), unit)),
        Record.fp16(prefix + "cond_u", draw.normal((COND_RANK, g.hada_n), 0.1)),
    ]
    return records


def _mhc_records(g: Needle3Geometry, draw: _Draws) -> list:
    """mHC scalars near upstream init (§4.7 note) and the three phi matrices (§8 [541-549]).

    phi rows have norm 4, so a phi product of the unit-RMS lane vector is ~N(0, 16) and, times
    a_* ~ 0.01, moves the gate logits by ~0.16: visible, but the mixing stays near identity.
    """
    L, n, width = g.num_layers, g.mhc_lanes, g.mhc_width
    phi_std = 4.0 / np.sqrt(width)
    b_res = draw.normal((L, n, n), 0.1) + 4.0 * np.eye(n, dtype=np.float32)
    return [
        Record.fp16("mhc.a_pre", draw.normal(L, 0.002, 0.01)),
        Record.fp16("mhc.a_post", draw.normal(L, 0.002, 0.01)),
        Record.fp16("mhc.a_res", draw.normal(L, 0.002, 0.01)),
        Record.fp16("mhc.b_pre", draw.normal((L, n), 0.1)),
        Record.fp16("mhc.b_post", draw.normal((L, n), 0.1)),
        Record.fp16("mhc.b_res", b_res),
        _cq("mhc.phi_pre", draw.normal((L * n, width), phi_std), MHC_BITS),
        _cq("mhc.phi_post", draw.normal((L * n, width), phi_std), MHC_BITS),
        _cq("mhc.phi_res", draw.normal((L * n * n, width), phi_std), MHC_BITS),
    ]


def hada_permutations(hada_n: int) -> tuple:
    """p1 and p2 as upstream generates them (§8 [550-551], §14.2), as f32 arrays."""
    p1 = np.random.RandomState(11).permutation(hada_n).astype(np.float32)
    p2 = np.random.RandomState(13).permutation(hada_n).astype(np.float32)
    return p1, p2


def _engram_records(g: Needle3Geometry, draw: _Draws) -> list:
    """Per site: tables (row = tb * slots + idx), key/value projections [d, d], taps (§4.2)."""
    d, rows, width = g.d_model, g.num_engram_tables * g.engram_slots, g.num_engram_tables * g.engram_sub_dim
    records = []
    for s in range(len(g.engram_sites)):
        prefix = f"engram.{s}."
        records += [
            _cq(prefix + "tables", draw.normal((rows, g.engram_sub_dim), 1.0)),
            _cq(prefix + "key_proj", draw.normal((d, width), 1.0 / np.sqrt(width))),
            _cq(prefix + "value_proj", draw.normal((d, width), 1.0 / np.sqrt(width))),
            Record.fp16(prefix + "taps", draw.taps(g.engram_conv_taps, d)),
        ]
    return records


def _confidence_head_records(g: Needle3Geometry, draw: _Draws) -> list:
    """Manifest [2.0] and the six confidence-head tensors of §7, in order."""
    cells, d, k, q = g.num_layers + 1, g.d_model, PROBES_PER_CELL, HEAD_QUERIES
    return [
        Record.fp16("heads.manifest", [CONFIDENCE_HEAD]),
        # Unit-variance probes and queries: scores <cell, probe> / sqrt(d) are ~N(0, 1).
        _cq("heads.0.probes", draw.normal((cells * k, d), 1.0), HEAD_BITS),
        Record.fp16("heads.0.gain", draw.normal((cells, k), 0.1, 1.0)),
        _cq("heads.0.query", draw.normal((q, d), 1.0), HEAD_BITS),
        Record.fp16("heads.0.row_bias", draw.normal((q, cells, k), 0.1)),
        _cq("heads.0.proj", draw.normal((1, q * d), 1.0 / np.sqrt(q * d)), HEAD_BITS),
        Record.fp16("heads.0.bias", draw.normal(1, 0.1)),
    ]


def synthesize_records(geometry, seed: int, heads: bool = True) -> tuple:
    """(geometry, records) of a synthetic model, in canon order, tokenizer last (§8)."""
    g = geometry_named(geometry)
    draw = _Draws(seed)
    d = g.d_model
    records = [_cq("embedding", draw.normal((g.vocab, d), EMBEDDING_ROW_NORM / np.sqrt(d)), EMBEDDING_BITS)]
    for i in range(g.num_layers):
        records += _layer_records(g, i, draw)
    records += _mhc_records(g, draw)
    p1, p2 = hada_permutations(g.hada_n)
    records += [Record.fp32("hada.p1", p1), Record.fp32("hada.p2", p2)]
    records += _engram_records(g, draw)
    records.append(Record.fp16("final_norm", draw.normal(d, 0.05, FINAL_NORM_OFFSET)))
    if heads:
        records += _confidence_head_records(g, draw)
    records.append(Record.raw("tokenizer", synthetic_tokenizer_blob(g.vocab)))
    return g, records


def synthesize(geometry, seed: int, heads: bool = True) -> bytes:
    """A seeded synthetic Needle 3 ``.cact`` v3 file (bytes); the same seed gives the same bytes."""
    g, records = synthesize_records(geometry, seed, heads)
    return write_cact(g, records)
