"""Next-token sampling in NumPy: the definition both GPU samplers (``sample.wgsl``, one workgroup,
and ``sample_staged.wgsl``, several passes) follow.

Spec §9 only says "greedy argmax, or temperature sampling"; this module fixes the rest so that
a sampled id is reproducible from (logits, settings, seed, position) alone, with no hidden
state: the random number is a counter-based hash of the seed and the absolute position of the
token being drawn.

Weights are integers (multiples of 2^-24 of the largest one), so every sum is exact and the
same in any order: a GPU may split the vocabulary over as many workgroups as it likes. The
float work is one subtract and one multiply per logit, both exactly rounded in WGSL; the
exponential is computed in integers (``fixed_exp``). So GPU and reference agree bit for bit on
every weight and id for id on every draw. The host-side constants (greedy, the weight scale,
top_p in 2^-24) come from ``needle_wgpu.sampling.sampler_constants``.

1. Keys: an order-preserving u32 of each logit's bits; NaN counts as -inf.
2. Greedy when the temperature (as float32) is not > 0, top_k == 1, top_p <= 0, no logit
   is finite, or a logit is +inf: the largest logit, lowest index on ties (0 when every logit is
   -inf or NaN).
3. Candidates: the K = top_k (0: all) largest logits, ties broken by lowest index.
4. Weights on candidates: with subnormal logits read as 0, x·2^24 = (l_i - max) · scale in
   float32 (scale = 2^24 · f32(1/temperature)); w_i = fixed_exp(trunc(-x·2^24)), within one
   unit of e^x · 2^24, when x >= -17, else 0; -inf, NaN and non-candidates weigh 0. The
   largest logit weighs exactly 2^24.
5. Nucleus (top_p < 1, p = floor(top_p · 2^24)): target = max(1, ceil(p · Σw / 2^24));
   θ = the largest key with Σ_{key >= θ} w >= target; candidates with key >= θ are kept (every
   tie at θ is kept). Without top_p, θ = 0 (every candidate).
4b. min_p (m = ceil(f32(min_p) · 2^24), 0 when off): candidates with w_i < m weigh 0. The
   largest weighs 2^24, so it always stays: min_p is relative to the most likely token at the
   temperature.
6. u = pcg(seed ^ pcg(position)) >> 8, 24 bits, with position = the absolute position of the
   drawn token (the logits row's position + 1); M = the kept mass, goal = floor(u · M / 2^24)
   < M. The pick is the first kept index, in index order, whose running sum of weights exceeds
   goal.

Before step 1, when asked (``process_logits``, the GPU's ``logits_process.wgsl``), in float32:
0a. logit_bias: l_id += bias for each (id, bias) pair (ids < rows).
0b. penalties over the window: the ids at the latest ``penalty_last_n`` positions up to and
    including the row's own (the prompt's included; ids >= rows are skipped), each id once with
    its count c: repetition (r != 1): l > 0 -> l · f32(1/r), else l · r; then
    l -= f32(c) · frequency + presence (llama.cpp's order).
"""

from __future__ import annotations

import numpy as np

from ..sampling import (EXP2_SIXTEENTHS, EXP_C3, EXP_C4, EXP_CUT, LN2_Q31, LOG2E_Q30, WEIGHT_ONE, WHOLE_CONTEXT,
                        Sampling, f32, min_weight, sampler_constants)
from .ops import F32

NEG_INF_KEY = 0x007FFFFF
POS_INF_KEY = 0xFF800000
U32 = 0xFFFFFFFF
U64 = np.uint64


def pcg_hash(x: int) -> int:
    """The PCG-RXS-M-XS output permutation of a 32-bit counter (all arithmetic mod 2^32)."""
    state = (x * 747796405 + 2891336453) & U32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & U32
    return (word >> 22) ^ word


def draw24(seed: int, position: int) -> int:
    """The 24 random bits of the draw for the token at ``position``."""
    return pcg_hash((seed & U32) ^ pcg_hash(position & U32)) >> 8


def uniform(seed: int, position: int) -> float:
    """The draw as a fraction in [0, 1)."""
    return draw24(seed, position) / float(WEIGHT_ONE)


