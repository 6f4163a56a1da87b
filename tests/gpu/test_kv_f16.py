"""The dense family's f16 K/V cache: qk_rope writing it, attention reading it (dense spec §3).

qk_rope stores each K/V value saturated to ±65504 and rounded to the nearest half, ties to even;
attention widens the halves back to f32. The reference is ``reference.needle3.attention.attend`` over
``reference.dense_attention.kv_f16`` of the keys and values. Rounding is checked bit for bit on
values that reach the cache unchanged (``test_f16_rounding_exact``) and, after norms and RoPE,
against the f32 cache's values of the same positions (the kernel is the same up to the store,
and the f32 values are within GATE of the reference). The reference's own f32 K/V are a few ulps
away, so kv_f16 of them may differ from the GPU's halves by a step at near-ties (or by more for
values far below the row's scale): attention is compared on exactly the halves the GPU stored,
as the int8 tests do, and on ``kv_f16`` values written straight into the cache.
"""

import numpy as np
import pytest

from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.gpu import Binding, Plan, UniformArena
from needle_wgpu.kernels import attention as ops
from needle_wgpu.kernels.attention import AttentionShape
from needle_wgpu.reference.needle3 import attention as ref
from needle_wgpu.reference.dense_attention import kv_f16

from .parity import GATE, LONG_GATE, fill_cache, rel, run_attention
from .test_attention_dense import SHAPES, Layer, Runner, random_qkv

pytestmark = pytest.mark.gpu
F32, F16 = np.float32, np.float16
HALF_EPS = 2.0**-11  # a half's relative rounding error bound (10 stored mantissa bits)


def bits(x):
    return np.asarray(x).view(np.uint16 if x.dtype == F16 else np.uint32)


def check_chunked(device, shape, layer, qkv, chunks, *, context, chunk, pos0=0, prior=None):
    """qk_rope + attention over the chunk lengths from pos0 on an f16 cache holding ``prior``
    (kv_f16 keys and values of the positions before pos0, written directly). Checks q against
    the reference, the stored halves against kv_f16 of an f32 cache's K/V of the same chunks,
    and o against the reference attention over the stored halves; returns q, o, K and V."""
    runner = Runner(device, shape, layer, context=context, chunk=chunk, mode="f16")
    n = len(qkv)
    if prior is not None:
        before = np.arange(pos0)
        kept = before[before >= pos0 - runner.cache.slots]
        fill_cache(device, runner.cache, (prior[0][kept], prior[1][kept]), kept)
    q, o, k16, v16 = runner.schedule(qkv, chunks, pos0=pos0, attend=True)
    _, _, k32, v32 = Runner(device, shape, layer, context=context, chunk=chunk).schedule(qkv, chunks, pos0=pos0)
    positions = pos0 + np.arange(n)
    qh, kh, vh = layer.reference(shape, qkv, positions)
    assert rel(q, qh.reshape(n, -1)) <= GATE
    for half, full, want in ((k16, k32, kh), (v16, v32, vh)):
        assert rel(full, want) <= GATE
        np.testing.assert_array_equal(bits(half), bits(kv_f16(full).astype(F16)))
    keys, values = k16.astype(F32), v16.astype(F32)
    if prior is not None:
        keys, values = np.concatenate([prior[0], keys]), np.concatenate([prior[1], values])
    span = context if shape.window is None else shape.window
    want = ref.attend(qh, positions, (keys, values), np.arange(pos0 + n), span, scale=shape.score_scale)
    assert rel(o, want.reshape(n, -1)) <= GATE
    return q, o, k16, v16


def nudged(x, ulps):
    """x (f32) moved by ``ulps`` representable f32 steps."""
    x = F32(x)
    for _ in range(abs(int(ulps))):
        x = np.nextafter(x, F32(np.inf if ulps > 0 else -np.inf), dtype=F32)
    return x


