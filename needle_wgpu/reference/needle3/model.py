"""The whole Needle 3 model in NumPy float32: the oracle every GPU kernel is tested against (spec §4).

`ReferenceModel.forward_sequence` is the whole-sequence ("prefill") form of §4 with no state;
`prefill` and `decode_step` run the same graph through a `KVCache` (§6), in f32 or int8 K/V.
``numerics="deploy"`` runs upstream's quant=True forward instead (§4.9): A8 at the seven points,
the query A8 per head and K/V by the KV mode (the header's kv_bits unless the caller names one).
Each step below calls one small function of ops / cq / engram / mhc / attention / hada_mlp,
in the order the spec lists them.
"""

from __future__ import annotations

import operator
from pathlib import Path

import numpy as np

from ... import constants
from ...models import needle3_numerics as numerics_rules
from ...errors import ContextFullError, InputError, UnsupportedModelError
from ...formats import cact
from ...inputs import checked_methods
from ...sampling import clamp_count
from . import attention, cq, engram, mhc
from .cache import KVCache, KvPrecision
from .hada_mlp import hada_mlp
from .ladder import rung_weights
from ...models.ladder import full_rung, rung
from .heads import CONFIDENCE, EMBEDDING, ROUTER, ProbePool, keep_positions, probe_logit, probe_output
from ..ops import F32, causal_conv, conv_tail, cq_fake_quant, fake_quant, quantize_rows, sigmoid, zc_rms_norm
from .weights import Needle3Weights, load_weights
from ..boundary import raises_container_errors

U32_MAX = 0xFFFFFFFF
PREFILL_CHUNK = 64  # positions per prefill chunk (§5.5.4); results do not depend on it


def saturate_ids(ids) -> np.ndarray:
    """Token ids as uint32, each saturated to [0, 2^32 − 1] (§0 item 1).

    A negative id has no u32 meaning, so it becomes 0 (the pad id); an id above 2^32 − 1
    becomes 2^32 − 1. The saturated id is what the Engram hash and the decode cache's token
    history see; only the embedding lookup further clamps it to vocab − 1 (§4.1). Accepts a
    sequence of Python ints or a 1-D integer array; anything else is an `InputError`.
    """
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        if ids.ndim != 1:
            raise InputError(f"token ids must be one-dimensional, got shape {ids.shape}")
        wide = ids.astype(np.uint64) if ids.dtype.kind == "u" else np.maximum(ids.astype(np.int64), 0)
        return np.minimum(wide.astype(np.uint64), np.uint64(U32_MAX)).astype(np.uint32)
    try:
        values = [min(max(operator.index(i), 0), U32_MAX) for i in ids]
    except (TypeError, ValueError):  # ValueError: a released memoryview
        raise InputError("token ids must be integers") from None
    return np.array(values, dtype=np.uint32)


