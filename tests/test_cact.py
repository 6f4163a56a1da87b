"""The .cact v3 container: reader on the independent fixture, writer, CQ codec, synthetic models.

Spec sections: §2 (shipped geometry), §3 (FWHT), §5 (CQ), §8 (container), §14 (appendices).
"""

import struct

import numpy as np
import pytest

from needle_wgpu.formats import cact
from needle_wgpu.formats.cact_writer import (Record, blob_offsets, canon_slots, pack_container, records_of,
                                             rewrite_cact, write_cact)
from needle_wgpu.formats.cq_codec import (LLOYD_MAX_CODEBOOK, cq_decode, cq_decode_tensor, cq_encode, fwht,
                                          levels_for, nearest_level, pack_codes, unpack_codes)
from needle_wgpu.cli.synth import synth_main
from needle_wgpu.synth import GEOMETRIES, hada_permutations, synthesize, synthesize_records

TINY_FIXTURE_BYTES = 573_104


@pytest.fixture(scope="module")
def fixture_bytes(fixture_dir) -> bytes:
    return (fixture_dir / "tiny.cact").read_bytes()


@pytest.fixture(scope="module")
def synthetic_tiny() -> bytes:
    return synthesize("tiny", seed=5)


def directory(data: bytes) -> list:
    """Raw directory records (§8), independent of the reader."""
    num_tensors, codebook_len = struct.unpack_from("<II", data, 4)
    at = 196 + 4 * codebook_len
    return [struct.unpack_from("<BBHIIIIQQII", data, at + 44 * i) for i in range(num_tensors)]


def hadamard(size: int) -> np.ndarray:
    """Hn straight from its definition (§3): (-1)^popcount(m & k) / sqrt(size), in float64."""
    m, k = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    signs = np.vectorize(lambda v: bin(v).count("1") % 2)(m & k)
    return np.where(signs, -1.0, 1.0) / np.sqrt(size)


# ----------------------------------------------------------------------------------- reader on the fixture


def test_fixture_geometry_matches_readme(fixture_bytes):
    f = cact.load(fixture_bytes)
    assert len(fixture_bytes) == TINY_FIXTURE_BYTES == f.file_size
    assert f.geometry == GEOMETRIES["tiny"]
    g = f.geometry
    assert (g.kron_a, g.kron_b) == (16, 16)  # README: Kronecker 16 x 16
    assert g.engram_heads == 2 and g.num_engram_tables == 4


def test_fixture_records_and_shapes(fixture_bytes):
    f = cact.load(fixture_bytes)
    assert struct.unpack_from("<I", fixture_bytes, 4)[0] == 130
    assert len(f.tensors) == 129 and f.head_codes == ()  # 129 tensors + the tokenizer
    assert f["embedding"].shape == (512, 256)
    assert f.layer(0, "q_proj").shape == (128, 256)
    assert f.layer(3, "out_proj").shape == (256, 256)
    assert f.layer(2, "cond_v").shape == (256, 8)
    assert f["mhc.phi_res"].shape == (4 * 16, 4 * 256)
    assert f["engram.1.tables"].shape == (4 * 257, 64)
    assert f["final_norm"].index == 128
    # README: embedding and mHC phi 4-bit, every other CQ tensor 2-bit, all at group 128.
    for t in f.tensors.values():
        if t.is_cq:
            want = 4 if t.name == "embedding" or t.name.startswith("mhc.phi") else 2
            assert (t.bits, t.group) == (want, 128), t.name
    n_pieces = struct.unpack_from("<I", f.tokenizer, 0)[0]
    assert n_pieces == 512


def test_fixture_layout_follows_writer_checklist(fixture_bytes):
    records = directory(fixture_bytes)
    first = cact.align(308 + 44 * len(records))
    assert records[0][7] == first == 6080
    pos = 308 + 44 * len(records)
    for i, record in enumerate(records):
        offset, nbytes = record[7], record[8]
        assert offset == cact.align(pos), i
        assert not any(fixture_bytes[pos:offset]), f"gap before record {i} is not zero"
        pos = offset + nbytes
    assert pos == len(fixture_bytes)


# ----------------------------------------------------------------------------------- writer


def test_rewrite_reproduces_fixture_byte_for_byte(fixture_bytes):
    assert rewrite_cact(cact.load(fixture_bytes)) == fixture_bytes