def test_f16_rounding_exact(device):
    """No bias, norm or RoPE: K and V reach the cache as the input f32 values, so the halves
    must equal kv_f16 exactly: ties to even (normal and subnormal halves), values a few ulps
    from a tie, saturation at ±65504, an odd V width (its padding half stays 0)."""
    shape = AttentionShape(2, 2, 8, 7, rope="none")
    rng = np.random.default_rng(3)
    T, k_at, v_at = 8, shape.q_width, shape.q_width + shape.k_width
    qkv = random_qkv(rng, shape, T)
    halves = rng.normal(size=60).astype(F16)
    upper = np.nextafter(halves, F16(np.inf))
    ties = ((halves.astype(np.float64) + upper.astype(np.float64)) / 2).astype(F32)  # exact in f32
    subnormal_ties = ((rng.integers(-1023, 1023, 20) + 0.5) * 2.0**-24).astype(F32)
    special = np.array([65504, 65519.99, 65520, 1e6, -1e30, 3e38, -65505, 0.0, -0.0, 2.0**-25, 3 * 2.0**-25,
                        2.0**-14 - 2.0**-26, 2.0**-14, 1e-40, 1.0, -2.0**15], F32)
    values = np.concatenate([ties, [nudged(x, n) for x, n in zip(ties, rng.integers(-3, 4, len(ties)))],
                             subnormal_ties, [nudged(x, n) for x, n in zip(subnormal_ties, rng.integers(-2, 3, 20))],
                             special]).astype(F32)
    flat = qkv.copy()
    kv_cells = flat[:, k_at:].copy()  # [T][k | v]: 240 cells, the crafted values first
    assert len(values) <= kv_cells.size
    kv_cells.ravel()[: len(values)] = values
    flat[:, k_at:] = kv_cells
    runner = Runner(device, shape, Layer(device, shape, rng), context=16, chunk=T, mode="f16")
    q, _, k16, v16 = runner.schedule(flat, (T,))
    np.testing.assert_array_equal(q, flat[:, :k_at])
    want_k = kv_f16(flat[:, k_at:v_at].reshape(T, 2, 8)).astype(F16)
    want_v = kv_f16(flat[:, v_at:].reshape(T, 2, 7)).astype(F16)
    np.testing.assert_array_equal(k16.view(np.uint16), want_k.view(np.uint16))
    np.testing.assert_array_equal(v16.view(np.uint16), want_v.view(np.uint16))
    # What the reference promises: ties to even, saturation instead of inf (np.float16 alone
    # would give inf from 65520 up).
    assert kv_f16(np.array([65520, -1e30, 2.0**-25, 3 * 2.0**-25], F32)).tolist() == [65504, -65504, 0, 2.0**-23]
    with np.errstate(over="ignore"):
        assert np.isinf(F32(65520).astype(F16))
    stored = np.concatenate([k16.ravel(), v16.ravel()])
    assert np.isfinite(stored).all() and (stored == F16(65504)).any() and (stored == F16(-65504)).any()


@pytest.mark.parametrize("name, window", [("qwen3", None), ("llama", 5), ("gemma3", 5), ("qwen2", None)])
def test_f16_prefill_and_decode(device, name, window):
    """21 positions in chunks of 8 and as 21 decode steps on an f16 cache: the stored halves are
    kv_f16 of the reference K/V (up to near-ties), attention over them equals the reference, and
    the two schedules agree bit for bit."""
    shape = AttentionShape(**{**SHAPES[name].__dict__, "window": window})
    rng = np.random.default_rng(60 + len(name))
    layer = Layer(device, shape, rng)
    qkv = random_qkv(rng, shape, 21)
    results = [check_chunked(device, shape, layer, qkv, chunks, context=32, chunk=8)
               for chunks in ((8, 8, 5), (1,) * 21)]
    for a, b in zip(*results):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("window", [None, 64], ids=["global", "window"])
def test_f16_far_positions(device, window):
    """Positions 3000-3011 (a chunk of 8, then 4 decode steps) over 3000 earlier keys (global)
    or a 64-key window, the earlier keys written as kv_f16 values; the same 12 positions as
    decode steps only give the same bits."""
    shape = AttentionShape(**{**SHAPES["qwen3"].__dict__, "window": window})
    rng = np.random.default_rng(9 + (window or 0))
    layer = Layer(device, shape, rng)
    pos0, context = 3000, 4096
    prior = (kv_f16(rng.normal(size=(pos0, shape.kv_heads, shape.qk_dim))),
             kv_f16(rng.normal(size=(pos0, shape.kv_heads, shape.v_dim)) * 2.0))
    qkv = random_qkv(rng, shape, 12)
    results = [check_chunked(device, shape, layer, qkv, chunks, context=context, chunk=8, pos0=pos0, prior=prior)
               for chunks in ((8, 1, 1, 1, 1), (1,) * 12)]
    for a, b in zip(*results):
        np.testing.assert_array_equal(bits(a), bits(b))


def attend_filled(device, shape, mode, entries, positions, pos0, q):
    """attention alone over a cache of the given mode holding ``entries`` at ``positions``."""
    T = len(q)
    cache = ops.KvCache(device, shape, pos0 + T, chunk=T, mode=mode)
    kept = positions[positions >= pos0 + T - cache.slots]
    fill_cache(device, cache, tuple(e[kept] for e in entries), kept)
    return run_attention(device, shape, cache, q, pos0)


@pytest.mark.parametrize("shape", [AttentionShape(8, 2, 64, 64, window=1024), AttentionShape(8, 2, 64, 64),
                                   AttentionShape(3, 1, 11, 7, window=1024, scale=0.2)],
                         ids=["window-1024", "global-4096", "odd-widths"])
