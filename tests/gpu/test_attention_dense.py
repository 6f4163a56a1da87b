"""qk_rope and ungated attention on the GPU vs the NumPy reference (dense spec §3).

Small synthetic shapes of every dense variant: qwen2 biases, qwen3/gemma3 per-head QK-norm,
OLMoE's full-width norm, llama's adjacent pairs vs NeoX, partial rotary, GQA, Gemma's sliding
window and query scale; RoPE at positions up to 65530 (the Cody-Waite reduction).
"""

import numpy as np
import pytest

from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.gpu import Binding, Plan, UniformArena
from needle_wgpu.kernels import attention as ops
from needle_wgpu.kernels.attention import AttentionShape
from needle_wgpu.reference.needle3 import attention as ref
from needle_wgpu.reference.dense_attention import position_heads

from .parity import GATE, LONG_GATE, download, fill_cache, read_cache, rel, run_attention, upload

pytestmark = pytest.mark.gpu
F32 = np.float32

SHAPES = {
    "qwen2": AttentionShape(4, 2, 16, 16, rope_base=1e6, bias=True),
    "qwen3": AttentionShape(6, 2, 32, 32, rope_base=1e6, norm="head"),
    "llama": AttentionShape(3, 1, 16, 8, rope="adjacent", rope_base=1e5, eps=1e-5),
    "partial-neox": AttentionShape(4, 4, 24, 12, rotary_dims=8, norm="head", bias=True),
    "partial-adjacent": AttentionShape(2, 1, 20, 20, rope="adjacent", rotary_dims=12, eps=1e-5),
    "olmoe": AttentionShape(4, 2, 16, 16, norm="full"),
    "gemma3": AttentionShape(4, 1, 256, 256, norm="head", scale=1 / 16),
    "gemma3-global": AttentionShape(4, 1, 64, 64, rope_base=1e6, rope_scale=0.125, norm="head", scale=1 / 8),
    "no-rope": AttentionShape(2, 2, 8, 8, rope="none", bias=True),
    # gemma2: scores soft-capped at 50 (here 2, so the cap bends most of them)
    "gemma2": AttentionShape(4, 2, 32, 32, scale=1 / 8, softcap=2.0),
}


class Layer:
    """Random projections' companions: norm weights and biases, packed into one f32 buffer."""

    def __init__(self, device, shape, rng):
        sh = shape
        full = sh.norm == "full"
        self.arrays = {
            "q_norm": 1 + 0.3 * rng.normal(size=sh.q_width if full else sh.qk_dim),
            "k_norm": 1 + 0.3 * rng.normal(size=sh.k_width if full else sh.qk_dim),
            "q_bias": 0.5 * rng.normal(size=sh.q_width),
            "k_bias": 0.5 * rng.normal(size=sh.k_width),
            "v_bias": 0.5 * rng.normal(size=sh.v_width),
        }
        self.arrays = {name: value.astype(F32) for name, value in self.arrays.items()}
        self.offsets, at = {}, 0
        for name, value in self.arrays.items():
            self.offsets[f"{name}_at"] = at + 3  # not at 0: offsets are honoured
            at += value.size + 3
        flat = np.zeros(at, F32)
        for name, value in self.arrays.items():
            start = self.offsets[f"{name}_at"]
            flat[start : start + value.size] = value
        self.vectors = upload(device, flat, "vectors")

    def reference(self, shape, qkv, positions):
        sh = shape
        q, k = qkv[:, : sh.q_width], qkv[:, sh.q_width : sh.q_width + sh.k_width]
        v = qkv[:, sh.q_width + sh.k_width :]
        return position_heads(sh, q, k, v, positions, **self.arrays)


