"""attention.wgsl's tiling at long positions (Needle 3 §4.5 item 8, §6 item 1; dense §3).

A cache of more than 256 slots is attended on a GPU in ranges of 256 whose partial softmaxes are
merged (flash-decoding; a CPU adapter's cache is one range: the cases ask for a GPU's ranges, one
for a single pass), a chunk's queries in tiles, a kv head's query heads in tiles when they do not
fit one workgroup. Against the NumPy reference at contexts up to 4,096: queries at the edges of
the blocks and ranges and chunks that straddle them, windows over a ring that wraps, every cache
mode, the gate and the pad mask; and each chunk row bit for bit equal to a decode step at its
position (the ranges follow the cache, never the chunk).
"""

import numpy as np
import pytest

from needle_wgpu.kernels import attention as ops
from needle_wgpu.kernels.attention import AttentionShape
from needle_wgpu.reference.dense_attention import kv_f16
from needle_wgpu.reference.needle3 import attention as ref
from needle_wgpu.reference.ops import quantize_rows, sigmoid

from .parity import F32, LONG_GATE, argmax_mismatches, fill_cache, rel, run_attention, upload

pytestmark = pytest.mark.gpu

# name: (shape, cache mode, context, pos0, T, pads, slots per range)
CASES = {
    "f32-global-4096": (AttentionShape(9, 3, 64, 64), "f32", 4096, 4096 - 64, 64, False, ops.SPLIT_KEYS),
    "f32-global-4096-one-pass": (AttentionShape(9, 3, 64, 64), "f32", 4096, 4096 - 64, 64, False, 4096),
    "f16-window-ring": (AttentionShape(9, 3, 64, 64, window=300), "f16", 4096, 3990, 16, False, ops.SPLIT_KEYS),
    "int8-gate-pads-edges": (AttentionShape(6, 2, 48, 64, gate=True), "int8", 1024, 250, 12, True, ops.SPLIT_KEYS),
    "head-tiles": (AttentionShape(32, 1, 256, 256, scale=1 / 16), "f32", 600, 509, 5, False, ops.SPLIT_KEYS),
    "odd-widths": (AttentionShape(3, 1, 11, 7, window=700), "f32", 1500, 1020, 8, False, ops.SPLIT_KEYS),
}