def order_keys(logits: np.ndarray) -> np.ndarray:
    """u32 keys with key(a) < key(b) iff a < b; NaN gets the key of -inf (step 1)."""
    bits = np.asarray(logits, dtype=F32).view(np.uint32)
    keys = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, np.uint32(NEG_INF_KEY), keys).astype(np.uint32)


def key_values(keys: np.ndarray) -> np.ndarray:
    bits = np.where(keys & 0x80000000, keys & 0x7FFFFFFF, ~keys).astype(np.uint32)
    return bits.view(F32)


def _mulq(a, b):
    """(a · b) >> 31 for u32 a, b (Q31 products)."""
    return (a * b) >> U64(31)


def fixed_exp(z: np.ndarray) -> np.ndarray:
    """floor-ish(2^24 · e^(-z / 2^24)) for integers 0 <= z <= 17 · 2^24, in integer arithmetic
    only (the kernels' ``fixed_exp`` step for step): t = z · log2(e) in 2^-24 units; 2^-t is
    2^-floor(t) (a shift) · 2^-a/16 (a table) · e^(-s) (s < ln2/16: four Taylor terms), in Q31."""
    z = np.asarray(z, U64)
    t = (z * U64(LOG2E_Q30)) >> U64(30)
    n = t >> U64(24)
    s = ((t & U64(0xFFFFF)) * U64(LN2_Q31)) >> U64(24)
    h3 = U64(EXP_C3) - _mulq(s, U64(EXP_C4))
    h2 = U64(1 << 30) - _mulq(s, h3)
    h1 = U64(1 << 31) - _mulq(s, h2)
    p = U64(1 << 31) - _mulq(s, h1)
    table = np.array(EXP2_SIXTEENTHS, U64)[((t >> U64(20)) & U64(15)).astype(np.intp)]
    return _mulq(table, p) >> (U64(7) + n)


def weight_values(keys: np.ndarray) -> np.ndarray:
    """The logits the weights use: key values with subnormals read as 0 (a GPU may flush them)."""
    values = key_values(keys)
    subnormal = (values.view(np.uint32) & 0x7F800000) == 0
    return np.where(subnormal, F32(0), values).astype(F32)


def weights(keys: np.ndarray, top_key: int, scale: float) -> np.ndarray:
    """Step 4 for the given keys (all candidates): u64 multiples of 2^-24 (NaN's key is -inf's)."""
    top = weight_values(np.array([top_key], np.uint32))[0]
    with np.errstate(invalid="ignore", over="ignore"):
        x = (weight_values(keys) - top) * F32(scale)  # x · 2^24, float32
        inside = x >= F32(-EXP_CUT * WEIGHT_ONE)
        z = np.where(inside, -x, F32(0)).astype(U64)  # truncation, as u32(f32) on the GPU
    return np.where(inside, fixed_exp(z), U64(0)).astype(U64)


def greedy(logits: np.ndarray, mask=None) -> int:
    """The largest logit, lowest index on ties; NaN counts as -inf; all -inf/NaN -> 0 (with a
    mask: the lowest allowed id)."""
    keys = order_keys(logits)
    if mask is not None:
        keys = np.where(allowed_ids(mask, len(keys)), keys, np.uint32(0))
    return int(np.argmax(keys))  # argmax returns the first of equal maxima


def allowed_ids(mask, rows: int) -> np.ndarray:
    """A mask (bitmask bytes, bit i of byte i // 8, or a bool array) as a bool array of ``rows``."""
    if isinstance(mask, (bytes, bytearray, memoryview)):
        bits = np.unpackbits(np.frombuffer(bytes(mask), np.uint8), bitorder="little")
        return bits[:rows].astype(bool)
    return np.asarray(mask, bool).reshape(-1)[:rows]


def penalty_window(tokens, position: int, last_n: int) -> np.ndarray:
    """The ids the penalties look at for the row at ``position``: tokens[position - n + 1 ..
    position], n = last_n (-1: the whole context, so every position up to the row's)."""
    tokens = np.asarray(tokens, np.uint32).reshape(-1)
    n = position + 1 if last_n == WHOLE_CONTEXT else min(last_n, position + 1)
    return tokens[position + 1 - n : position + 1]