def test_f16_read_equals_f32_on_halves(device, shape):
    """Keys and values that are halves give the same bits from an f16 cache as from an f32 one
    (attention sums the widened halves in the f32 mode's order), and equal the reference:
    4096 keys (global) or a 1024-key window at positions near 4096, odd widths."""
    rng = np.random.default_rng(shape.qk_dim + (shape.window or 0))
    T, N = 3, 4096
    pos0, positions = N - T, np.arange(N)
    k = kv_f16(rng.normal(size=(N, shape.kv_heads, shape.qk_dim)))
    v = kv_f16(rng.normal(size=(N, shape.kv_heads, shape.v_dim)))
    q = (rng.normal(size=(T, shape.heads, shape.qk_dim)) * 6.0).astype(F32)
    o16 = attend_filled(device, shape, "f16", (k, v), positions, pos0, q)
    o32 = attend_filled(device, shape, "f32", (k, v), positions, pos0, q)
    np.testing.assert_array_equal(o16, o32)
    want = ref.attend(q, pos0 + np.arange(T), (k, v), positions, shape.window or N, scale=shape.score_scale)
    assert rel(o16, want.reshape(T, -1)) <= LONG_GATE  # long f32 sums: see LONG_GATE


def test_f16_differs_from_f32_by_half_precision(device):
    """The same 40 positions through qk_rope + attention with an f32 and an f16 cache (window
    16): each stored K/V half is within 2^-11 (relative) of the f32 value, and the outputs
    differ by about half-precision rounding, neither 0 nor much more. Measured over five
    dense shapes: K rounding 1.9e-4 to 2.2e-4 of RMS, outputs 2.5e-4 to 4.5e-4 of RMS
    (2^-11 = 4.9e-4), max |d| / RMS 2.4e-3 to 6.2e-3."""
    shape = AttentionShape(**{**SHAPES["qwen3"].__dict__, "window": 16})
    rng = np.random.default_rng(21)
    layer = Layer(device, shape, rng)
    qkv = random_qkv(rng, shape, 40)
    runs = {mode: Runner(device, shape, layer, context=64, chunk=8, mode=mode).schedule(qkv, (8,) * 5, attend=True)
            for mode in ("f32", "f16")}
    (q32, o32, k32, v32), (q16, o16, k16, v16) = runs["f32"], runs["f16"]
    np.testing.assert_array_equal(q16, q32)  # the query is not rounded
    rms_rel = lambda got, want: float(np.sqrt(((got - want.astype(np.float64)) ** 2).mean() /  # noqa: E731
                                              (want.astype(np.float64) ** 2).mean()))
    for half, full in ((k16, k32), (v16, v32)):
        assert np.all(np.abs(half.astype(F32) - full) <= HALF_EPS * np.abs(full) + 2.0**-25)
        assert 2.0**-14 < rms_rel(half.astype(F32), full) < HALF_EPS
    assert 2.0**-14 < rms_rel(o16, o32) < 2 * HALF_EPS
    assert rel(o16, o32) < 32 * HALF_EPS


def test_f16_cache_layout_and_checks(device):
    """Words per row and bytes saved; mode arguments; the ops that do not take an f16 cache."""
    shape = AttentionShape(4, 2, 64, 64)
    f32, f16 = (ops.KvCache(device, shape, 1024, mode=mode) for mode in ("f32", "f16"))
    assert (f16.k_row, f16.v_row, f16.int8, f16.mode_code) == (32, 32, False, 2)
    assert f16.nbytes * 2 == f32.nbytes == 4 * 1024 * 2 * 128
    odd = ops.KvCache(device, AttentionShape(3, 1, 11, 7), 10, mode="f16")
    assert (odd.k_row, odd.v_row, odd.v_at, odd.words) == (6, 4, 60, 100)
    assert ops.KvCache(device, shape, 8, True).mode == "int8"  # the positional int8 flag still works
    with pytest.raises(ValueError):
        ops.KvCache(device, shape, 8, mode="bf16")
    with pytest.raises(ValueError):
        ops.KvCache(device, shape, 8, int8=True, mode="f16")
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "checks")
    buf = device.buffer(4096, label="scratch")
    with pytest.raises(ValueError):  # the int8 flag states what the caller expects
        ops.attention(plan, arena, Binding(buf), shape=shape, q=buf, cache=f16, o=buf, positions=1, int8=True)
    needle = AttentionShape(4, 2, 64, 64, norm="zc", gate=True, conv_taps=2)
    with pytest.raises(UnsupportedModelError):
        ops.qkv_post(plan, arena, Binding(buf), shape=needle, fp16_store=None, layer=0, qkvg=buf, ring=buf,
                     ring_size=8, q_out=buf, cache=ops.KvCache(device, needle, 16, mode="f16"), positions=4)
    with pytest.raises(UnsupportedModelError):
        ops.qk_rope(plan, arena, Binding(buf), shape=AttentionShape(2, 1, 8, 8, rope="none"), qkv=buf, q_out=buf,
                    cache=ops.KvCache(device, AttentionShape(2, 1, 8, 8), 16, True), positions=4)
    assert len(plan) == 0