def entries_of(rng, shape, mode, n):
    """Random keys and values of n positions as the cache mode holds them (reference form)."""
    k = rng.normal(size=(n, shape.kv_heads, shape.qk_dim)).astype(F32)
    v = rng.normal(size=(n, shape.kv_heads, shape.v_dim)).astype(F32)
    if mode == "int8":
        (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
        return (k8, ks[..., 0], v8, vs[..., 0])
    if mode == "f16":
        return (kv_f16(k), kv_f16(v))
    return (k, v)


def prepared(device, name):
    """Case ``name``'s cache, filled, its queries and ``run_attention``'s options, with what the
    reference needs (entries, positions, pad keep mask, the raw gate rows)."""
    shape, mode, context, pos0, T, pads, range_keys = CASES[name]
    rng = np.random.default_rng(len(name))
    n = pos0 + T
    positions = np.arange(n)
    entries = entries_of(rng, shape, mode, n)
    cache = ops.KvCache(device, shape, context, chunk=T, mode=mode, range_keys=range_keys)
    kept = positions[positions >= n - cache.slots]
    fill_cache(device, cache, tuple(e[kept] for e in entries), kept)
    q = (rng.normal(size=(T, shape.heads, shape.qk_dim)) * 4.0).astype(F32)
    options, keep = {}, None
    if mode == "int8":
        options["int8"] = True
    width = shape.q_width + shape.k_width + shape.v_width
    raw = rng.normal(size=(T, width + shape.out_width)).astype(F32)
    if shape.gate:
        options["gate"] = upload(device, raw, "qkvg")
    if pads:
        ids = rng.integers(1, 500, context + 1)
        ids[rng.random(context + 1) < 0.2] = 0  # a fifth of the keys are pads
        ids[pos0] = 0  # a query at a pad still sees the keys before it
        keep = ids[:n] != 0
        options["pad_tokens"] = upload(device, ids.astype(np.uint32), "tokens")
    return cache, q, options, entries, positions, keep, raw


@pytest.mark.parametrize("name", list(CASES))
def test_long_positions_and_edges(device, name):
    shape, mode, context, pos0, T, pads, range_keys = CASES[name]
    cache, q, options, entries, positions, keep, raw = prepared(device, name)
    width = shape.q_width + shape.k_width + shape.v_width
    tiles = ops.tiling(shape, cache, T)
    assert (tiles.splits > 1) == (range_keys < context), "the case must merge ranges, or be one pass"
    got = run_attention(device, shape, cache, q, pos0, **options)

    query_positions = pos0 + np.arange(T)
    span = shape.window or context
    want = ref.attend(q, query_positions, entries, positions, span, mode == "int8", scale=shape.score_scale,
                      key_keep=keep).reshape(T, -1)
    if shape.gate:
        want = want * sigmoid(raw[:, width:])
    assert rel(got, want) <= LONG_GATE
    rows = (T * shape.heads, shape.v_dim)
    assert argmax_mismatches(got.reshape(rows), want.reshape(rows)) == 0

    # Decode steps at the chunk's first, middle and last positions give the chunk's bits.
    for t in sorted({0, T // 2, T - 1}):
        step_options = dict(options)
        if shape.gate:
            step_options["gate"] = upload(device, raw[t : t + 1], "qkvg")
        one = run_attention(device, shape, cache, q[t : t + 1], pos0 + t, **step_options)
        np.testing.assert_array_equal(one[0], got[t])


@pytest.mark.parametrize("name", ["f32-global-4096", "f16-window-ring", "int8-gate-pads-edges", "odd-widths"])
def test_values_read_ahead_give_the_same_bits(device, name):
    """A CPU adapter's kernel reads each V row's memory lines ahead, with the keys
    (TOUCH_VALUES); a GPU's does not. The words read only meet a uniform zero: both give the same
    bits."""
    shape, mode, context, pos0, T, pads, range_keys = CASES[name]
    cache, q, options, *_ = prepared(device, name)
    saved, outputs = device.software_rasterizer, []
    try:
        for software in (True, False):
            device.software_rasterizer = software
            outputs.append(run_attention(device, shape, cache, q, pos0, **options))
    finally:
        device.software_rasterizer = saved
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert np.isfinite(outputs[0]).all()


def test_tiling_follows_the_cache():
    """The ranges depend on the cache's slots only; chunks change the query tiles alone."""
    class Cache:  # what tiling reads of a KvCache (a GPU's ranges)
        def __init__(self, slots, range_keys=ops.SPLIT_KEYS):
            self.slots, self.range_keys = slots, range_keys

    shape = AttentionShape(9, 3, 64, 64)
    for slots, splits in ((64, 1), (256, 1), (257, 2), (4096, 16), (8192, 32), (32768, 32)):
        per_chunk = {ops.tiling(shape, Cache(slots), T).splits for T in (1, 7, 64)}
        assert per_chunk == {splits}, slots
    wide = ops.tiling(AttentionShape(32, 1, 256, 256), Cache(600), 5)
    assert wide.head_tile * wide.head_tiles >= 32 and wide.head_tiles > 1
    assert ops.partials_floats(shape, Cache(256), 64) == 0
    assert ops.partials_floats(shape, Cache(1024), 64) == 64 * 9 * 4 * 66
    assert ops.tiling(shape, Cache(4096, range_keys=4096), 1).splits == 1  # a CPU adapter's: one pass


def test_tile_fits_the_workgroup_memory():
    """The tile's workgroup variables, as attention.wgsl declares them and WebGPU counts them (each
    rounded up to 16 bytes), fit the 16 KiB every adapter offers, for every query width."""
    class Cache:
        slots, range_keys = 4096, ops.SPLIT_KEYS

    for qk in range(1, 257):
        for positions in (1, 5, 64):
            rows = ops.tiling(AttentionShape(32, 1, qk, 64), Cache(), positions).rows
            words = (rows * 4 * -(-qk // 4)       # query: vec4s of each row
                     + rows * ops.BLOCK           # scores: a block's vec4s of 4 keys, each row
                     + ops.BLOCK                  # value_scale: a vec4 each 4 keys
                     + rows * 64                  # lane_rows: per row and invocation
                     + 6 * 4 * -(-rows // 4))     # row_max, _rescale, _sum, _pos, _phase, _span
            assert 4 * words <= ops.WORKGROUP_BYTES, (qk, positions, rows)


def test_cpu_adapter_ranges(device):
    """A CPU adapter's cache is ranges of CPU_SPLIT_KEYS slots (one pass up to 512: its few
    threads are busy enough), a GPU's of SPLIT_KEYS."""
    shape = AttentionShape(9, 3, 64, 64)
    cache = ops.KvCache(device, shape, 4096)
    want = ops.CPU_SPLIT_KEYS if device.software_rasterizer else ops.SPLIT_KEYS
    assert cache.range_keys == want
    if device.software_rasterizer:
        assert ops.tiling(shape, ops.KvCache(device, shape, 512), 1).splits == 1
        assert ops.tiling(shape, cache, 1).splits == 4096 // ops.CPU_SPLIT_KEYS
    assert ops.KvCache(device, shape, 4096, range_keys=512).range_keys == 512
