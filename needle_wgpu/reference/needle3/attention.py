"""The attention half of a Needle 3 block in NumPy float32 (spec §4.5 items 2-11, §6 item 1).

Each function is one step of §4.5; the model strings them together and owns the state
(convolution tails, K/V cache). Attention takes the keys and values as explicit arrays with
their absolute positions, so one function serves the whole-sequence form, a chunked prefill
and a decode step reading a ring buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import constants
from . import cq
from ..ops import F32, dot_rows, head_norm, rope, sigmoid, zc_rms_norm
from ..ops import softcap as ops_softcap


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """One layer's attention weights (§8 layer records +0 … +12)."""

    norm_in: np.ndarray  # [d]
    q_proj: cq.CQMatrix  # [H·qk, d]
    k_proj: cq.CQMatrix  # [KV·qk, d]
    v_proj: cq.CQMatrix  # [KV·v, d]
    q_taps: np.ndarray | None  # [taps, H·qk]; None when qkv_conv_taps = 0
    k_taps: np.ndarray | None
    v_taps: np.ndarray | None
    q_norm: np.ndarray  # [qk], shared by all query heads
    k_norm: np.ndarray  # [qk], shared by all kv heads
    gate_proj: cq.CQMatrix  # [H·v, d]
    out_proj: cq.CQMatrix  # [d, H·v]
    post_norm: np.ndarray  # [d]
    attn_gate: float  # pre-sigmoid residual gate


def project(h: np.ndarray, p: AttentionParams) -> tuple:
    """q, k, v and the output gate g from the normed block input h [T, d] (§4.5 item 3).

    The four CQ products share one prepared activation (§5.5.1).
    """
    prepared = cq.prepare_input(h, p.q_proj.group)
    return tuple(cq.matmul_prepared(w, prepared) for w in (p.q_proj, p.k_proj, p.v_proj, p.gate_proj))


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """[T, heads·hd] → [T, heads, hd]; head h holds elements [h·hd, (h+1)·hd) (§4.5 item 5)."""
    return x.reshape(x.shape[0], heads, -1)


def position_heads(x: np.ndarray, heads: int, norm: np.ndarray, positions: np.ndarray,
                   theta: float) -> np.ndarray:
    """Query or key heads after the conv: split, per-head ZCRMSNorm, then RoPE (§4.5 items 5-7)."""
    return rope(head_norm(split_heads(x, heads), norm), positions, theta)