class Runner:
    """qk_rope (and attention) for one shape and cache mode, chunk by chunk at any pos0."""

    def __init__(self, device, shape, layer, context, chunk, mode="f32"):
        self.device, self.shape, self.layer = device, shape, layer
        sh = shape
        self.cache = ops.KvCache(device, sh, context, chunk=chunk, name="kv_cache.dense", mode=mode)
        self.partials = ops.attention_partials(device, [sh], [self.cache], chunk)
        self.qkv = device.buffer(4 * chunk * (sh.q_width + sh.k_width + sh.v_width), label="qkv")
        self.q = device.buffer(4 * chunk * sh.q_width, label="q")
        self.o = device.buffer(4 * chunk * sh.out_width, label="o")
        self.step = device.buffer(16, label="step", usage="uniform")
        self.plans = {}

    def plan(self, T, attend):
        if (T, attend) not in self.plans:
            arena, plan = UniformArena(self.device, capacity=1 << 12), Plan(self.device, f"dense T={T}")
            step = Binding(self.step)
            ops.qk_rope(plan, arena, step, shape=self.shape, qkv=self.qkv, q_out=self.q, cache=self.cache,
                        positions=T, vectors=self.layer.vectors, **self.layer.offsets)
            if attend:
                ops.attention(plan, arena, step, shape=self.shape, q=self.q, cache=self.cache, o=self.o,
                              positions=T, partials=self.partials)
            self.plans[(T, attend)] = (plan, arena)
        return self.plans[(T, attend)][0]

    def run(self, pos0, qkv, attend):
        T, sh = len(qkv), self.shape
        self.device.write(self.qkv, np.ascontiguousarray(qkv, F32).tobytes())
        self.device.write(self.step, np.array([pos0, 0, 0, 0], np.uint32).tobytes())
        self.device.run(self.plan(T, attend))
        slots = (pos0 + np.arange(T)) % self.cache.slots
        k, v = (e[slots] for e in read_cache(self.device, self.cache))
        o = download(self.device, self.o, (T, sh.out_width)) if attend else None
        return download(self.device, self.q, (T, sh.q_width)), o, k, v

    def schedule(self, qkv, chunks, pos0=0, attend=False):
        outs, at = [], 0
        for T in chunks:
            outs.append(self.run(pos0 + at, qkv[at : at + T], attend))
            at += T
        return [np.concatenate(part) if part[0] is not None else None for part in zip(*outs)]


def random_qkv(rng, shape, n):
    width = shape.q_width + shape.k_width + shape.v_width
    scale = rng.uniform(0.3, 3.0, size=(n, 1))
    return (rng.normal(size=(n, width)) * scale).astype(F32)


@pytest.mark.parametrize("name", list(SHAPES))
def test_qk_rope_matches_reference(device, name):
    """Two chunks from position 0, then chunks at positions near 3000 and 65530."""
    shape = SHAPES[name]
    rng = np.random.default_rng(len(name))
    layer = Layer(device, shape, rng)
    windowed = AttentionShape(**{**shape.__dict__, "window": 4})  # a ring of 4 + 7 - 1 slots
    runner = Runner(device, windowed, layer, context=1 << 16, chunk=7)
    for pos0, chunks in ((0, (5, 7)), (3001, (6,)), (65530, (6,))):
        qkv = random_qkv(rng, shape, sum(chunks))
        q, _, k, v = runner.schedule(qkv, chunks, pos0)
        qh, kh, vh = layer.reference(shape, qkv, pos0 + np.arange(len(qkv)))
        assert rel(q, qh.reshape(len(q), -1)) <= GATE, pos0
        assert rel(k, kh) <= GATE, pos0
        assert rel(v, vh) <= GATE, pos0
        if shape.rope_dims < shape.qk_dim:  # the unrotated dims are the normed values, unchanged
            unrotated = position_heads(AttentionShape(**{**shape.__dict__, "rope": "none"}),
                                       *np.split(qkv, [shape.q_width, shape.q_width + shape.k_width], axis=1),
                                       pos0 + np.arange(len(qkv)), **layer.arrays)[0]
            tail = q.reshape(qh.shape)[..., shape.rope_dims :]
            assert rel(tail, unrotated[..., shape.rope_dims :]) <= GATE