def test_synthetic_write_read_write_is_identical(synthetic_tiny):
    f = cact.load(synthetic_tiny)
    assert rewrite_cact(f) == synthetic_tiny
    again = rewrite_cact(cact.load(rewrite_cact(f)))
    assert again == synthetic_tiny


def test_synthetic_tiny_without_heads_has_the_fixture_directory(fixture_bytes):
    # Same geometry, same bit scheme and a tokenizer of the same vocabulary: every record's
    # dtype, shape, group and bits must agree with the independent writer's, and every offset
    # except those after the tokenizer (whose length may differ) too.
    ours = directory(synthesize("tiny", seed=1, heads=False))
    theirs = directory(fixture_bytes)
    assert len(ours) == len(theirs) == 130
    for i, (a, b) in enumerate(zip(ours, theirs)):
        dtype_a, ndim_a, _, *rest_a = a
        dtype_b, ndim_b, _, *rest_b = b
        assert (dtype_a, ndim_a) == (dtype_b, ndim_b), i
        if dtype_a != cact.RAW:
            assert rest_a == rest_b, i


def test_writer_refuses_records_out_of_canon_order(synthetic_tiny):
    g = cact.load(synthetic_tiny).geometry
    records = records_of(cact.load(synthetic_tiny))
    swapped = records[:1] + [records[2], records[1]] + records[3:]
    with pytest.raises(ValueError, match="canon"):
        write_cact(g, swapped)
    bad_shape = list(records)
    bad_shape[1] = Record.fp16("layers.0.norm_in", np.zeros(128))
    with pytest.raises(ValueError, match="layers.0.norm_in"):
        write_cact(g, bad_shape)
    two_raw = records + [Record.raw("tokenizer", b"x")]
    with pytest.raises(ValueError, match="RAW"):
        write_cact(g, two_raw)


def test_blob_offsets_align_and_pack_zero_fills():
    offsets, total = blob_offsets(28, [3, 64, 1])
    first = cact.align(308 + 3 * 44)
    assert offsets == [first, first + 64, first + 128] and total == first + 129
    g = GEOMETRIES["tiny"]
    data = pack_container(g.header_words(3), LLOYD_MAX_CODEBOOK,
                          [Record.raw("a", b"\xff" * 3), Record.raw("b", b"\xee" * 64), Record.raw("c", b"\xdd")])
    assert len(data) == total
    assert data[first : first + 3] == b"\xff" * 3 and not any(data[first + 3 : first + 64])
    assert data[-1:] == b"\xdd"


# ----------------------------------------------------------------------------------- CQ codec


def test_codebook_matches_appendix_14_1(fixture_bytes):
    cb = np.array(LLOYD_MAX_CODEBOOK, dtype=np.float32)
    assert cb.shape == (28,)
    for lo, hi in ((0, 4), (4, 12), (12, 28)):
        assert np.all(np.diff(cb[lo:hi]) > 0)
    # §14.1 prints the scaled 2-bit levels to 8 digits.
    np.testing.assert_allclose(cb[:4], [-0.13317214, -0.039902091, 0.040035281, 0.13346045], rtol=2e-7)
    # The fixture's writer derived the same levels; they may differ in the last bit (§13).
    fixture_cb = np.array(cact.load(fixture_bytes).codebook, dtype=np.float32)
    np.testing.assert_allclose(cb, fixture_cb, rtol=3e-7, atol=0)


def test_fwht_is_the_normalised_hadamard():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    np.testing.assert_allclose(fwht(x), x @ hadamard(16), atol=1e-5)
    np.testing.assert_allclose(fwht(fwht(x)), x, atol=1e-5)  # involutory
    with pytest.raises(ValueError):
        fwht(np.zeros(12))


def test_decode_hand_built_2bit_blob():
    # One row, 7 columns, group 8, levels [-3, -1, 1, 3] (hand-chosen, not a codebook).
    # Codes 0 1 2 3 3 2 1 0 packed LSB-first: 0b11_10_01_00 = 0xE4, 0b00_01_10_11 = 0x1B.
    # Norm 2.0 is FP16 0x4000. u = level * norm = [-6 -2 2 6 6 2 -2 -6]; its Hadamard
    # coefficients are 0 except k = 5 (-16) and k = 6 (-32), divided by sqrt(8).
    blob = bytes([0xE4, 0x1B]) + struct.pack("<e", 2.0)
    w = cq_decode(blob, rows=1, cols=7, bits=2, group=8, levels=[-3.0, -1.0, 1.0, 3.0])
    want = np.array([[0, 0, 0, 0, 0, -16, -32]]) / np.sqrt(8)
    assert w.shape == (1, 7) and w.dtype == np.float32
    np.testing.assert_allclose(w, want, atol=1e-5)


