"""The speculative-sampling rule in NumPy (Leviathan et al. 2023; Chen et al. 2023): the
definition ``needle_wgpu.speculative.accept`` follows, given the same uniform draws.

Drafts d_i were drawn from q_i; the target gives p_i (k + 1 rows). For i = 1 … k: with a
uniform u, d_i is kept when u·q_i(d_i) < p_i(d_i) (probability min(1, p/q)); at the first
rejection the round ends with an id drawn from norm(max(0, p_i − q_i)); after k kept drafts,
one more id from p_{k+1}. Every emitted id is then distributed as p.
"""

from __future__ import annotations

import numpy as np


def draw(probabilities: np.ndarray, u: float) -> int:
    """The first id whose running sum exceeds u (the last positive one if rounding falls short)."""
    probabilities = np.asarray(probabilities, np.float64)
    running = np.cumsum(probabilities)
    hit = np.flatnonzero((running > u) & (probabilities > 0))
    return int(hit[0]) if len(hit) else int(np.flatnonzero(probabilities > 0)[-1])


def accept(p_rows, q_rows, drafts, uniforms) -> list:
    """Emitted ids of one round; ``uniforms`` yields the draws in the order the rule uses them."""
    p_rows, q_rows = np.asarray(p_rows, np.float64), np.asarray(q_rows, np.float64)
    uniforms = iter(uniforms)
    out = []
    for i, d in enumerate(drafts):
        if q_rows[i, d] > 0 and next(uniforms) * q_rows[i, d] < p_rows[i, d]:
            out.append(int(d))
            continue
        residual = np.maximum(p_rows[i] - q_rows[i], 0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else p_rows[i]
        return out + [draw(residual, next(uniforms))]
    return out + [draw(p_rows[len(drafts)], next(uniforms))]
