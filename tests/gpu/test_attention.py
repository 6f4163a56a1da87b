"""qkv_post and attention on the GPU vs the NumPy reference (§4.5 items 4-9, §6 items 1-2).

The tiny fixture's real layer parameters (taps, q/k norms; window 16, layer 2 global) on random
projections, plus synthetic geometries for odd head counts and widths, RoPE at large positions
and spans of 8192 keys. int8 mode is checked twice: the cache and the A8 query against
``quantize_rows`` of the reference values (integers may differ only at near-ties, see
``check_quantised``), and the attention against the reference int8 attention fed with exactly
the integers and scales the GPU stored.
"""

from dataclasses import dataclass, replace

import numpy as np
import pytest

from needle_wgpu.errors import DeviceLimitError
from needle_wgpu.formats import cact
from needle_wgpu.gpu import Binding, Plan, UniformArena
from needle_wgpu.kernels import attention as ops
from needle_wgpu.kernels.needle3.fp16_store import Fp16Store
from needle_wgpu.reference.needle3 import attention as ref
from needle_wgpu.reference.ops import causal_conv, fake_quant, quantize_rows, rope_frequencies, sigmoid
from needle_wgpu.reference.needle3.weights import load_weights

from .parity import F32, GATE, LONG_GATE, download, fill_cache, read_cache, rel, run_attention, upload

pytestmark = pytest.mark.gpu



@dataclass
class Layer:
    """What qkv_post reads of one layer, as the reference sees it (FP16 values widened to f32)."""

    q_taps: np.ndarray | None
    k_taps: np.ndarray | None
    v_taps: np.ndarray | None
    q_norm: np.ndarray
    k_norm: np.ndarray


@dataclass
class Model:
    geometry: object
    store: object  # Fp16Store or ArrayStore
    layers: dict  # layer index -> Layer


class ArrayStore:
    """An Fp16Store look-alike holding the given arrays (as FP16) for geometries the fixture lacks."""

    def __init__(self, device, arrays: dict):
        self.offsets, self.values, blobs, size = {}, {}, [], 0
        for name, value in arrays.items():
            half = np.asarray(value).astype("<f2")
            self.values[name] = half.astype(F32)
            self.offsets[name] = size // 2
            blob = half.tobytes()
            blobs.append(blob + b"\0" * (-len(blob) % 4))
            size += len(blobs[-1])
        self.buffer = device.buffer(size, label="fp16", data=b"".join(blobs))

    def offset(self, name):
        return self.offsets[name]


@pytest.fixture(scope="module")
def tiny(fixture_dir, device):
    f = cact.load(fixture_dir / "tiny.cact")
    w = load_weights(f)
    layers = {i: Layer(a.q_taps, a.k_taps, a.v_taps, a.q_norm, a.k_norm) for i, a in enumerate(w.attention)}
    return Model(f.geometry, Fp16Store(device, f), layers)


def synthetic(device, base, rng, layer=0, **sizes):
    """A one-layer geometry with the given sizes and random FP16 taps and norms."""
    g = replace(base, num_layers=layer + 1, **sizes)
    taps = g.qkv_conv_taps
    arrays = {f"layers.{layer}.q_norm": rng.normal(size=g.qk_head_dim) * 0.3,
              f"layers.{layer}.k_norm": rng.normal(size=g.qk_head_dim) * 0.3}
    if taps:
        for name, width in (("q_taps", g.q_dim), ("k_taps", g.k_dim), ("v_taps", g.v_dim)):
            arrays[f"layers.{layer}.{name}"] = rng.normal(size=(taps, width)) * 0.5 + np.eye(taps, 1)
    store = ArrayStore(device, arrays)
    v = lambda name: store.values.get(f"layers.{layer}.{name}")  # noqa: E731
    return Model(g, store, {layer: Layer(v("q_taps"), v("k_taps"), v("v_taps"), v("q_norm"), v("k_norm"))})


# ------------------------------------------------------------------------------ the reference