def process_logits(logits, s: Sampling, window=()) -> np.ndarray:
    """Steps 0a and 0b: the logits after logit_bias and the penalties over ``window`` (the ids,
    ``penalty_window``), float32; a copy, the input is left as it was."""
    x = np.array(logits, dtype=F32).reshape(-1)
    rows = len(x)
    for token, bias in s.logit_bias:
        if token < rows:
            x[token] = x[token] + F32(bias)
    if not s.penalized:
        return x
    ids, counts = np.unique(np.asarray(window, np.uint32), return_counts=True)
    keep = ids < rows
    ids, counts = ids[keep].astype(np.intp), counts[keep]
    r = F32(s.repetition_penalty)
    inverse = F32(f32(1.0 / float(r)))
    with np.errstate(invalid="ignore", over="ignore"):
        values = x[ids]
        values = np.where(values > 0, values * inverse, values * r).astype(F32)
        drop = (counts.astype(F32) * F32(s.frequency_penalty)).astype(F32) + F32(s.presence_penalty)
        x[ids] = (values - drop.astype(F32)).astype(F32)
    return x


def sample_with(logits, s: Sampling, position: int, tokens=(), mask=None) -> int:
    """The id for ``Sampling`` ``s`` with every step: ``tokens`` holds the ids by absolute
    position (at least up to the row's, ``position - 1``), ``position`` is the drawn token's."""
    window = penalty_window(tokens, position - 1, s.penalty_last_n) if s.penalized else ()
    x = process_logits(logits, s, window) if s.processes_logits else logits
    return sample(x, s.temperature, s.top_k, s.top_p, s.seed, position, mask=mask, min_p=s.min_p)


def sample(logits, temperature: float, top_k: int, top_p: float, seed: int, position: int, mask=None,
           min_p: float = 0.0) -> int:
    """The id the GPU samplers pick for these logits and settings (module docstring).

    ``position`` is the absolute position of the token being drawn (the row's position + 1).
    Settings are expected saturated (``needle_wgpu.sampling.Sampling``). ``mask``: the allowed
    ids (``allowed_ids``), or None for all.
    """
    logits = np.asarray(logits, dtype=F32).reshape(-1)
    rows = len(logits)
    keys = order_keys(logits)
    if mask is not None:
        keys = np.where(allowed_ids(mask, rows), keys, np.uint32(NEG_INF_KEY)).astype(np.uint32)
    max_key = int(keys.max())
    settings = Sampling(temperature, top_k, top_p, seed, min_p)
    settings_greedy, scale, top_k, p_fixed = sampler_constants(settings)
    if settings_greedy or max_key in (NEG_INF_KEY, POS_INF_KEY):
        return greedy(logits, mask)

    # Steps 3 and 4: the K largest, ties by lowest index (a stable sort on the key).
    count = rows if top_k == 0 else min(top_k, rows)
    by_key = np.argsort(-keys.astype(np.int64), kind="stable")
    candidates = by_key[:count]
    w = np.zeros(rows, np.uint64)
    w[candidates] = weights(keys[candidates], max_key, scale)
    w[w < np.uint64(min_weight(settings))] = 0  # step 4b

    # Step 5: walk the positive weights from the largest key down; all ties at θ stay.
    theta = 0
    if p_fixed < WEIGHT_ONE:
        total = int(w.sum())
        target = max(1, -(-(p_fixed * total) >> 24))
        ordered = by_key[w[by_key] > 0]
        reach = np.cumsum(w[ordered])
        theta = int(keys[ordered[int(np.searchsorted(reach, target, side="left"))]])

    # Step 6.
    kept = np.flatnonzero((keys >= np.uint32(theta)) & (w > 0))
    running = np.cumsum(w[kept])
    goal = (draw24(seed, position) * int(running[-1])) >> 24
    return int(kept[int(np.searchsorted(running, goal, side="right"))])
