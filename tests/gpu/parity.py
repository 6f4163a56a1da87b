"""Shared helpers of the GPU parity tests: the measure (``rel``) and the attention gates, buffers in
and out, a KV cache filled or read back directly, and attention run alone over it. The browser tests measure with ``rel`` too."""

import numpy as np

from needle_wgpu.gpu import Binding, Plan, UniformArena
from needle_wgpu.kernels import attention as ops

GATE = 1e-5  # f32 sums in other orders, GPU exp/sqrt/division: a few ulps
# Softmax over 1024 to 8192 keys of random-sign values: the output is a small remainder of long
# f32 sums, and the reference itself is up to ~1.4e-5 (of RMS) from a float64 evaluation there
# (the GPU is as close to it); measured GPU vs reference 0.7e-5 to 1.2e-5.
LONG_GATE = 5e-5
F32 = np.float32


def rel(got, want) -> float:
    """max |got - want| / RMS(want), both widened to float64 first: the difference is exact, so a
    gate measures the same thing whatever the dtypes of the two sides."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.sqrt((want ** 2).mean()))


def argmax_mismatches(got, want) -> int:
    """Rows of two [T, vocab] logit arrays whose argmax differs."""
    return int((np.asarray(got).argmax(-1) != np.asarray(want).argmax(-1)).sum())


def upload(device, array, label):
    """A storage buffer holding ``array``: floats as f32, integers (ids, permutations, raw bytes) as they are."""
    array = np.asarray(array)
    array = np.ascontiguousarray(array, dtype=F32 if array.dtype.kind == "f" else array.dtype)
    return device.buffer(array.nbytes, label=label, data=array.tobytes())


def download(device, buffer, shape, offset=0):
    count = int(np.prod(shape))
    return np.frombuffer(device.read(buffer, 4 * count, 4 * offset), F32).reshape(shape)


def read_cache(device, cache):
    """The cache buffer decoded: (k, v) f32 or float16, or (k_i8, k_scale, v_i8, v_scale), per slot."""
    end = cache.base + cache.words  # a slab's cache lies at its slot's offset
    words = np.frombuffer(device.read(cache.buffer, 4 * end), np.uint32)
    s, kv, qk, vd = cache.slots, cache.kv_heads, cache.qk_dim, cache.v_dim
    if cache.mode == "f16":
        k = words[cache.k_at : cache.v_at].view(np.float16).reshape(s, kv, 2 * cache.k_row)
        v = words[cache.v_at : end].view(np.float16).reshape(s, kv, 2 * cache.v_row)
        assert not k[..., qk:].view(np.uint16).any() and not v[..., vd:].view(np.uint16).any(), \
            "padding halves must stay 0"
        return k[..., :qk], v[..., :vd]
    if cache.mode == "f32":
        k = words[cache.k_at : cache.v_at].view(F32).reshape(s, kv, qk)
        v = words[cache.v_at : cache.v_at + s * kv * vd].view(F32).reshape(s, kv, vd)
        return k, v
    k8 = words[cache.k_at : cache.v_at].view(np.int8).reshape(s, kv, 4 * cache.k_row)
    v8 = words[cache.v_at : cache.k_scale_at].view(np.int8).reshape(s, kv, 4 * cache.v_row)
    assert not k8[..., qk:].any() and not v8[..., vd:].any(), "padding bytes must stay 0"
    k_scale = words[cache.k_scale_at : cache.v_scale_at].view(F32).reshape(s, kv)
    v_scale = words[cache.v_scale_at : end].view(F32).reshape(s, kv)
    return k8[..., :qk], k_scale, v8[..., :vd], v_scale


def fill_cache(device, cache, entries, positions):
    """Write per-position cache entries straight into the buffer (slot = position mod slots)."""
    words = np.frombuffer(device.read(cache.buffer, 4 * (cache.base + cache.words)), np.uint32).copy()
    slots = positions % cache.slots
    s, kv = cache.slots, cache.kv_heads
    if cache.int8:
        k8, k_scale, v8, v_scale = entries
        k_rows = np.zeros((s, kv, 4 * cache.k_row), np.int8)
        v_rows = np.zeros((s, kv, 4 * cache.v_row), np.int8)
        k_rows[slots, :, : cache.qk_dim], v_rows[slots, :, : cache.v_dim] = k8, v8
        ks, vs = np.zeros((s, kv), F32), np.zeros((s, kv), F32)
        ks[slots], vs[slots] = k_scale, v_scale
        parts = (k_rows.view(np.uint32), v_rows.view(np.uint32), ks.view(np.uint32), vs.view(np.uint32))
        starts = (cache.k_at, cache.v_at, cache.k_scale_at, cache.v_scale_at)
    else:
        k, v = entries
        dtype = np.float16 if cache.mode == "f16" else F32
        per_word = 4 // np.dtype(dtype).itemsize
        kr = np.zeros((s, kv, per_word * cache.k_row), dtype)
        vr = np.zeros((s, kv, per_word * cache.v_row), dtype)
        kr[slots, :, : cache.qk_dim], vr[slots, :, : cache.v_dim] = k, v
        parts, starts = (kr.view(np.uint32), vr.view(np.uint32)), (cache.k_at, cache.v_at)
    for part, start in zip(parts, starts):
        words[start : start + part.size] = part.ravel()
    device.write(cache.buffer, words.tobytes())


def run_attention(device, shape, cache, q, pos0, **options):
    """``kernels.attention.attention`` alone over ``cache`` as it is (filled by ``fill_cache``):
    q [T][heads][qk] at positions pos0 .. pos0 + T - 1, ``options`` passed on (gate, int8).
    Returns o [T][heads · v_dim]."""
    T = len(q)
    q_buf = upload(device, q.reshape(T, -1), "q")
    o = device.buffer(4 * T * shape.out_width, label="o")
    step = device.buffer(16, label="step", usage="uniform", data=np.array([pos0, 0, 0, 0], np.uint32).tobytes())
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "attention")
    partials = ops.attention_partials(device, [shape], [cache], T)
    ops.attention(plan, arena, Binding(step), shape=shape, q=q_buf, cache=cache, o=o, positions=T,
                  partials=partials, **options)
    device.run(plan)
    return download(device, o, (T, shape.out_width))