@pytest.mark.parametrize("bits, packed, codes", [
    (2, [0xE4], [0, 1, 2, 3]),
    (4, [0x21, 0x43], [1, 2, 3, 4]),  # low nibble first
    # 3-bit: 8 indices in 3 bytes, fields straddle bytes: 1|2<<3|...|7<<18 = 0x1F58D1.
    (3, [0xD1, 0x58, 0x1F], [1, 2, 3, 4, 5, 6, 7, 0]),
])
def test_unpack_hand_packed_codes(bits, packed, codes):
    # pack_codes/unpack_codes work on rows of 8 indices; pad the hand rows with zeros.
    row = np.zeros(bits, dtype=np.uint8)
    row[: len(packed)] = packed
    got = unpack_codes(row[None, :], bits)[0]
    assert list(got[: len(codes)]) == codes and not got[len(codes):].any()
    assert pack_codes(got[None, :], bits)[0].tolist() == row.tolist()


def test_decode_every_width_against_the_definition():
    # Hand-picked codes; the expected matrix is (level[code] * norm) @ Hn built from §3's formula.
    rng = np.random.default_rng(3)
    for bits in (2, 3, 4, 5):
        levels = levels_for(bits)
        codes = rng.integers(0, 4 if bits in (2, 5) else 1 << bits, size=(3, 16)).astype(np.uint8)
        if bits == 5:
            codes[codes == 2] = 3  # crumb 2 is invalid; keep the valid crumbs 0, 1, 3
        norms = np.array([[1.5, 0.25], [2.0, 1.0], [0.5, 3.0]], dtype=np.float16)
        blob = pack_codes(codes, bits).tobytes() + norms.astype("<f2").tobytes()
        value_of_code = {0: levels[1], 1: levels[2], 3: levels[0]} if bits == 5 else dict(enumerate(levels))
        u = np.vectorize(lambda c: float(value_of_code[c]))(codes).reshape(3, 2, 8)
        want = ((u * norms.astype(np.float64)[..., None]) @ hadamard(8)).reshape(3, 16)[:, :13]
        got = cq_decode(blob, 3, 13, bits, 8, levels)
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"bits={bits}")


def test_ternary_crumbs_and_levels():
    c = np.float32(1.2240064) / np.float32(np.sqrt(128))
    np.testing.assert_array_equal(levels_for(5), [-c, 0, c])
    # Crumbs 3, 0, 1, 2 read as -c, 0, +c and (invalid) 0, times norm 1, before the FWHT.
    blob = bytes([0b10_01_00_11]) + bytes(31) + struct.pack("<e", 1.0)
    w = cq_decode(blob, 1, 128, 5, 128, levels_for(5))
    u = fwht(w)  # Hn is its own inverse: recover level * norm
    np.testing.assert_allclose(u[0, :4], [-c, 0, c, 0], atol=1e-7)
    np.testing.assert_allclose(u[0, 4:], 0, atol=1e-7)


def test_nearest_level_ties_go_to_the_lower_index():
    levels = np.array([-1.0, 0.0, 1.0], dtype=np.float32)
    x = np.array([-5, -0.5, -0.25, 0.5, 0.75, 5], dtype=np.float32)
    assert nearest_level(x, levels).tolist() == [0, 0, 1, 1, 2, 2]


# Relative Frobenius error of a Gaussian matrix. Each unit group vector times sqrt(128) has
# roughly N(0, 1) coordinates, so the error is close to sqrt(D) of the Lloyd-Max quantiser:
# D = 0.1175 (2-bit), 0.03454 (3-bit), 0.009497 (4-bit), 0.1902 (ternary, threshold 0.612).
@pytest.mark.parametrize("bits, low, high", [(2, 0.325, 0.36), (3, 0.175, 0.195), (4, 0.09, 0.103),
                                             (5, 0.42, 0.45)])
def test_gaussian_encode_error_is_lloyd_max(bits, low, high):
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((256, 384)).astype(np.float32)
    blob = cq_encode(w, bits, 128, levels_for(bits))
    assert len(blob) == cact.cq_blob_bytes(256, 384, 128, bits)
    error = np.linalg.norm(cq_decode(blob, 256, 384, bits, 128, levels_for(bits)) - w) / np.linalg.norm(w)
    assert low < error < high


