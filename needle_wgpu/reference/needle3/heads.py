"""Probe heads in NumPy float32 (spec §7, §U a): embedding, confidence and router, read from
the hidden cells.

A head attends over positions once per (cell, probe), normalises and scales the readouts,
attends over the readouts once per query, and projects the pooled queries to its outputs
(one confidence logit, three router logits, or an L2-normalised embedding).
`probe_logit` is the whole-sequence formula; `ProbePool` computes the same thing streaming
over positions with an online softmax, holding one readout per (cell, probe) instead of all
the cells.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ContainerError
from . import cq
from ..ops import F32, rms_unit, softmax

EMBEDDING, CONFIDENCE, ROUTER = 1, 2, 3  # manifest codes of the heads (§U a)


@dataclass(frozen=True, eq=False)
class ProbeHeadParams:
    """One head's tensors in §7 order."""

    probes: cq.CQMatrix  # [cells·k, d], row l·k + kk
    gain: np.ndarray  # [cells, k]
    query: cq.CQMatrix  # [Q, d]
    row_bias: np.ndarray  # [Q, cells, k]
    proj: cq.CQMatrix  # [out, Q·d]
    bias: np.ndarray  # [out]; the embedding head's is zeros and unused
    code: int = CONFIDENCE
    calibration: np.ndarray | None = None  # the router's 3 stored values (§U a)

    @property
    def probes_per_cell(self) -> int:
        return self.gain.shape[1]


def probe_scores(cells: np.ndarray, head: ProbeHeadParams) -> np.ndarray:
    """score[t, l, kk] = ⟨cell_{t,l}, probe_{l,kk}⟩ / sqrt(d) (§7 step 1): [T, C, d] → [T, C, k]."""
    count, num_cells, d = cells.shape
    k = head.probes_per_cell
    scores = np.empty((count, num_cells, k), F32)
    for cell in range(num_cells):
        scores[:, cell] = cq.matmul(head.probes, cells[:, cell], cell * k, k)
    return scores / F32(np.sqrt(d))


def readout_output(readouts: np.ndarray, head: ProbeHeadParams) -> np.ndarray:
    """From the position-pooled readouts r [C, k, d] to the head's output (§7 steps 1-3).

    r ← rms_unit(r)·gain; per query q: v_m = ⟨r_m, query_q⟩/sqrt(d) + row_bias[q, m],
    w = softmax_m(v), pooled_q = Σ_m w_m r_m (m = l·k + kk); z = proj·concat_q(pooled_q).
    Confidence and router: z + bias (1 and 3 logits). Embedding: z / sqrt(Σ z² + 1e-12).
    """
    num_cells, k, d = readouts.shape
    r = (rms_unit(readouts) * head.gain[:, :, None]).reshape(num_cells * k, d)
    queries = head.query.rows
    v = cq.matmul(head.query, r).T / F32(np.sqrt(d)) + head.row_bias.reshape(queries, num_cells * k)
    pooled = softmax(v, axis=-1) @ r  # [Q, d]
    z = cq.matmul(head.proj, pooled.reshape(1, queries * d))[0]
    if head.code == EMBEDDING:
        return (z / np.sqrt(np.sum(z * z, dtype=F32) + F32(1e-12))).astype(F32)
    return (z + head.bias).astype(F32)


def readout_logit(readouts: np.ndarray, head: ProbeHeadParams) -> float:
    """The first output of a head: the confidence logit (§7 step 3)."""
    return float(readout_output(readouts, head)[0])


def keep_positions(tokens: np.ndarray) -> np.ndarray:
    """Positions the probe softmax reads: every one whose token is not the pad id 0 (§U a)."""
    return np.asarray(tokens) != 0


def probe_output(cells: np.ndarray, head: ProbeHeadParams, keep: np.ndarray | None = None) -> np.ndarray:
    """A head's output for a whole sequence of cells [T, C, d] (§7), softmax over all positions
    at once; positions with ``keep`` False score −inf (§U a)."""
    scores = probe_scores(cells, head)
    if keep is not None:
        scores = np.where(np.asarray(keep)[:, None, None], scores, F32(-np.inf))
    weights = softmax(scores, axis=0)  # over positions t
    readouts = np.einsum("tlk,tld->lkd", weights, cells, dtype=F32)
    return readout_output(readouts, head)


def probe_logit(cells: np.ndarray, head: ProbeHeadParams, keep: np.ndarray | None = None) -> float:
    """The confidence logit of a whole sequence of cells [T, C, d] (§7)."""
    return float(probe_output(cells, head, keep)[0])


class ProbePool:
    """Streaming §7 step 1: online softmax over positions per (cell, probe).

    Keeps a running max m, denominator s and numerator vector a; a new position with score x
    rescales them by exp(m_old − m_new) (§7). `logit()` finishes with r = a / s.
    """

    def __init__(self, head: ProbeHeadParams, num_cells: int, d_model: int):
        k = head.probes_per_cell
        self.head = head
        self.running_max = np.full((num_cells, k), -np.inf, F32)
        self.denominator = np.zeros((num_cells, k), F32)
        self.numerator = np.zeros((num_cells, k, d_model), F32)
        self.positions = 0

    def update(self, cells: np.ndarray, keep: np.ndarray | None = None) -> None:
        """Fold in the cells [T, C, d] of the next T positions, one position at a time; a
        position with ``keep`` False (a pad token, §U a) is skipped."""
        scores = probe_scores(cells, self.head)
        for t in range(cells.shape[0]):
            if keep is not None and not keep[t]:
                continue
            new_max = np.maximum(self.running_max, scores[t])
            rescale = np.exp(self.running_max - new_max)
            weight = np.exp(scores[t] - new_max)
            self.denominator = self.denominator * rescale + weight
            self.numerator = (self.numerator * rescale[:, :, None]
                              + weight[:, :, None] * cells[t][:, None, :])
            self.running_max = new_max
        self.positions += cells.shape[0]

    def output(self) -> np.ndarray:
        if self.positions == 0 or not np.all(self.denominator > 0):
            raise ContainerError("a probe pool needs at least one kept position")
        return readout_output(self.numerator / self.denominator[:, :, None], self.head)

    def logit(self) -> float:
        return float(self.output()[0])