def test_rope_pairing_differs(device):
    """adjacent and NeoX give different results on the same input (the pairing is honoured)."""
    results = []
    for style in ("adjacent", "neox"):
        shape = AttentionShape(2, 1, 16, 16, rope=style)
        layer = Layer(device, shape, np.random.default_rng(0))
        runner = Runner(device, shape, layer, context=64, chunk=4)
        qkv = random_qkv(np.random.default_rng(1), shape, 4)
        results.append(runner.schedule(qkv, (4,), pos0=9)[0])
        qh = layer.reference(shape, qkv, 9 + np.arange(4))[0]
        assert rel(results[-1], qh.reshape(4, -1)) <= GATE
    assert rel(results[0], results[1]) > 0.1


@pytest.mark.parametrize("name, window", [("qwen3", None), ("llama", 5), ("gemma3", 5), ("partial-neox", None),
                                          ("gemma2", 5), ("gemma2", None)])
def test_dense_attention_prefill_and_decode(device, name, window):
    """21 positions in chunks of 8 and as 21 decode steps: both equal the reference (GQA, the
    sliding window p - window < s <= p, the shape's scale) and each other bit for bit."""
    shape = AttentionShape(**{**SHAPES[name].__dict__, "window": window})
    rng = np.random.default_rng(40 + len(name))
    layer = Layer(device, shape, rng)
    N = 21
    qkv = random_qkv(rng, shape, N)
    positions = np.arange(N)
    qh, kh, vh = layer.reference(shape, qkv, positions)
    span = N if window is None else window
    want = ref.attend(qh, positions, (kh, vh), positions, span, scale=shape.score_scale,
                      softcap=shape.softcap).reshape(N, -1)
    if shape.softcap:  # the cap changes the result
        uncapped = ref.attend(qh, positions, (kh, vh), positions, span, scale=shape.score_scale).reshape(N, -1)
        assert rel(uncapped, want) > 1e-2
    results = []
    for chunks in ((8, 8, 5), (1,) * N):
        runner = Runner(device, shape, layer, context=32, chunk=8)
        q, o, k, v = runner.schedule(qkv, chunks, attend=True)
        assert rel(o, want) <= GATE
        results.append((q, o, k, v))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    if window is not None:  # the window changes the result (the mask is applied)
        wide = ref.attend(qh, positions, (kh, vh), positions, N, scale=shape.score_scale,
                          softcap=shape.softcap).reshape(N, -1)
        assert rel(wide, want) > 1e-3


@pytest.mark.parametrize("window", [None, 1024], ids=["global", "window"])
def test_dense_attention_long_span(device, window):
    """4096 keys (global) or a 1024-key window at positions near 4096, 4 query heads per kv head."""
    rng = np.random.default_rng(11 + (window or 0))
    shape = AttentionShape(8, 2, 64, 64, window=window)
    T, N = 3, 4096
    pos0 = N - T
    positions = np.arange(N)
    cache = ops.KvCache(device, shape, N, chunk=T)
    kept = positions[positions >= N - cache.slots]
    k = rng.normal(size=(N, 2, 64)).astype(F32)
    v = rng.normal(size=(N, 2, 64)).astype(F32)
    q = (rng.normal(size=(T, 8, 64)) * 6.0).astype(F32)
    fill_cache(device, cache, (k[kept], v[kept]), kept)
    want = ref.attend(q, pos0 + np.arange(T), (k, v), positions, window or N).reshape(T, -1)
    assert rel(run_attention(device, shape, cache, q, pos0), want) <= LONG_GATE


def test_shape_checks(device):
    with pytest.raises(ValueError):
        AttentionShape(6, 4, 16, 16)  # 6 heads do not share 4 kv heads evenly
    with pytest.raises(ValueError):
        AttentionShape(4, 2, 16, 16, rotary_dims=18)
    with pytest.raises(ValueError):
        AttentionShape(4, 2, 16, 16, rope="interleaved")
    shape = SHAPES["qwen3"]
    cache = ops.KvCache(device, shape, 16, chunk=4)
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "checks")
    buf = device.buffer(4096, label="scratch")
    with pytest.raises(ValueError):  # norms need the vectors buffer
        ops.qk_rope(plan, arena, Binding(buf), shape=shape, qkv=buf, q_out=buf, cache=cache, positions=4)
    with pytest.raises(UnsupportedModelError):
        ops.qk_rope(plan, arena, Binding(buf), shape=AttentionShape(4, 2, 16, 16, norm="zc"), qkv=buf, q_out=buf,
                    cache=cache, positions=4)
    with pytest.raises(UnsupportedModelError):
        ops.qkv_post(plan, arena, Binding(buf), shape=shape, fp16_store=None, layer=0, qkvg=buf, ring=buf,
                     ring_size=8, q_out=buf, cache=cache, positions=4)
    with pytest.raises(UnsupportedModelError):
        AttentionShape(2, 1, 512, 64).check()