def reference_heads(g, p: Layer, raw, positions, keep=None):
    """q, k, v heads of positions from pos 0 (or after zero rows) from raw [N][q|k|v|gate] (§4.5 4-7);
    ``keep`` (bool per position, False at the pad id 0): conv taps j >= 1 reading a pad skipped (§U a)."""
    q_end, k_end = g.q_dim, g.q_dim + g.k_dim
    q, k, v = raw[:, :q_end], raw[:, q_end:k_end], raw[:, k_end : k_end + g.v_dim]
    if p.q_taps is not None:
        tap_keep = None
        if keep is not None:
            tap_keep = np.stack([np.ones(len(raw), bool)] + [np.concatenate((np.zeros(j, bool), keep[: len(raw) - j]))
                                                             for j in range(1, p.q_taps.shape[0])])
        q, k, v = (causal_conv(x, taps, None, tap_keep) for x, taps in ((q, p.q_taps), (k, p.k_taps), (v, p.v_taps)))
    qh = ref.position_heads(q, g.num_heads, p.q_norm, positions, g.rope_theta)
    kh = ref.position_heads(k, g.num_kv_heads, p.k_norm, positions, g.rope_theta)
    return qh, kh, ref.split_heads(v, g.num_kv_heads)


def gate_of(g, raw):
    return raw[:, g.q_dim + g.k_dim + g.v_dim :]


def random_raw(rng, g, n):
    width = g.q_dim + g.k_dim + g.v_dim + g.attn_out
    scale = rng.uniform(0.3, 3.0, size=(n, 1))  # rows of unequal size, as real projections
    return (rng.normal(size=(n, width)) * scale).astype(F32)


def check_quantised(got_int, got_scale, x_ref):
    """GPU int8 vectors vs quantize_rows(x_ref) (§6 item 1).

    The GPU quantises its own f32 values, which differ from the reference's by a few ulps, so an
    integer may round the other way where x/scale is within ~1e-4 of a .5 (the kernel itself
    divides exactly and rounds half to even like the reference). Scales must agree to the gate;
    integers exactly, except such near-ties, by at most 1 and rarely.
    """
    want_int, want_scale = quantize_rows(x_ref)
    assert rel(got_scale, want_scale[..., 0]) <= GATE
    quotient = x_ref / want_scale
    near_tie = np.abs(np.abs(quotient - np.floor(quotient)) - 0.5) < 2e-3
    differ = got_int != want_int
    assert np.abs(got_int.astype(int) - want_int).max() <= 1
    assert not (differ & ~near_tie).any(), "an integer differs away from a rounding tie"
    assert differ.mean() <= 1e-3


# ------------------------------------------------------------------------------ running


class Runner:
    """Buffers and per-T plans for a layer: qkvg rows in, q and o out, a ring and a cache."""

    def __init__(self, device, model, layer, *, context, int8, chunk, ring_size=None, q_quant=False, kv_levels=(),
                 pad_ids=None):
        g = self.g = model.geometry
        self.q_quant, self.kv_levels = q_quant, kv_levels
        self.device, self.model, self.layer, self.int8 = device, model, layer, int8
        self.width = g.q_dim + g.k_dim + g.v_dim + g.attn_out
        self.ring_size = ring_size or chunk + max(g.qkv_conv_taps, 1) - 1
        self.shape = ops.needle3_shape(g, layer)
        self.cache = ops.KvCache(device, self.shape, context, int8, chunk=chunk)
        self.partials = ops.attention_partials(device, [self.shape], [self.cache], chunk)
        self.qkvg = device.buffer(4 * chunk * self.width, label="qkvg")
        self.ring = device.buffer(4 * self.ring_size * (g.q_dim + g.k_dim + g.v_dim), label="qkv_ring")
        self.q = device.buffer(4 * chunk * g.q_dim, label="q")
        self.o = device.buffer(4 * chunk * g.attn_out, label="o")
        self.step = device.buffer(16, label="step", usage="uniform")
        self.pads = None if pad_ids is None else upload(device, np.asarray(pad_ids, np.uint32), "tokens")
        self.plans = {}

    def plan(self, T, attend=True):
        if (T, attend) not in self.plans:
            arena, plan = UniformArena(self.device, capacity=1 << 12), Plan(self.device, f"attention T={T}")
            step = Binding(self.step)
            ops.qkv_post(plan, arena, step, shape=self.shape, layer=self.layer, fp16_store=self.model.store,
                         qkvg=self.qkvg, ring=self.ring, ring_size=self.ring_size, q_out=self.q, cache=self.cache,
                         positions=T, int8=self.int8, q_quant=self.q_quant, kv_levels=self.kv_levels,
                         pad_tokens=self.pads)
            if attend:
                ops.attention(plan, arena, step, shape=self.shape, q=self.q, cache=self.cache,
                              gate=self.qkvg, o=self.o, positions=T, int8=self.int8, pad_tokens=self.pads,
                              partials=self.partials)
            self.plans[(T, attend)] = (plan, arena)
        return self.plans[(T, attend)][0]

    def run(self, pos0, raw, attend=True):
        """One chunk at pos0; returns q [T][q_dim], o [T][attn_out] and the chunk's cache entries."""
        T, g = len(raw), self.g
        self.device.write(self.qkvg, np.ascontiguousarray(raw, F32).tobytes())
        self.device.write(self.step, np.array([pos0, 0, 0, 0], np.uint32).tobytes())
        self.device.run(self.plan(T, attend))
        slots = (pos0 + np.arange(T)) % self.cache.slots
        entries = tuple(e[slots] for e in read_cache(self.device, self.cache))
        o = download(self.device, self.o, (T, g.attn_out)) if attend else None
        return download(self.device, self.q, (T, g.q_dim)), o, entries


