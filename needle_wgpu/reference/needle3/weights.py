"""Needle 3 weights as NumPy arrays, gathered from a validated `.cact` container (spec §8).

FP16 and FP32 records become f32 arrays of their record shape; CQ records stay compressed as
`CQMatrix` (§5). The per-layer tensors are grouped the way the forward pass uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ContainerError, UnsupportedModelError
from ...formats import cact
from ...formats.needle3_geometry import Needle3Geometry
from .attention import AttentionParams
from .cq import CQMatrix
from .engram import EngramSite
from .hada_mlp import HadaParams
from .heads import CONFIDENCE, ROUTER, ProbeHeadParams
from .mhc import MhcLayer
from ..ops import F32


HADA_NAMES = ("pre_hada", "d1", "d2", "b2", "d3", "d4", "w1a", "w1b", "w2a", "w2b", "w3a", "w3b",
              "cond_v", "cond_u")


def float_array(tensor: cact.Tensor) -> np.ndarray:
    """An FP16 or FP32 record as an f32 array of its shape (§8)."""
    dtype = {cact.FP16: "<f2", cact.FP32: "<f4"}[tensor.dtype]
    return np.frombuffer(tensor.data, dtype=dtype).astype(F32).reshape(tensor.shape)


def permutation(tensor: cact.Tensor) -> np.ndarray:
    """hada_p1 / hada_p2: a permutation stored as FP32 integers (§8 records 550-551)."""
    values = float_array(tensor).astype(np.float64)
    order = values.astype(np.int64)
    if not (np.array_equal(order, values) and np.array_equal(np.sort(order), np.arange(len(order)))):
        raise ContainerError(f"{tensor.name}: not a permutation of 0..{len(order) - 1}")
    return order


@dataclass(frozen=True, eq=False)
class Needle3Weights:
    geometry: Needle3Geometry
    embedding: CQMatrix  # [vocab, d]; also the tied output head (§4.8)
    attention: tuple  # AttentionParams per layer
    hada: tuple  # HadaParams per layer
    mhc: tuple  # MhcLayer per layer
    phi_pre: CQMatrix  # [L·n, n·d]
    phi_post: CQMatrix  # [L·n, n·d]
    phi_res: CQMatrix  # [L·n², n·d]
    engram: tuple  # EngramSite per site
    final_norm: np.ndarray  # [d]
    heads: dict  # manifest code (§U a: 1 embedding, 2 confidence, 3 router) -> ProbeHeadParams

    @property
    def confidence(self) -> ProbeHeadParams | None:
        """The §7 head with manifest code 2, if exported."""
        return self.heads.get(CONFIDENCE)


def load_weights(f: cact.CactFile) -> Needle3Weights:
    """Gather every tensor the reference forward pass reads (§8 canon names)."""
    g = f.geometry

    def cq_matrix(name: str) -> CQMatrix:
        tensor = f[name]
        return CQMatrix.from_tensor(tensor, f.levels(tensor.bits))

    def layer_array(i: int, name: str) -> np.ndarray:
        return float_array(f.layer(i, name))

    def layer_cq(i: int, name: str) -> CQMatrix:
        return cq_matrix(f"layers.{i}.{name}")

    p1, p2 = permutation(f["hada.p1"]), permutation(f["hada.p2"])
    a_pre, a_post, a_res = (float_array(f[f"mhc.{name}"]) for name in ("a_pre", "a_post", "a_res"))
    b_pre, b_post, b_res = (float_array(f[f"mhc.{name}"]) for name in ("b_pre", "b_post", "b_res"))
    attention, hada, mhc = [], [], []
    for i in range(g.num_layers):
        taps = {name: layer_array(i, name) if g.qkv_conv_taps else None
                for name in ("q_taps", "k_taps", "v_taps")}
        attention.append(AttentionParams(
            norm_in=layer_array(i, "norm_in"), q_proj=layer_cq(i, "q_proj"), k_proj=layer_cq(i, "k_proj"),
            v_proj=layer_cq(i, "v_proj"), **taps, q_norm=layer_array(i, "q_norm"),
            k_norm=layer_array(i, "k_norm"), gate_proj=layer_cq(i, "gate_proj"),
            out_proj=layer_cq(i, "out_proj"), post_norm=layer_array(i, "post_norm"),
            attn_gate=float(layer_array(i, "attn_gate")[0])))
        hada.append(HadaParams(
            **{name: layer_array(i, name) for name in HADA_NAMES},
            p1=p1, p2=p2))
        mhc.append(MhcLayer(active_lane=i % g.mhc_lanes, a_pre=float(a_pre[i]), a_post=float(a_post[i]),
                            a_res=float(a_res[i]), b_pre=b_pre[i], b_post=b_post[i], b_res=b_res[i]))
    engram = tuple(
        EngramSite(tables=cq_matrix(f"engram.{s}.tables"), key_proj=cq_matrix(f"engram.{s}.key_proj"),
                   value_proj=cq_matrix(f"engram.{s}.value_proj"), taps=float_array(f[f"engram.{s}.taps"]))
        for s in range(len(g.engram_sites)))
    return Needle3Weights(
        geometry=g, embedding=cq_matrix("embedding"), attention=tuple(attention), hada=tuple(hada),
        mhc=tuple(mhc), phi_pre=cq_matrix("mhc.phi_pre"), phi_post=cq_matrix("mhc.phi_post"),
        phi_res=cq_matrix("mhc.phi_res"), engram=engram, final_norm=float_array(f["final_norm"]),
        heads={code: _probe_head(f, cq_matrix, h, code) for h, code in enumerate(f.head_codes)})


def _probe_head(f: cact.CactFile, cq_matrix, h: int, code: int) -> ProbeHeadParams:
    """Head h of the manifest (§7, §U a); heads are numbered in manifest order."""
    prefix = f"heads.{h}."
    head = ProbeHeadParams(
        probes=cq_matrix(prefix + "probes"), gain=float_array(f[prefix + "gain"]),
        query=cq_matrix(prefix + "query"), row_bias=float_array(f[prefix + "row_bias"]),
        proj=cq_matrix(prefix + "proj"), bias=float_array(f[prefix + "bias"]), code=code,
        calibration=float_array(f[prefix + "calibration"]) if code == ROUTER else None)
    if head.probes.cols != f.geometry.d_model or head.query.cols != f.geometry.d_model:
        raise UnsupportedModelError(f"{prefix}probes/query: width is not d_model {f.geometry.d_model}")
    return head