def visible(query_positions: np.ndarray, key_positions: np.ndarray, span: int) -> np.ndarray:
    """Which keys each query sees: causal and inside the span, itself included (§4.5 item 8).

    Key n is visible from query t when n ≤ t and t − n < span, i.e. n ∈ [max(0, t−span+1), t].
    Global layers pass a span of at least the whole context.
    """
    distance = query_positions[:, None] - key_positions[None, :]
    return (distance >= 0) & (distance < span)


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Two-pass softmax over the visible keys (last axis), weights times 1/sum (§4.10)."""
    e = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    return e * (F32(1) / np.sum(e, axis=-1, keepdims=True))


def attend_one(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float | None = None,
               softcap: float = 0.0) -> np.ndarray:
    """One query position over exactly its visible keys (§4.5 item 8).

    q [H, hd], keys [n, KV, hd], values [n, KV, vd] → [H, vd]. Query head hq reads kv head
    ⌊hq / (H/KV)⌋; score = (q·k)·scale (default the f32 of 1/sqrt(hd)), soft-capped when
    ``softcap`` > 0 (dense §3, gemma2: ``ops.softcap``); o = Σ_n softmax_n(score)·v_n.
    """
    heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(kv_heads, heads // kv_heads, head_dim)
    inv_sqrt = F32(constants.inv_sqrt(head_dim) if scale is None else scale)

    def scores(kv):
        s = dot_rows(grouped[kv], keys[:, kv]) * inv_sqrt
        return ops_softcap(s, softcap) if softcap else s
    out = [dot_rows(_softmax(scores(kv)), values[:, kv].T) for kv in range(kv_heads)]
    return np.concatenate(out, axis=0)


def attend_one_int8(q: np.ndarray, keys_i8: np.ndarray, key_scales: np.ndarray, values_i8: np.ndarray,
                    value_scales: np.ndarray) -> np.ndarray:
    """One query position over an int8 cache with hoisted scales (§6 item 1, int8 mode).

    keys_i8 [n, KV, hd] and values_i8 [n, KV, vd] are int8 with one f32 scale per (position,
    kv head) ([n, KV]). score = (Σ_i q_i·k_i8) · k_scale / sqrt(hd); values are accumulated as
    Σ_n (p_n · v_scale_n) · v_i8_n. q is the per-head A8 query, already dequantised to f32.
    """
    heads, head_dim = q.shape
    kv_heads = keys_i8.shape[1]
    grouped = q.reshape(kv_heads, heads // kv_heads, head_dim)
    inv_sqrt = F32(constants.inv_sqrt(head_dim))
    out = []
    for kv in range(kv_heads):
        scores = dot_rows(grouped[kv], keys_i8[:, kv].astype(F32)) * key_scales[:, kv] * inv_sqrt
        weights = _softmax(scores) * value_scales[:, kv]
        out.append(dot_rows(weights, values_i8[:, kv].T.astype(F32)))
    return np.concatenate(out, axis=0)


def attend(q: np.ndarray, query_positions: np.ndarray, entries: tuple, key_positions: np.ndarray,
           span: int, int8: bool = False, scale: float | None = None,
           key_keep: np.ndarray | None = None, softcap: float = 0.0) -> np.ndarray:
    """Attention of T query positions (§4.5 item 8, §6 item 1): q [T, H, hd] → [T, H, vd].

    `entries` are the cached per-position arrays, aligned with `key_positions`: (keys, values)
    in f32, or (keys_i8, key_scales, values_i8, value_scales) with `int8`. Each query reads
    exactly its visible keys, so a position's result does not depend on what else is batched.
    ``scale``: the f32 score scale of an f32 cache (default 1/sqrt(hd); dense §3 lets the family
    choose it; ``softcap``: gemma2's score cap, f32 caches). ``key_keep`` (bool per key): keys it marks False are never seen (the pad mask
    of upstream's hidden cells, §U a); a query that sees no key gets zeros.
    """
    rows = []
    width = entries[-2].shape[-1] if int8 else entries[-1].shape[-1]
    for t in range(q.shape[0]):
        sees = visible(query_positions[t : t + 1], key_positions, span)[0]
        if key_keep is not None:
            sees = sees & key_keep
            if not sees.any():
                rows.append(np.zeros((q.shape[1], width), F32))
                continue
        seen = tuple(entry[sees] for entry in entries)
        rows.append(attend_one_int8(q[t], *seen) if int8 else attend_one(q[t], *seen, scale=scale, softcap=softcap))
    return np.stack(rows) if rows else np.zeros((0, q.shape[1], width), F32)


def output(o: np.ndarray, g: np.ndarray, p: AttentionParams, act=None) -> np.ndarray:
    """a = ZCRMSNorm(Wout·act(o ⊙ σ(g)); post_norm) (§4.5 items 9-10): the gate is elementwise;
    ``act`` (deploy numerics: A8 of the whole gated vector, §4.9 point 6) defaults to none."""
    gated = o.reshape(o.shape[0], -1) * sigmoid(g)
    if act is not None:
        gated = act(gated)
    return zc_rms_norm(cq.matmul(p.out_proj, gated), p.post_norm)


def residual(bx: np.ndarray, a: np.ndarray, attn_gate: float) -> np.ndarray:
    """bx + σ(attn_gate)·a (§4.5 item 11)."""
    return bx + sigmoid(F32(attn_gate)) * a