def test_encode_pads_columns_and_stores_fp16_norms():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 200)).astype(np.float32)
    blob = cq_encode(w, 2, 128, levels_for(2))
    rows_bytes = 5 * 256 * 2 // 8
    norms = np.frombuffer(blob[rows_bytes:], dtype="<f2").reshape(5, 2)
    padded = np.zeros((5, 256), dtype=np.float64)
    padded[:, :200] = w
    want = np.linalg.norm(padded.reshape(5, 2, 128), axis=-1)  # Hn is orthogonal
    np.testing.assert_array_equal(norms, want.astype(np.float16))
    assert cq_decode(blob, 5, 200, 2, 128, levels_for(2)).shape == (5, 200)


def test_reencoding_the_fixture_reproduces_its_codes(fixture_bytes):
    # Decoding then encoding must land on the same level per element (the norms shrink, §5.4
    # NOTE, so only the codes are compared). This ties our decoder and encoder to the
    # independent writer's layout, bit order and Hadamard convention.
    f = cact.load(fixture_bytes)
    for name in ("embedding", "layers.0.q_proj", "mhc.phi_res", "engram.0.tables"):
        t = f[name]
        blob = cq_encode(cq_decode_tensor(t, f.codebook), t.bits, t.group, levels_for(t.bits, f.codebook))
        assert blob[: len(t.codes)] == bytes(t.codes), name


# ----------------------------------------------------------------------------------- synthetic models


def test_synthesis_is_deterministic_per_seed(synthetic_tiny):
    assert synthesize("tiny", seed=5) == synthetic_tiny
    assert synthesize("tiny", seed=6) != synthetic_tiny


def test_synthetic_tiny_layout_and_values(synthetic_tiny):
    f = cact.load(synthetic_tiny)
    assert f.head_codes == (2,) and len(f.tensors) == 129 + 7
    assert f["heads.0.probes"].shape == (5 * 4, 256) and f["heads.0.probes"].bits == 4
    assert f["heads.0.row_bias"].shape == (4, 5, 4)
    assert f["heads.0.proj"].shape == (1, 4 * 256)

    def fp(name):
        t = f[name]
        return np.frombuffer(t.data, dtype="<f2" if t.dtype == cact.FP16 else "<f4").reshape(t.shape)

    p1, p2 = hada_permutations(256)
    assert sorted(fp("hada.p1")) == list(range(256)) and np.array_equal(fp("hada.p1"), p1)
    assert np.array_equal(fp("hada.p2"), np.random.RandomState(13).permutation(256))
    np.testing.assert_allclose(fp("mhc.a_pre"), 0.01, atol=0.01)
    np.testing.assert_allclose(fp("mhc.b_res"), 4 * np.eye(4)[None].repeat(4, 0), atol=0.5)
    taps = fp("layers.0.q_taps").astype(np.float32)
    assert abs(taps[0].mean() - 1) < 0.05 and abs(taps[1:]).mean() < 0.2
    for bits_of in (f["embedding"], f["mhc.phi_pre"]):
        assert bits_of.bits == 4
    assert f.layer(0, "gate_proj").bits == 2 and f["engram.0.key_proj"].bits == 2


def test_synthetic_embedding_scale(synthetic_tiny):
    # Tied head (§4.8): logits E . x_f with x_f unit-RMS times (1 + final_norm) must spread.
    f = cact.load(synthetic_tiny)
    e = cq_decode_tensor(f["embedding"], f.codebook)
    row_norm = np.linalg.norm(e, axis=1).mean()
    assert 0.2 < row_norm < 0.4
    gain = 1 + np.frombuffer(f["final_norm"].data, dtype="<f2").astype(np.float32).mean()
    assert 0.6 < row_norm * gain < 1.5  # the logit standard deviation across the vocabulary


def test_small_geometry_is_valid_and_loads():
    g = GEOMETRIES["small"]
    g.validate()
    assert (g.kron_a, g.kron_b) == (16, 32) and g.engram_heads == 3
    f = cact.load(synthesize("small", seed=0))
    assert f.geometry == g and f.head_codes == (2,)