def run_schedule(runner, raw, chunks, pos0=0, attend=True):
    """Run the chunk lengths in order; concatenate q, o and the cache entries per position."""
    qs, os_, entries, at = [], [], [], 0
    for T in chunks:
        q, o, e = runner.run(pos0 + at, raw[at : at + T], attend)
        qs.append(q)
        os_.append(o)
        entries.append(e)
        at += T
    cat = lambda xs: np.concatenate(xs) if xs[0] is not None else None  # noqa: E731
    return cat(qs), cat(os_), tuple(np.concatenate(parts) for parts in zip(*entries))


def check_heads(g, int8, q, entries, qh, kh, vh):
    """qkv_post's outputs vs the reference heads of the same positions."""
    if not int8:
        assert rel(q, qh.reshape(len(q), -1)) <= GATE
        assert rel(entries[0], kh) <= GATE
        assert rel(entries[1], vh) <= GATE
        return
    k8, k_scale, v8, v_scale = entries
    check_quantised(k8, k_scale, kh)
    check_quantised(v8, v_scale, vh)
    q = q.reshape(qh.shape)
    q_scale = np.abs(q).max(axis=-1) / F32(127)  # the largest |x| quantises to exactly ±127
    check_quantised(np.rint(q / q_scale[..., None]).astype(np.int8), q_scale, qh)
    np.testing.assert_allclose(q, fake_quant(qh), rtol=0, atol=1.01 * float(q_scale.max()))


# ------------------------------------------------------------------------------ tests


def test_rope_constants():
    for head_dim, theta in ((32, 10000.0), (48, 100000.0), (10, 10000.0), (64, 500000.0)):
        np.testing.assert_array_equal(np.array(ops.rope_frequencies(head_dim, theta), F32),
                                      rope_frequencies(head_dim, theta))
    parts = ops.pio2_parts()
    assert abs(sum(parts) - np.pi / 2) < 1e-15
    for part in parts[:3]:  # k·part exact in f32 for k < 2^16: at most 8 significant bits
        mantissa, _ = np.frexp(part)
        assert float(mantissa * 256) == int(mantissa * 256)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("layer", [0, 2], ids=["local", "global"])
def test_qkv_post_two_chunks(device, tiny, layer, int8):
    """pos0 = 0, then a second chunk whose conv reads the first chunk's tail from the ring."""
    g = tiny.geometry
    rng = np.random.default_rng(layer + 10 * int8)
    raw = random_raw(rng, g, 12)
    runner = Runner(device, tiny, layer, context=64, int8=int8, chunk=7)  # ring of 9: the minimum
    q, _, entries = run_schedule(runner, raw, (5, 7), attend=False)
    qh, kh, vh = reference_heads(g, tiny.layers[layer], raw, np.arange(12))
    check_heads(g, int8, q, entries, qh, kh, vh)
    # The ring holds the raw q/k/v rows of the last ring_size positions, by position mod R.
    width = g.q_dim + g.k_dim + g.v_dim
    ring = download(device, runner.ring, (runner.ring_size, width))
    for p in range(12 - runner.ring_size, 12):
        np.testing.assert_array_equal(ring[p % runner.ring_size], raw[p, :width])


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("taps", [2, 0])
def test_qkv_post_odd_sizes_far_positions(device, tiny, taps, int8):
    """3 query heads over 1 kv head, qk = 10, vd = 6 (int8 rows padded to 2 words), no conv or
    2 taps, and positions near 2^16 (RoPE angles up to 65534 rad; the ring starts zeroed, which
    the reference sees as a zero tail)."""
    rng = np.random.default_rng(taps + 3 * int8)
    model = synthetic(device, tiny.geometry, rng, num_heads=3, num_kv_heads=1, qk_head_dim=10, v_head_dim=6,
                      qkv_conv_taps=taps, max_seq_len=1 << 16, global_layers=(0,))
    g = model.geometry
    for pos0 in (5000, 65530):
        raw = random_raw(rng, g, 6)
        runner = Runner(device, model, 0, context=1 << 16, int8=int8, chunk=6)
        q, _, entries = run_schedule(runner, raw, (6,), pos0=pos0, attend=False)
        qh, kh, vh = reference_heads(g, model.layers[0], raw, pos0 + np.arange(6))
        check_heads(g, int8, q, entries, qh, kh, vh)


