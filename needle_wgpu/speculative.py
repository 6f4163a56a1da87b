"""Self-speculative decoding: a shallow rung of the same file drafts, the full model verifies.

A round starts with both sessions at position P and the next id x known. The draft session
(a rung of elastic depth, §10, over the same GPU weights) runs k decode steps from x; the full
session feeds x and the k drafts as one chunk and, greedy, samples its own id after every one
of them (one plan, one readback of k + 1 ids). The longest prefix of drafts the full model
agrees with is kept, plus the full model's own next id (its correction, or a bonus id after k
agreed drafts); both sessions step back past what was rejected (``ChunkedSession.rewind``).
Greedy output is the full model's greedy output, id for id.

With a temperature the round follows the standard speculative-sampling rule (Leviathan et al.
2023, Chen et al. 2023): the draft samples d_i ~ q_i, the full model gives p_i at every
position; d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
the id is drawn from norm(max(0, p_i − q_i)); after k acceptances a bonus id from p_{k+1}.
Each emitted id is then distributed as p. Both distributions come from logits read back to
the host (``distribution``: temperature, top-k, top-p). Pure Python, as all model code.
"""

from __future__ import annotations

import math
import random

from .errors import InputError
from .models.ladder import check_depth
from .sampling import Sampling, clamp_count

MAX_DRAFT = 16  # drafted ids per round (a verify chunk is k + 1 positions)


def distribution(logits, sampling: Sampling) -> list:
    """The probabilities a sampler with these settings draws from (host side): greedy → the
    argmax (lowest index on ties) with probability 1; else softmax(logits / T) over the top_k
    largest (ties by lowest index), cut to the smallest most-likely set holding top_p of the
    mass (ties at the cut kept), renormalised. NaN reads as −inf."""
    values = [x if x == x else -math.inf for x in logits]
    rows = len(values)
    if not rows:
        return []
    best = max(range(rows), key=lambda i: (values[i], -i))
    if sampling.greedy or sampling.top_k == 1 or values[best] in (math.inf, -math.inf):
        out = [0.0] * rows
        out[best] = 1.0
        return out
    order = sorted(range(rows), key=lambda i: (-values[i], i))
    if 0 < sampling.top_k < rows:
        order = order[: sampling.top_k]
    top, inv = values[best], 1.0 / sampling.temperature
    weights = {i: math.exp((values[i] - top) * inv) for i in order if values[i] > -math.inf}
    total = sum(weights.values())
    if sampling.top_p < 1.0:
        kept, mass, cut = {}, 0.0, None
        for i in order:
            w = weights.get(i, 0.0)
            if cut is not None and values[i] < cut or w == 0.0:
                break
            kept[i] = w
            mass += w
            if mass >= sampling.top_p * total and cut is None:
                cut = values[i]
        weights, total = kept, mass
    out = [0.0] * rows
    for i, w in weights.items():
        out[i] = w / total
    return out


def draw(probabilities: list, u: float) -> int:
    """The id at which the running sum of ``probabilities`` first exceeds ``u`` ∈ [0, 1)
    (the last id with positive probability when rounding leaves the sum short)."""
    running, last = 0.0, 0
    for i, p in enumerate(probabilities):
        if p > 0.0:
            running += p
            last = i
            if u < running:
                return i
    return last


def accept(p_rows: list, q_rows: list, drafts: list, rng: random.Random) -> list:
    """The ids a round emits under the speculative-sampling rule: ``q_rows[i]`` the draft's
    distribution that ``drafts[i]`` was drawn from, ``p_rows`` the full model's k + 1
    distributions at the same positions (the last one after every draft)."""
    out = []
    for i, d in enumerate(drafts):
        p, q = p_rows[i][d], q_rows[i][d]
        if q > 0.0 and rng.random() * q < p:  # accepted with probability min(1, p / q)
            out.append(d)
            continue
        residual = [max(0.0, a - b) for a, b in zip(p_rows[i], q_rows[i])]
        total = sum(residual)
        if total <= 0.0:  # p == q up to rounding: p itself is the residual's limit
            residual, total = p_rows[i], 1.0
        out.append(draw([r / total for r in residual], rng.random()))
        return out
    out.append(draw(p_rows[len(drafts)], rng.random()))
    return out


def speculative_option(speculative, layers: int, running: int | None = None) -> tuple | None:
    """``speculative=(depth, k)`` checked: None (off), or (depth, k) with depth a rung of the
    file's ``layers`` (``models.ladder.check_depth``) below the ``running`` depth (default: the
    file's), and k saturated to [1, MAX_DRAFT]."""
    if speculative is None:
        return None

    if isinstance(speculative, (str, bytes)) or not hasattr(speculative, "__len__") or len(speculative) != 2:
        raise InputError("speculative must be None or a pair (draft depth, drafted ids per round)")
    depth = check_depth(speculative[0], layers)
    running = layers if running is None else running
    if depth >= running:
        raise InputError(f"speculative: the draft depth {depth} must be below the model's {running} layers")
    return depth, clamp_count(speculative[1], 1, MAX_DRAFT, 4)


