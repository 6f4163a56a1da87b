"""A rung of a full-depth file's weights in NumPy (spec §10, §U f): the reference's side of
``models.ladder``. The layer code then runs unchanged on D layers, as it would on upstream's
rung file: per-layer records of the kept blocks, their φ rows and mHC scalars (active lane =
new index mod n), the kept Engram sites, and each head's probe rows, gains and row biases of
the kept cells."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...models.ladder import Rung
from .cq import CQMatrix
from .weights import Needle3Weights


def take_rows(m: CQMatrix, rows) -> CQMatrix:
    """The CQ matrix of the given rows, in that order (codes and norms are per row, §5.1)."""
    rows = np.asarray(rows, dtype=np.int64)
    return CQMatrix(len(rows), m.cols, m.group, m.bits, m.packed[rows], m.norms[rows], m.levels)


def _bands(rows_per_layer: int, blocks: tuple) -> np.ndarray:
    return np.concatenate([np.arange(b * rows_per_layer, (b + 1) * rows_per_layer) for b in blocks])


def rung_weights(w: Needle3Weights, r: Rung) -> Needle3Weights:
    """The weights of rung ``r`` selected from full-depth weights ``w``."""
    n = r.parent.mhc_lanes
    heads = {}
    for code, head in w.heads.items():
        k = head.probes_per_cell
        heads[code] = replace(head, probes=take_rows(head.probes, _bands(k, r.cells)),
                              gain=head.gain[list(r.cells)], row_bias=head.row_bias[:, list(r.cells), :])
    return replace(
        w, geometry=r.geometry,
        attention=tuple(w.attention[b] for b in r.blocks), hada=tuple(w.hada[b] for b in r.blocks),
        mhc=tuple(replace(w.mhc[b], active_lane=i % n) for i, b in enumerate(r.blocks)),
        phi_pre=take_rows(w.phi_pre, _bands(n, r.blocks)), phi_post=take_rows(w.phi_post, _bands(n, r.blocks)),
        phi_res=take_rows(w.phi_res, _bands(n * n, r.blocks)),
        engram=tuple(w.engram[s] for s in r.sites), heads=heads)