@pytest.mark.parametrize("bits", [0, 2, 4], ids=["q-only", "cq2", "cq4"])
def test_qkv_post_deploy(device, tiny, bits):
    """Deploy numerics with an f32 cache (§4.9 points 4-5): q A8 per head, and K/V replaced by
    their CQ round trip at group 64 (reference.ops.cq_fake_quant). A head vector whose rotated
    value sits within f32 noise of a level boundary may pick the neighbour level (the GPU's
    conv/norm/RoPE differ from the reference by ulps): at most 3% of vectors may differ, the
    rest agree to 1e-5 of their size."""
    from needle_wgpu.constants import kv_cq_levels
    from needle_wgpu.reference.ops import cq_fake_quant

    g = tiny.geometry
    rng = np.random.default_rng(40 + bits)
    raw = random_raw(rng, g, 40)
    book = {2: (-1.5104, -0.4528, 0.4528, 1.5104),
            4: (-2.7326, -2.069, -1.618, -1.2562, -0.9423, -0.6568, -0.388, -0.1284, 0.1284, 0.388, 0.6568,
                0.9423, 1.2562, 1.618, 2.069, 2.7326)}.get(bits, ())  # Lloyd–Max of N(0, 1)
    levels = kv_cq_levels([x / np.sqrt(128) for x in book], 128)
    runner = Runner(device, tiny, 0, context=64, int8=False, chunk=8, q_quant=True, kv_levels=levels)
    q, _, (k, v) = run_schedule(runner, raw, (8, 8, 8, 8, 8), attend=False)
    qh, kh, vh = reference_heads(g, tiny.layers[0], raw, np.arange(40))
    q = q.reshape(qh.shape)
    q_scale = np.abs(q).max(axis=-1) / F32(127)
    check_quantised(np.rint(q / q_scale[..., None]).astype(np.int8), q_scale, qh)
    for got, x in ((k, kh), (v, vh)):
        want = cq_fake_quant(x, np.array(levels, F32)) if bits else x
        size = np.abs(want).max(axis=-1) + 1e-30
        close = np.abs(got - want).max(axis=-1) <= 1e-5 * size
        assert close.mean() >= 0.97, (bits, close.mean())
        if bits:
            assert np.abs(want - x).max() > 1e-2  # the round trip changes the vectors


def nudge(x, ulps):
    """x moved by `ulps` representable f32 steps (negative: towards -inf)."""
    for _ in range(abs(ulps)):
        x = np.nextafter(x, F32(np.inf if ulps > 0 else -np.inf), dtype=F32)
    return x


def test_int8_rounding_exact(device, tiny):
    """With no conv, V reaches the quantiser as the raw f32 values, so the GPU's integers must
    equal quantize_rows exactly: exact .5 ties round half to even, and values a few ulps from a
    tie round as the correctly rounded quotient does (the shader does not trust WGSL division)."""
    rng = np.random.default_rng(5)
    model = synthetic(device, tiny.geometry, rng, num_heads=2, num_kv_heads=2, qk_head_dim=8, v_head_dim=64,
                      qkv_conv_taps=0, global_layers=(0,))
    g, T = model.geometry, 8
    raw = random_raw(rng, g, T)
    v = raw[:, g.q_dim + g.k_dim : g.q_dim + g.k_dim + g.v_dim].reshape(T, 2, 64)
    v[0, 0] = 0.0
    v[0, 0, :9] = (127.0, 2.5, -3.5, 0.5, 1.5, -0.5, -2.5, 126.5, -127.0)  # scale exactly 1
    v[0, 1] = 0.0  # an all-zero vector: scale 1, integers 0
    for t in range(1, T):  # every element within 3 ulps of a .5 tie of its row's scale
        for h in range(2):
            absmax = F32(rng.uniform(0.01, 100.0))
            scale = absmax / F32(127)
            ties = (rng.integers(-127, 127, 63) + F32(0.5)) * scale
            nudged = [nudge(x, int(n)) for x, n in zip(ties.astype(F32), rng.integers(-3, 4, 63))]
            v[t, h] = np.concatenate(([absmax], nudged)).astype(F32)
    runner = Runner(device, model, 0, context=16, int8=True, chunk=T)
    _, _, (_, _, v8, v_scale) = run_schedule(runner, raw, (T,), attend=False)
    want_int, want_scale = quantize_rows(v)
    np.testing.assert_array_equal(v_scale, want_scale[..., 0])
    np.testing.assert_array_equal(v8, want_int)
    np.testing.assert_array_equal(v8[0, 0, :9], (127, 2, -4, 0, 2, 0, -2, 126, -127))