class SpeculativeDecoder:
    """Rounds of self-speculative decoding over a full session and a draft session of the same
    context (``start`` once, then ``round`` until the caller has enough ids)."""

    def __init__(self, full, draft, k: int, sampling: Sampling):
        self.full, self.draft, self.k, self.sampling = full, draft, k, sampling
        self.k = min(k, full.chunk - 1, full.max_rewind - 1 if not full.rewindable else k,
                     draft.max_rewind - 1 if not draft.rewindable else k)
        self.pending = None  # the next id, not yet fed to either session
        self.lag = None  # an id the draft session has still to feed before the pending one
        self.rng = random.Random(sampling.seed)
        self.rounds = self.drafted = self.accepted = 0

    @property
    def acceptance(self) -> float:
        """Accepted drafts over drafted ones."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def start(self, ids: list, should_stop=None) -> int | None:
        """Prefill both sessions; returns the full model's first id, or None where
        ``should_stop(done, total)``, asked before each prefill chunk of either session, says so."""
        stopped = []

        def asked(done, total):
            if should_stop is not None and should_stop(done, total):
                stopped.append(True)
            return bool(stopped)

        if self.sampling.greedy:
            self.pending = self.full.prefill(ids, self.sampling, should_stop=asked)
        else:
            self.full.prefill(ids[:-1], should_stop=asked)
            if stopped:
                return None
            self.pending = draw(distribution(self.full.last_logits(ids[-1:]), self.sampling), self.rng.random())
        if stopped:
            return None
        self.draft.prefill(ids, should_stop=asked)
        return None if stopped else self.pending

    def round(self) -> list:
        """One round: 1 to k + 1 ids, the last of them pending (not yet fed)."""
        full, x = self.full, self.pending
        start = full.position
        k = min(self.k, full.context - start - 2)
        if k < 1:  # no room for drafts: one plain step of the full model
            ids = [self._plain_step()]
        elif self.sampling.greedy:
            ids = self._greedy_round(x, start, k)
        else:
            ids = self._sampled_round(x, start, k)
        self.pending = ids[-1]
        return ids

    def _catch_up(self, x: int) -> list:
        """The ids the draft session feeds next: the one it lags by (if any), then x."""
        lag, self.lag = self.lag, None
        return [x] if lag is None else [lag, x]

    def _plain_step(self) -> int:
        full, x = self.full, self.pending
        if self.sampling.greedy:
            full.device.write(full.tokens, x.to_bytes(4, "little"), 4 * full.position)
            next_id = full.step(self.sampling)
        else:
            next_id = draw(distribution(full.last_logits([x]), self.sampling), self.rng.random())
        self.draft.prefill(self._catch_up(x))
        return next_id

    def _greedy_round(self, x: int, start: int, k: int) -> list:
        full, draft = self.full, self.draft
        feed = self._catch_up(x)
        if len(feed) == 1:
            draft.device.write(draft.tokens, x.to_bytes(4, "little"), 4 * start)
            draft.draft(k, self.sampling, read=False)
        else:  # the id it lags by and x in one chunk that samples the first draft
            draft._run_chunk(feed, self.sampling)
            draft.draft(k - 1, self.sampling, read=False)
        drafts, verified = full.verify_drafts(x, draft, k)
        n = 0
        while n < k and drafts[n] == verified[n]:
            n += 1
        self._settle(start, n, k, drafts)
        return verified[: n + 1]

    def _sampled_round(self, x: int, start: int, k: int) -> list:
        full, draft = self.full, self.draft
        drafts, q_rows, previous = [], [], x
        feed = self._catch_up(x)
        for _ in range(k):
            q = distribution(draft.last_logits(feed), self.sampling)
            previous = draw(q, self.rng.random())
            feed = [previous]
            drafts.append(previous)
            q_rows.append(q)
        p_rows = [distribution(row, self.sampling) for row in full.all_logits([x] + drafts)]
        ids = accept(p_rows, q_rows, drafts, self.rng)
        self._settle(start, len(ids) - 1, k, drafts)
        return ids

    def _settle(self, start: int, n: int, k: int, drafts: list) -> None:
        """Keep x and the n accepted drafts in both sessions, forget the rest."""
        self.rounds += 1
        self.drafted += k
        self.accepted += n
        self.full.rewind(start + n + 1)
        if n < k:
            self.draft.rewind(start + n + 1)
        else:  # every draft agreed: the draft session feeds its last one with the next round's
            self.lag = drafts[-1]