def _slab_step(device, slab, shape, layer, rows, qkv, sequences_rows=None):
    """One decode step of the batch ``rows`` (per row: its slot, or None for a row of no slab) at
    their positions: each row alone (``sequences_rows`` None: qk_rope and attention on its own
    cache, as a session's decode step) or every row of a page in one dispatch each. Returns o."""
    sh, B = shape, len(rows)
    width = sh.q_width + sh.k_width + sh.v_width
    qkv_buf = upload(device, qkv, "qkv")
    q = device.buffer(4 * B * sh.q_width, label="q")
    o = upload(device, np.full((B, sh.out_width), 7.0, F32), "o")  # a skipped row keeps its 7s
    arena, plan = UniformArena(device, capacity=1 << 14), Plan(device, "slab step")
    if sequences_rows is None:
        for b, (slot, position) in enumerate(rows):
            if slot is None:
                continue
            cache = slab.caches(slot)[0]
            step = Binding(device.buffer(16, label="step", usage="uniform",
                                         data=np.array([position, 0, 0, 0], np.uint32).tobytes()))
            partials = ops.attention_partials(device, [sh], [cache], 1)
            ops.qk_rope(plan, arena, step, shape=sh, qkv=qkv_buf, q_out=q, cache=cache, positions=1,
                        vectors=layer.vectors, q_offset=b * width, k_offset=b * width + sh.q_width,
                        v_offset=b * width + sh.q_width + sh.k_width, **layer.offsets)
            ops.attention(plan, arena, step, shape=sh, q=q, cache=cache,
                          o=Binding(o, 4 * b * sh.out_width, 4 * sh.out_width), positions=1, partials=partials)
    else:
        table = np.zeros((sequences_rows, 4), np.uint32)
        for b, (slot, position) in enumerate(rows):
            at, page = slab.place(slot) if slot is not None else (0, ops.NO_PAGE)
            table[b] = (position, at, page, 0)
        table_buf = device.buffer(table.nbytes, label="sequences", usage="uniform", data=table.tobytes())
        for page in sorted({slab.place(slot)[1] for slot, _ in rows if slot is not None}):
            seqs = ops.Sequences(Binding(table_buf), sequences_rows, page)
            cache = slab.page_cache(page, 0)
            ops.qk_rope(plan, arena, Binding(table_buf, 0, 16), shape=sh, qkv=qkv_buf, q_out=q, cache=cache,
                        positions=B, vectors=layer.vectors, sequences=seqs, **layer.offsets)
            ops.attention(plan, arena, Binding(table_buf, 0, 16), shape=sh, q=q, cache=cache, o=o, positions=B,
                          partials=slab.partials, sequences=seqs)
    device.run(plan)
    return download(device, o, (B, sh.out_width))


@pytest.mark.parametrize("name, window, mode, range_keys", [
    ("qwen3", None, "f32", None), ("llama", 5, "f32", None), ("gemma2", None, "f16", None),
    ("partial-neox", None, "f32", None), ("qwen2", 6, "f16", None)])