def reference_output(g, layer, int8, q, entries, raw, positions, keep=None):
    """o = attend(q, the given cache entries) ⊙ σ(g) (§4.5 items 8-9); ``keep``: the pad mask (§U a)."""
    heads = q.reshape(len(q), g.num_heads, -1)
    attended = ref.attend(heads, positions, entries, positions, g.attention_span(layer), int8, key_keep=keep)
    return attended.reshape(len(q), -1) * sigmoid(gate_of(g, raw))


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("layer", [0, 2], ids=["local", "global"])
def test_attention_prefill_and_decode(device, tiny, layer, int8):
    """40 positions (window 16; the local cache of 31 slots wraps) in chunks of 16 and as 40
    decode steps: both equal the reference, and each other bit for bit (§6: decode = prefill)."""
    g = tiny.geometry
    rng = np.random.default_rng(100 + layer + 10 * int8)
    N = 40
    raw = random_raw(rng, g, N)
    positions = np.arange(N)
    qh, kh, vh = reference_heads(g, tiny.layers[layer], raw, positions)
    results = []
    for chunks in ((16, 16, 8), (1,) * N):
        runner = Runner(device, tiny, layer, context=64, int8=int8, chunk=16)
        assert runner.cache.slots == (64 if layer in g.global_layers else 16 + 16 - 1)
        q, o, entries = run_schedule(runner, raw, chunks)
        check_heads(g, int8, q, entries, qh, kh, vh)
        if int8:  # the reference int8 attention on exactly what the GPU stored (§6 item 1)
            want = reference_output(g, layer, True, q, entries, raw, positions)
        else:
            want = reference_output(g, layer, False, qh.reshape(N, -1), (kh, vh), raw, positions)
        assert rel(o, want) <= GATE
        results.append((q, o, entries))
    (q1, o1, e1), (q2, o2, e2) = results
    np.testing.assert_array_equal(q1, q2)
    np.testing.assert_array_equal(o1, o2)
    for a, b in zip(e1, e2):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("layer", [0, 2], ids=["local", "global"])