@raises_container_errors
@checked_methods
class ReferenceModel:
    """Needle 3 in NumPy f32, built from a `.cact` v3 file (a path, bytes or a loaded CactFile).

    ``numerics``: "float" (§4.1-§4.8, upstream quant=False) or "deploy" (§4.9, quant=True).
    ``kv`` (deploy only; None: the header's kv_bits, §U d): "f32", "int8", "cq2", "cq3" or
    "cq4", the K/V quantisation of §4.9 point 5 that every form (whole sequence, prefill,
    decode) applies. Under float numerics the KV precision is the cache's (`new_cache`).
    ``depth`` (None: the file's own): run the depth-D rung of a full-depth file (§10, §U f);
    ``geometry`` and ``weights`` are then the rung's, selected from the file's.
    """

    def __init__(self, source, numerics="float", kv=None, depth=None):
        self.file = source if isinstance(source, cact.CactFile) else cact.load(source)
        self.geometry = self.file.geometry
        self.numerics = numerics_rules.choice(numerics)
        self.deploy = self.numerics == "deploy"
        self.kv_mode = numerics_rules.kv_mode(kv, self.numerics, self.geometry.kv_bits) if self.deploy else "f32"
        bits = numerics_rules.cq_bits(self.kv_mode)
        group = self.file["embedding"].group
        self.kv_levels = np.array(constants.kv_cq_levels(self.file.levels(bits), group), F32) if bits else None
        g = self.geometry
        if bits and max(g.qk_head_dim, g.v_head_dim) > constants.KV_CQ_GROUP:
            raise UnsupportedModelError(f"CQ K/V: head widths {g.qk_head_dim}/{g.v_head_dim} exceed the group of "
                                        f"{constants.KV_CQ_GROUP} (§4.9 point 5)")
        self.weights: Needle3Weights = load_weights(self.file)
        self.rung = full_rung(self.geometry) if depth is None else rung(self.geometry, depth)
        if not self.rung.full:
            self.geometry = self.rung.geometry
            self.weights = rung_weights(self.weights, self.rung)

    @classmethod
    def from_path(cls, path: str | Path, numerics="float", kv=None, depth=None) -> "ReferenceModel":
        return cls(cact.load(path), numerics, kv, depth)

    def act(self, x: np.ndarray) -> np.ndarray:
        """A8 of every vector of the last axis under deploy numerics (§4.9), else x itself."""
        return fake_quant(x) if self.deploy else x

    @property
    def head_rows(self) -> int:
        return self.geometry.head_rows

    def new_cache(self, precision: KvPrecision | str | None = None) -> KVCache:
        """A decode cache; precision None: int8 for the deploy KV mode "int8", else f32 (a CQ
        mode stores its round-tripped K/V as f32)."""
        if precision is None:
            precision = KvPrecision.INT8 if self.kv_mode == "int8" else KvPrecision.F32
        return KVCache(self.geometry, precision)

    # ------------------------------------------------------------------ public forms

    def forward_sequence(self, ids) -> np.ndarray:
        """Logits [T, head_rows] of every position of one sequence, no cache (§4).
        An empty sequence gives an empty [0, head_rows] array."""
        tokens = self._checked_sequence(ids)
        if len(tokens) == 0:
            return np.zeros((0, self.head_rows), F32)
        final, _ = self._forward_chunk(tokens, 0, None)
        return self.output_logits(final)

    def forward_cells(self, ids) -> np.ndarray:
        """The hidden cells [T, L+1, d] (§4.8): cell 0 is the scaled embedding, cell i+1 the
        lane mean after layer i."""
        tokens = self._checked_sequence(ids)
        if len(tokens) == 0:
            return np.zeros((0, self.geometry.num_layers + 1, self.geometry.d_model), F32)
        _, cells = self._forward_chunk(tokens, 0, None)
        return cells

    def prefill(self, ids, cache: KVCache, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """Feed ids after what `cache` holds; logits [T, head_rows] of each new position (§6).

        Runs in chunks of `chunk` positions, saturated to [1, max_seq_len] (fractions truncate;
        NaN, ±inf or not a number -> 64). Raises `ContextFullError`, consuming nothing, when
        the ids do not all fit before max_seq_len (§0 item 8).
        """
        chunk = clamp_count(chunk, 1, self.geometry.max_seq_len, PREFILL_CHUNK)
        tokens = saturate_ids(ids)
        self._check_cache(cache)
        cache.reserve(len(tokens))
        logits = [np.zeros((0, self.head_rows), F32)]
        for lo in range(0, len(tokens), chunk):
            final, _ = self._forward_chunk(tokens[lo : lo + chunk], cache.length, cache)
            logits.append(self.output_logits(final))
        return np.concatenate(logits, axis=0)

    def decode_step(self, token_id: int, cache: KVCache) -> np.ndarray:
        """Feed one id; logits [head_rows] of its position. A full cache raises `ContextFullError`."""
        self._check_cache(cache)
        if cache.full:
            raise ContextFullError(f"context full: all {cache.capacity} positions are used")
        return self.prefill([token_id], cache)[0]

    def head_output(self, code: int, ids, pad_masked: bool = False) -> np.ndarray:
        """The output of the probe head with manifest code ``code`` (§7, §U a) for a sequence
        (BOS first): [1] confidence logit, [3] router logits, [embedding_dim] unit embedding.

        Cells are produced chunk by chunk and folded into a streaming `ProbePool`; positions
        holding the pad id 0 are dropped from the probe softmax (§U a). The cells themselves
        come from the generation pass, which masks by position only (exact while no id 0 occurs).
        With ``pad_masked`` they are upstream's `hidden_cells` instead: one whole-sequence pass
        with every pad-dependent term masked (`_forward_chunk`'s ``pad_mask``).
        """
        head = self.weights.heads.get(code)
        if head is None:
            name = {EMBEDDING: "embedding", CONFIDENCE: "confidence", ROUTER: "router"}.get(code, str(code))
            raise UnsupportedModelError(f"this model file exports no {name} head (§7)")
        tokens = self._checked_sequence(ids)
        keep = keep_positions(tokens)
        if not keep.any():
            raise InputError("a probe head needs at least one token that is not the pad id 0")
        g = self.geometry
        if pad_masked:
            _, cells = self._forward_chunk(tokens, 0, None, pad_mask=keep)
            return probe_output(cells, head, keep)
        pool = ProbePool(head, g.num_layers + 1, g.d_model)
        cache = self.new_cache()
        for lo in range(0, len(tokens), PREFILL_CHUNK):
            _, cells = self._forward_chunk(tokens[lo : lo + PREFILL_CHUNK], cache.length, cache)
            pool.update(cells, keep[lo : lo + PREFILL_CHUNK])
        return pool.output()

    def confidence_logit(self, ids) -> float:
        """The confidence head's logit (§7) for a scored sequence (prompt + completion, BOS first)."""
        return float(self.head_output(CONFIDENCE, ids)[0])

    def embedding(self, ids) -> np.ndarray:
        """The embedding head's L2-normalised vector (§7, §U a)."""
        return self.head_output(EMBEDDING, ids)

    def route(self, ids) -> tuple:
        """The router head's three raw logits and its stored calibration (§U a)."""
        return self.head_output(ROUTER, ids), self.weights.heads[ROUTER].calibration

    def confidence(self, ids) -> float:
        """Probability σ(logit) of the confidence head (§7 step 3)."""
        return float(sigmoid(F32(self.confidence_logit(ids))))

    def confidence_logit_direct(self, ids) -> float:
        """The same logit from all cells at once (§7, non-streaming), for checking the pool."""
        head = self.weights.confidence
        if head is None:
            raise UnsupportedModelError("this model file exports no confidence head (§7)")
        tokens = self._checked_sequence(ids)
        return probe_logit(self.forward_cells(tokens), head, keep_positions(tokens))

    # ------------------------------------------------------------------ the graph (§4)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """x0 = E[min(τ, vocab−1)] · sqrt(d), the scale an f32 sqrt (§4.1, §0 item 1)."""
        g = self.geometry
        rows = np.minimum(tokens.astype(np.int64), g.vocab - 1)
        return cq.dequantize_rows(self.weights.embedding, rows) * F32(constants.sqrt(g.d_model))

    def output_logits(self, lane_means: np.ndarray) -> np.ndarray:
        """logits = E[:rows]·ZCRMSNorm(x̄; final_norm), the tied head without the sqrt(d) (§4.8)."""
        x_final = self.act(zc_rms_norm(lane_means, self.weights.final_norm))  # §4.9 point 7
        return cq.matmul(self.weights.embedding, x_final, 0, self.head_rows)

    def _forward_chunk(self, tokens: np.ndarray, start: int, cache: KVCache | None,
                       pad_mask: np.ndarray | None = None) -> tuple:
        """Positions start … start+T−1 through every layer (§4.1-§4.8).

        Returns the final lane means [T, d] and the cells [T, L+1, d]. With a cache, the chunk
        attends to what it holds and leaves its own state there; without one, it is the whole
        sequence from position 0. ``pad_mask`` (whole sequence, no cache; bool per position,
        False at id 0) masks as upstream's `hidden_cells` (§U a): attention keys at pads, q/k/v
        conv taps j ≥ 1 reading a pad, engram tables whose n-gram starts at a pad and engram
        value-conv taps (tap 0 included) at p − j·max_order on a pad.
        """
        g, w = self.geometry, self.weights
        positions = np.arange(start, start + len(tokens))
        self._pad_mask = pad_mask
        x0 = self.embed(tokens)
        engram_kv = self._engram(tokens, positions, cache)
        lanes = mhc.broadcast_lanes(x0, g.mhc_lanes)  # §4.3
        cells = [x0]
        for layer in range(g.num_layers):
            p = w.mhc[layer]
            nx = self.act(mhc.lane_norm(lanes))  # §4.9 point 2
            pre, post, res = mhc.lane_products(w.phi_pre, w.phi_post, w.phi_res, layer, nx, g.mhc_lanes)
            u = mhc.mix_down(lanes, mhc.pre_weights(pre, p))  # §4.4
            delta = self._block(layer, u, positions, engram_kv, cache) - u  # §4.5 item 13
            hres, hpost = mhc.residual_mix(res, p), mhc.post_weights(post, p)
            lanes = mhc.scatter_up(lanes, hres, hpost, delta)  # §4.7
            cells.append(mhc.lane_mean(lanes))
        if cache is not None:
            cache.remember_tokens(tokens)
            cache.length += len(tokens)
        return cells[-1], np.stack(cells, axis=1)

    def _engram(self, tokens: np.ndarray, positions: np.ndarray, cache: KVCache | None) -> list:
        """Keys and convolved values [T, d] of every Engram site, computed before the layers (§4.2)."""
        g = self.geometry
        if not self.weights.engram:  # a model without Engram (§U c)
            return []
        if cache is not None:
            history = cache.token_history
        else:
            history = np.zeros(g.engram_max_order - 1, np.uint32)  # τ before position 0 is 0 (§4.2)
        idx = engram.hash_indices(tokens, history, g.engram_orders, g.engram_heads,
                                  g.engram_seed_heads, g.engram_slots)
        valid = engram.hash_validity(positions, g.engram_orders, g.engram_heads)
        keep, value_keep = self._pad_mask, None
        if keep is not None:  # τ_{p−o} ≠ 0 at offset o = order − 1 and at o = j·max_order (§U a)
            orders = np.repeat(np.asarray(g.engram_orders), g.engram_heads)
            valid = valid & np.stack([_shifted(keep, o - 1) for o in orders], axis=1)
            value_keep = np.stack([_shifted(keep, j * g.engram_max_order) for j in range(g.engram_conv_taps)])
        out = []
        for s, site in enumerate(self.weights.engram):
            fetched = self.act(engram.fetch(site.tables, idx, valid, g.engram_slots, g.engram_sub_dim))  # §4.9 pt 1
            keys, raw_values = engram.project(site.key_proj, site.value_proj, fetched)
            tail = cache.engram_tails[s] if cache is not None else None
            values = engram.value_conv(raw_values, site.taps, g.engram_conv_dilation, g.engram_max_order,
                                       positions, tail, value_keep)
            if cache is not None:
                cache.engram_tails[s] = conv_tail(tail, raw_values)  # §6 item 3: pre-conv values
            out.append((keys, values))
        return out

    def _block(self, layer: int, u: np.ndarray, positions: np.ndarray, engram_kv: list,
               cache: KVCache | None) -> np.ndarray:
        """One block (§4.5): Engram gate, attention, MLP, each as a residual on bx."""
        g, w = self.geometry, self.weights
        bx = u
        site = g.engram_site(layer)
        if site >= 0:
            bx = engram.gate(u, *engram_kv[site])  # item 1
        h = self.act(zc_rms_norm(bx, w.attention[layer].norm_in))  # item 2; §4.9 point 3
        a = self._attention(layer, h, positions, cache)
        bx = attention.residual(bx, a, w.attention[layer].attn_gate)  # item 11
        hada = w.hada[layer]
        return bx + hada_mlp(zc_rms_norm(bx, hada.pre_hada), hada)  # item 12

    def _attention(self, layer: int, h: np.ndarray, positions: np.ndarray,
                   cache: KVCache | None) -> np.ndarray:
        """Items 3-10 of §4.5; with a cache, also reads and extends its conv tails and K/V (§6)."""
        g, p = self.geometry, self.weights.attention[layer]
        state = cache.layers[layer] if cache is not None else None
        q, k, v, gate = attention.project(h, p)  # item 3
        if p.q_taps is not None:  # item 4
            tails = (None, None, None) if state is None else (state.q_tail, state.k_tail, state.v_tail)
            tap_keep = None
            if self._pad_mask is not None:  # tap j ≥ 1 skipped where τ_{t−j} = 0 (§U a)
                tap_keep = np.stack([np.ones(len(h), bool)] + [_shifted(self._pad_mask, j)
                                                               for j in range(1, p.q_taps.shape[0])])
            convolved = [causal_conv(x, taps, tail, tap_keep)
                         for x, taps, tail in zip((q, k, v), (p.q_taps, p.k_taps, p.v_taps), tails)]
            if state is not None:
                state.roll_tails(q, k, v)  # §6 item 2: the tails keep pre-conv rows
            q, k, v = convolved
        q_heads = attention.position_heads(q, g.num_heads, p.q_norm, positions, g.rope_theta)  # items 5-7
        k_heads = attention.position_heads(k, g.num_kv_heads, p.k_norm, positions, g.rope_theta)
        v_heads = attention.split_heads(v, g.num_kv_heads)
        o = self._attend(layer, q_heads, k_heads, v_heads, positions, cache)  # item 8
        return attention.output(o, gate, p, self.act)  # items 9-10; §4.9 point 6

    def _attend(self, layer: int, q_heads: np.ndarray, k_heads: np.ndarray, v_heads: np.ndarray,
                positions: np.ndarray, cache: KVCache | None) -> np.ndarray:
        """Attention of the chunk's queries over the cached past plus the chunk itself (§6 item 1).

        In int8 mode (needle-rs KvPrecision::Int8 = §4.9 items 4-5 only) q is A8 per head and k, v
        are stored as int8 + scale; the chunk attends through that same integer form, so a
        prefill equals stepped decode. Under deploy numerics q is A8 per head in every KV mode
        and k, v go through the mode's quantisation before they are stored or attended (§4.9
        items 4-5): fake-quant per head ("int8" without an int8 cache), the CQ round trip at
        group 64 ("cq2/3/4"), or nothing ("f32").
        """
        int8 = cache is not None and cache.precision is KvPrecision.INT8
        if self.deploy and not int8:
            q_heads = fake_quant(q_heads)
            k_heads, v_heads = self._kv_round_trip(k_heads), self._kv_round_trip(v_heads)
        if int8:
            q_heads = fake_quant(q_heads)
            k_i8, k_scale = quantize_rows(k_heads)
            v_i8, v_scale = quantize_rows(v_heads)
            new = (k_i8, k_scale[..., 0], v_i8, v_scale[..., 0])
        else:
            new = (k_heads, v_heads)
        if cache is None:
            entries, key_positions = new, positions
        else:
            ring = cache.layers[layer].kv
            past, past_positions = ring.read(int(positions[0]))
            entries = tuple(np.concatenate(pair) for pair in zip(past, new))
            key_positions = np.concatenate((past_positions, positions))
            ring.write(positions, new)
        span = self.geometry.attention_span(layer)
        return attention.attend(q_heads, positions, entries, key_positions, span, int8, key_keep=self._pad_mask)

    def _kv_round_trip(self, x: np.ndarray) -> np.ndarray:
        """K or V heads [T, KV, hd] as the deploy KV mode sees them (§4.9 point 5)."""
        if self.kv_mode == "int8":
            return fake_quant(x)
        if self.kv_levels is not None:
            return cq_fake_quant(x, self.kv_levels)
        return x

    # ------------------------------------------------------------------ checks

    _pad_mask = None  # set per chunk by _forward_chunk

    def _checked_sequence(self, ids) -> np.ndarray:
        tokens = saturate_ids(ids)
        if len(tokens) > self.geometry.max_seq_len:
            raise ContextFullError(f"{len(tokens)} ids exceed max_seq_len {self.geometry.max_seq_len}")
        return tokens

    def _check_cache(self, cache: KVCache) -> None:
        if not isinstance(cache, KVCache) or cache.geometry != self.geometry:
            raise InputError("this cache was not made for this model (use model.new_cache())")


def _shifted(keep: np.ndarray, offset: int) -> np.ndarray:
    """keep[p − offset] (False where p < offset): upstream's mask diagonal at ``offset`` (§U a)."""
    out = np.zeros(len(keep), bool)
    if offset < len(keep):
        out[offset:] = keep[: len(keep) - offset]
    return out