def test_sequences_rows_get_their_own_bits(device, name, window, mode, range_keys):
    """A batch's rows in one qk_rope and one attention dispatch per page of a ``KvSlab`` (each row
    at its own position over its own slot's cache; a row of no slab skipped) give every row the
    bits of its own decode step alone: the outputs and the K/V written. Pages of 2 slots, so a
    step takes two pages (the slab's page ids start at 5, as a batch's second slab's might)."""
    shape = AttentionShape(**{**SHAPES[name].__dict__, "window": window})
    rng = np.random.default_rng(7 + len(name))
    layer = Layer(device, shape, rng)
    context, lengths = 40, (9, 3, 17)  # positions already in slots 0, 1, 2
    slabs = [ops.KvSlab(device, [shape], context, 8, mode, capacity=4, range_keys=range_keys, per_page=2,
                        first_page=5) for _ in range(2)]
    for slab in slabs:
        assert [slab.take() for _ in range(3)] == [0, 1, 2] and slab.per_page == 2
    history = [random_qkv(rng, shape, n) for n in lengths]
    for slab in slabs:  # the same past in both, step by step
        for slot, past in enumerate(history):
            for p, row in enumerate(past):
                _slab_step(device, slab, shape, layer, [(slot, p)], row[None])
    rows = [(2, lengths[2]), (None, 0), (0, lengths[0]), (1, lengths[1])]
    own = [history[2]]  # row 0's q/k/v rows by position
    for step in range(3):
        qkv = random_qkv(rng, shape, len(rows))
        own.append(qkv[:1])
        alone = _slab_step(device, slabs[0], shape, layer, rows, qkv)
        together = _slab_step(device, slabs[1], shape, layer, rows, qkv, sequences_rows=4)
        np.testing.assert_array_equal(together, alone)
        assert (together[1] == 7.0).all()  # the row of no slab: untouched
        for slot in range(3):
            for a, b in zip(read_cache(device, slabs[0].caches(slot)[0]), read_cache(device, slabs[1].caches(slot)[0])):
                np.testing.assert_array_equal(a, b)
        rows = [(slot, p + 1) if slot is not None else (None, 0) for slot, p in rows]
    # and the outputs are attention's: row 0 (slot 2) against the reference over its own past
    own = np.concatenate(own)
    positions = np.arange(len(own))
    qh, kh, vh = layer.reference(shape, own, positions)
    span = window or context
    want = ref.attend(qh[-1:], positions[-1:], (kh, vh), positions, span, scale=shape.score_scale,
                      softcap=shape.softcap).reshape(1, -1)
    assert rel(together[:1], want) <= (GATE if mode == "f32" else 2e-3)
    for slab in slabs:
        for slot in range(3):
            slab.give(slot)
        assert not slab.pages and slab.partials is None


@pytest.mark.parametrize("name, window, mode", [("qwen3", None, "f32"), ("gemma2", None, "f16"), ("llama", 700, "f32"),
                                                ("qwen2", 600, "f16")])
def test_sequences_rows_merge_their_ranges(device, name, window, mode):
    """Caches of several ranges (1,100 slots in ranges of 256, or a window's ring): a batch's rows
    in one dispatch per page, each at its own position up to 1,000, write their partials to the
    slab's ``partials`` and merge them with the bits of their own decode steps alone."""
    shape = AttentionShape(**{**SHAPES[name].__dict__, "window": window})
    rng = np.random.default_rng(3 + len(name))
    layer = Layer(device, shape, rng)
    slabs = [ops.KvSlab(device, [shape], 1100, 8, mode, capacity=4, range_keys=256, per_page=2) for _ in range(2)]
    for slab in slabs:
        assert [slab.take() for _ in range(3)] == [0, 1, 2]
    assert ops.tiling(shape, slabs[0].layouts[0], 1).splits > 1 and slabs[0].partials.size > 16
    for slot in range(3):  # random cache contents, the same in both slabs
        words = slabs[0].layouts[0].words
        data = (rng.normal(size=2 * words).astype(np.float16) if mode == "f16" else
                rng.normal(size=words).astype(F32)).view(np.uint32)
        for slab in slabs:
            cache = slab.caches(slot)[0]
            device.write(cache.buffer, data.tobytes(), 4 * cache.base)
    rows = [(2, 1000), (None, 0), (0, 700), (1, 200)]
    for _ in range(2):
        qkv = random_qkv(rng, shape, len(rows))
        alone = _slab_step(device, slabs[0], shape, layer, rows, qkv)
        together = _slab_step(device, slabs[1], shape, layer, rows, qkv, sequences_rows=4)
        np.testing.assert_array_equal(together, alone)
        assert (together[1] == 7.0).all() and np.isfinite(together).all()
        rows = [(slot, p + 1) if slot is not None else (None, 0) for slot, p in rows]