def test_pad_mask_in_qkv_post_and_attention(device, tiny, layer, int8):
    """With the pad tokens bound (upstream's hidden cells, §U a): conv taps j >= 1 reading id 0
    and keys at id 0 are skipped, across chunks and the ring; position 0 (a pad) sees no key
    and gets zeros. The unmasked result differs, so the test sees the mask."""
    g = tiny.geometry
    rng = np.random.default_rng(300 + layer + 10 * int8)
    N = 40
    ids = rng.integers(4, 500, N)
    ids[[0, 3, 15, 16, 17, 30]] = 0  # pads at the start and around the chunk edges
    keep = ids != 0
    raw, positions = random_raw(rng, g, N), np.arange(N)
    qh, kh, vh = reference_heads(g, tiny.layers[layer], raw, positions, keep)
    runner = Runner(device, tiny, layer, context=64, int8=int8, chunk=16, pad_ids=np.append(ids, 0))
    q, o, entries = run_schedule(runner, raw, (16, 16, 8))
    check_heads(g, int8, q, entries, qh, kh, vh)
    if int8:
        want = reference_output(g, layer, True, q, entries, raw, positions, keep)
    else:
        want = reference_output(g, layer, False, qh.reshape(N, -1), (kh, vh), raw, positions, keep)
        plain_qh, plain_kh, plain_vh = reference_heads(g, tiny.layers[layer], raw, positions)
        plain = reference_output(g, layer, False, plain_qh.reshape(N, -1), (plain_kh, plain_vh), raw, positions)
        assert rel(plain, want) > 1e-2
    assert rel(o, want) <= GATE
    assert not o[0].any()


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("kind", ["local", "global"])
@pytest.mark.parametrize("heads, kv_heads, qk, vd", [(3, 1, 10, 6), (6, 3, 14, 20)])
def test_attention_odd_sizes(device, tiny, heads, kv_heads, qk, vd, kind, int8):
    """Odd head counts and widths (int8 rows padded), window 5, 21 positions in chunks of 8."""
    rng = np.random.default_rng(heads + qk + 5 * int8 + (kind == "local"))
    model = synthetic(device, tiny.geometry, rng, num_heads=heads, num_kv_heads=kv_heads, qk_head_dim=qk,
                      v_head_dim=vd, qkv_conv_taps=2, sliding_window=5,
                      global_layers=(0,) if kind == "global" else ())
    g, N = model.geometry, 21
    raw = random_raw(rng, g, N)
    positions = np.arange(N)
    runner = Runner(device, model, 0, context=32, int8=int8, chunk=8)
    q, o, entries = run_schedule(runner, raw, (8, 8, 5))
    qh, kh, vh = reference_heads(g, model.layers[0], raw, positions)
    check_heads(g, int8, q, entries, qh, kh, vh)
    if int8:
        want = reference_output(g, 0, True, q, entries, raw, positions)
    else:
        want = reference_output(g, 0, False, qh.reshape(N, -1), (kh, vh), raw, positions)
    assert rel(o, want) <= GATE


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("layer", [0, 1], ids=["global", "local"])
def test_attention_long_span(device, tiny, layer, int8):
    """Shipped head sizes (qk 48, vd 64, 6 query heads per kv head) at a context of 8192: a
    global layer attends over 8192 keys (32 blocks), a local one over its 1024-key window.
    Sharp scores (|s| up to ~30) put the maximum in varying blocks; the cache is filled directly."""
    rng = np.random.default_rng(7 + layer + 2 * int8)
    base = tiny.geometry
    g = replace(base, num_layers=2, num_heads=12, num_kv_heads=2, qk_head_dim=48, v_head_dim=64,
                max_seq_len=8192, sliding_window=1024, global_layers=(0,))
    T, N = 3, 8192
    pos0 = N - T
    positions = np.arange(N)
    cache = ops.KvCache(device, ops.needle3_shape(g, layer), N, int8, chunk=T)
    kept = positions[positions >= N - cache.slots]
    k = rng.normal(size=(N, g.num_kv_heads, g.qk_head_dim)).astype(F32)
    v = rng.normal(size=(N, g.num_kv_heads, g.v_head_dim)).astype(F32)
    q = (rng.normal(size=(T, g.num_heads, g.qk_head_dim)) * 6.0).astype(F32)
    if int8:
        q = fake_quant(q)
        (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
        entries = (k8, ks[..., 0], v8, vs[..., 0])
    else:
        entries = (k, v)
    fill_cache(device, cache, tuple(e[kept] for e in entries), kept)
    raw = random_raw(rng, g, T)  # only the gate part is read
    got = run_attention(device, ops.needle3_shape(g, layer), cache, q, pos0, gate=upload(device, raw, "qkvg"),
                        int8=int8)
    query_positions = pos0 + np.arange(T)
    attended = ref.attend(q, query_positions, entries, positions, g.attention_span(layer), int8)
    want = attended.reshape(T, -1) * sigmoid(gate_of(g, raw))
    assert rel(got, want) <= LONG_GATE


def test_cache_sizes(device, tiny):
    """Slots per layer and bytes: int8 rows carry one f32 scale per (slot, kv head) (§6 item 1)."""
    g = tiny.geometry
    for layer, int8, slots in ((0, False, 16 + 63), (2, False, 256), (0, True, 16 + 63), (2, True, 256)):
        cache = ops.KvCache(device, ops.needle3_shape(g, layer), 256, int8)
        assert cache.slots == slots
        per_slot = g.num_kv_heads * ((g.qk_head_dim + g.v_head_dim) // 4 + 2 if int8 else g.qk_head_dim + g.v_head_dim)
        assert cache.nbytes == 4 * slots * per_slot
    short = ops.KvCache(device, ops.needle3_shape(g, 0), 20, False)
    assert short.slots == 20  # the context is shorter than window + chunk - 1: no wrap at all
    with pytest.raises(DeviceLimitError):
        ops.KvCache(device, ops.needle3_shape(g, 0), 256, False, chunk=4).check_chunk(8)
