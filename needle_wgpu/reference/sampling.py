"""Next-token sampling in NumPy float32: the definition the GPU kernel (``sample.wgsl``) follows.

Spec §9 only says "greedy argmax, or temperature sampling"; this module fixes the rest so that
a sampled id is reproducible from (logits, settings, seed, position) alone, with no hidden
state: the random number is a counter-based hash of the seed and the absolute position of the
token being drawn.

The work is laid out as the kernel does it (256 threads, thread ``t`` owning the contiguous
indices [t·items, (t+1)·items)), and every f32 sum is taken in the kernel's order, so the two
agree id for id except when a random draw falls within a few ulps of a boundary.

1. Keys: an order-preserving u32 of each logit's bits; NaN counts as -inf.
2. Greedy when temperature <= 0, top_k == 1, top_p <= 0, no logit is finite, or a logit is
   +inf: the largest logit, lowest index on ties (0 when every logit is -inf or NaN).
3. Candidates: the K = top_k (0: all) largest logits, ties broken by lowest index.
4. Weights w_i = exp((l_i - max) / temperature) on candidates (0 for -inf and the rest).
5. Nucleus (top_p < 1): θ = the largest key with Σ_{key >= θ} w >= top_p·Σ w; candidates with
   key >= θ are kept (all ties at θ are kept).
6. u = (pcg(seed ^ pcg(position)) >> 8) / 2^24, with position = the absolute position of the
   drawn token (the logits row's position + 1). The pick is the first nucleus index, in index
   order, whose running sum exceeds u·(nucleus mass); the running sum starts each thread at its
   share of a sequential exclusive scan of the per-thread sums (rounding past the end picks
   the last nucleus index).
"""

from __future__ import annotations

import numpy as np

from .ops import F32

THREADS = 256
NONE = 0xFFFFFFFF
NEG_INF_KEY = 0x007FFFFF
POS_INF_KEY = 0xFF800000
U32 = 0xFFFFFFFF


def pcg_hash(x: int) -> int:
    """The PCG-RXS-M-XS output permutation of a 32-bit counter (all arithmetic mod 2^32)."""
    state = (x * 747796405 + 2891336453) & U32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & U32
    return (word >> 22) ^ word


def uniform(seed: int, position: int) -> np.float32:
    """The draw in [0, 1): 24 random bits of pcg(seed ^ pcg(position)), exactly an f32."""
    draw = pcg_hash((seed & U32) ^ pcg_hash(position & U32))
    return F32(draw >> 8) * F32(1.0 / 16777216.0)


def order_keys(logits: np.ndarray) -> np.ndarray:
    """u32 keys with key(a) < key(b) iff a < b; NaN gets the key of -inf (step 1)."""
    bits = np.asarray(logits, dtype=F32).view(np.uint32)
    keys = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, np.uint32(NEG_INF_KEY), keys).astype(np.uint32)


def key_values(keys: np.ndarray) -> np.ndarray:
    bits = np.where(keys & 0x80000000, keys & 0x7FFFFFFF, ~keys).astype(np.uint32)
    return bits.view(F32)


def tree_sum(values: np.ndarray) -> np.float32:
    """The kernel's workgroup reduction of 256 f32 values (halving spans)."""
    v = np.array(values, dtype=F32)
    span = THREADS // 2
    while span:
        v[:span] = v[:span] + v[span : 2 * span]
        span //= 2
    return v[0]


def thread_sums(values: np.ndarray) -> np.ndarray:
    """Each thread's sequential sum over its items: values is [256, items]."""
    total = np.zeros(values.shape[0], F32)
    for e in range(values.shape[1]):
        total = total + values[:, e]
    return total


def greedy(logits: np.ndarray) -> int:
    """The largest logit, lowest index on ties; NaN counts as -inf; all -inf/NaN -> 0."""
    keys = order_keys(logits)
    return int(np.argmax(keys))  # argmax returns the first of equal maxima


def sample(logits, temperature: float, top_k: int, top_p: float, seed: int, position: int) -> int:
    """The id the GPU sampler picks for these logits and settings (module docstring).

    ``position`` is the absolute position of the token being drawn (the row's position + 1).
    Settings are expected saturated (``needle_wgpu.sampling.Sampling``).
    """
    logits = np.asarray(logits, dtype=F32).reshape(-1)
    rows = len(logits)
    items = -(-rows // THREADS)
    keys = np.zeros(THREADS * items, np.uint32)  # key 0 marks the padding past `rows`
    keys[:rows] = order_keys(logits)
    max_key = int(keys.max())
    temperature, top_p = F32(temperature), F32(top_p)
    if temperature <= 0 or top_k == 1 or top_p <= 0 or max_key in (NEG_INF_KEY, POS_INF_KEY):
        return greedy(logits)
    top = key_values(np.array([max_key], np.uint32))[0]

    # Step 3: the K largest, ties by lowest index (a stable sort on the key).
    count = rows if top_k == 0 else min(int(top_k), rows)
    candidate = np.zeros(THREADS * items, bool)
    if count < rows:
        order = np.argsort(-keys[:rows].astype(np.int64), kind="stable")
        candidate[order[:count]] = True
    else:
        candidate[:rows] = True

    # Step 4.
    real = candidate & (keys != NEG_INF_KEY)
    w = np.zeros(THREADS * items, F32)
    w[real] = np.exp((key_values(keys[real]) - top) / temperature)
    keys2, w2 = keys.reshape(THREADS, items), w.reshape(THREADS, items)
    total = tree_sum(thread_sums(w2))

    # Step 5: binary search on the key, as the kernel does it.
    def mass(theta: int) -> np.float32:
        return tree_sum(thread_sums(np.where(keys2 >= np.uint32(theta), w2, F32(0))))

    theta_p, nucleus = 0, total
    if top_p < 1:
        goal_mass = top_p * total
        lo, hi = 0, max_key
        while lo < hi:
            gap = hi - lo
            mid = lo + (gap >> 1) + (gap & 1)
            if mass(mid) >= goal_mass:
                lo = mid
            else:
                hi = mid - 1
        theta_p, nucleus = lo, mass(lo)

    # Step 6.
    goal = uniform(seed, position) * nucleus
    inside = (keys2 >= np.uint32(theta_p)) & (w2 > 0)
    shares = thread_sums(np.where(inside, w2, F32(0)))
    running = np.concatenate(([F32(0)], np.cumsum(shares, dtype=F32)[:-1])).astype(F32)
    found = np.full(THREADS, NONE, np.int64)
    last = np.full(THREADS, -1, np.int64)
    for e in range(items):
        index = np.arange(THREADS) * items + e
        step = inside[:, e]
        running = np.where(step, running + w2[:, e], running).astype(F32)
        last = np.where(step, index, last)
        found = np.where(step & (running > goal) & (found == NONE), index, found)
    if found.min() != NONE:
        return int(found.min())
    return int(last.max())