def test_hada_permutations_match_appendix_14_2():
    p1, p2 = hada_permutations(1024)
    assert p1.dtype == np.float32
    assert p1[:16].tolist() == [177, 777, 1006, 410, 709, 670, 932, 538, 265, 911, 658, 944, 66, 643, 519, 769]
    assert p2[:16].tolist() == [1013, 559, 1010, 70, 681, 0, 899, 702, 688, 380, 273, 556, 519, 569, 381, 304]


def test_synth_cli(tmp_path, capsys):
    out = tmp_path / "m.cact"
    assert synth_main(["--geometry", "tiny", "--seed", "5", "-o", str(out)]) == 0
    assert out.read_bytes() == synthesize("tiny", seed=5)
    assert synth_main(["--geometry", "huge", "-o", str(out)]) == 2
    assert synth_main(["--geometry", "tiny", "-o", str(tmp_path / "missing" / "m.cact")]) == 1
    assert "needle-wgpu synth" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- shipped layout (§2, §8, §14.4)

SHIPPED_CQ_BYTES = {
    "embedding": 3_244_032, "q_proj": 117_504, "k_proj": 19_584, "v_proj": 26_112,
    "gate_proj": 156_672, "out_proj": 156_672, "mhc.phi_pre": 126_720, "mhc.phi_post": 126_720,
    "mhc.phi_res": 506_880, "tables": 3_760_128, "key_proj": 156_672, "value_proj": 156_672,
    "heads.0.probes": 33_264,
}


def _short_name(name: str) -> str:
    return name.split(".")[-1] if name.startswith(("layers.", "engram.")) else name


def _shipped_bits(name: str) -> int:
    """§2: embedding, mHC phi and probe-head matrices 4-bit, everything else 2-bit."""
    return 4 if name == "embedding" or name.startswith(("mhc.phi", "heads.")) else 2


# Shapes the canon leaves open: the cond rank (8, §4.6) and the confidence head (§7).
SHIPPED_OPEN_SHAPES = {"heads.0.probes": (84, 768), "heads.0.gain": (21, 4), "heads.0.query": (4, 768),
                       "heads.0.row_bias": (4, 21, 4), "heads.0.proj": (1, 3072)}


def test_shipped_canon_sizes_without_weights():
    g = GEOMETRIES["shipped"]
    slots = canon_slots(g, head_codes=(2,))
    assert len(slots) + 1 == 581
    sizes, layer0_fp16 = [], 0
    for name, dtype, shape in slots:
        shape = SHIPPED_OPEN_SHAPES.get(name, tuple(8 if s is None else s for s in shape))
        if dtype == cact.CQ:
            nbytes = cact.cq_blob_bytes(*shape, 128, _shipped_bits(name))
            if _short_name(name) in SHIPPED_CQ_BYTES:
                assert nbytes == SHIPPED_CQ_BYTES[_short_name(name)], name
        else:
            nbytes = int(np.prod(shape)) * (2 if dtype == cact.FP16 else 4)
        if name.startswith("layers.0.") and dtype == cact.FP16:
            layer0_fp16 += nbytes
        sizes.append(nbytes)
    assert layer0_fp16 == 60_802  # "about 60.8 KB" of FP16 vectors per layer (§14.4)
    offsets, total = blob_offsets(28, sizes + [109_140])
    assert offsets[0] == 25_920
    assert offsets[-1] == 35_226_240 and total == 35_335_380


@pytest.mark.slow
def test_shipped_synthesis_layout():
    g, records = synthesize_records("shipped", seed=0)
    assert len(records) == 581
    counts = {dtype: sum(r.dtype == dtype for r in records) for dtype in (cact.CQ, cact.FP16, cact.FP32, cact.RAW)}
    assert counts == {cact.CQ: 122, cact.FP16: 456, cact.FP32: 2, cact.RAW: 1}
    for r in records:
        if _short_name(r.name) in SHIPPED_CQ_BYTES:
            assert len(r.blob) == SHIPPED_CQ_BYTES[_short_name(r.name)], r.name
    assert sum(len(r.blob) for r in records if r.name.startswith("layers.0.") and r.dtype == cact.FP16) == 60_802
    sizes = [len(r.blob) for r in records[:-1]] + [109_140]
    offsets, total = blob_offsets(28, sizes)
    assert offsets[0] == 25_920 and total == 35_335_380

    data = write_cact(g, records)
    f = cact.load(data)
    assert f.geometry == g and f.head_codes == (2,) and len(f.tensors) == 580
    assert directory(data)[0][7] == 25_920
    assert len(data) == 35_335_380 - 109_140 + len(records[-1].blob)
