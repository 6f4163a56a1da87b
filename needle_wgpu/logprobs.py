"""Log-probabilities of sampled tokens, from one logits-row readback, in pure Python (it runs in
Pyodide too). Asked for per request (``Model.stream(logprobs=True)``, a session's
``prefill``/``step`` with ``top_logprobs=``); the plain decode step never reads the row.

The distribution is the log-softmax of the row the sampler read: the logits after logit_bias
and the penalties (``logits_process.wgsl`` changes the row in place), before temperature,
top-k, top-p and min_p, with ids outside a constrained-decoding mask at -inf. NaN logits count
as -inf. Where some logits are +inf, they share the probability equally. A token that cannot
occur has logprob -inf.
"""

from __future__ import annotations

import heapq
import math
import struct
from dataclasses import dataclass

from .sampling import clamp_count

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One produced token: its logprob and the ``top`` most likely alternatives (token,
    logprob), most likely first, ties by lowest id (the token itself may be among them)."""

    token: int
    logprob: float
    top: tuple = ()

    def as_dict(self) -> dict:
        """``{"token", "logprob", "top_logprobs": [{"token", "logprob"}, ...]}``
        (``GenerationResult.logprobs`` items)."""
        return {"token": self.token, "logprob": self.logprob,
                "top_logprobs": [{"token": t, "logprob": lp} for t, lp in self.top]}


def saturate_top_logprobs(value) -> int:
    """top_logprobs: a whole count in [0, 20] (fractions truncate); NaN, ±inf or what is not a
    number -> 0."""
    return clamp_count(value, 0, MAX_TOP_LOGPROBS, 0)


def row_values(data: bytes, rows: int, mask=None) -> list:
    """The float32 row as Python floats, NaN and (with ``mask``, bit i of byte i // 8 allowing
    id i) disallowed ids as -inf."""
    values = list(struct.unpack(f"<{rows}f", data[: 4 * rows]))
    minus_inf = -math.inf
    for i, v in enumerate(values):
        if v != v or mask is not None and not (mask[i >> 3] >> (i & 7)) & 1:
            values[i] = minus_inf
    return values


def log_softmax(values: list) -> list:
    """log(softmax(values)) in float64; +inf values share the mass, -inf ones get -inf."""
    top = max(values)
    if top == math.inf:
        share = -math.log(sum(1 for v in values if v == math.inf))
        return [share if v == math.inf else -math.inf for v in values]
    if top == -math.inf:
        return [-math.inf] * len(values)
    exp = math.exp
    total = top + math.log(math.fsum(exp(v - top) for v in values))
    return [v - total for v in values]


def token_logprob(values: list, token: int, top: int) -> TokenLogprob:
    """The logprob of ``token`` and the ``top`` most likely ids of ``values`` (a row from
    ``row_values``)."""
    logprobs = log_softmax(values)
    top = saturate_top_logprobs(top)
    best = heapq.nlargest(top, range(len(logprobs)), key=logprobs.__getitem__) if top else []
    chosen = logprobs[token] if 0 <= token < len(logprobs) else -math.inf
    return TokenLogprob(token, chosen, tuple((i, logprobs[i]) for i in best))


def probability_of_logit(logit: float) -> float:
    """σ(logit), saturating: 0 for a NaN or very negative logit."""
    return 1.0 / (1.0 + math.exp(-logit)) if logit > -700 else 0.0
