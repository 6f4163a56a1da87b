"""Batched prefill vs token-by-token prime: the verdict of spec dense-gguf §7.

A prefill (GEMM over a chunk of positions) and a token-by-token prime (GEMV per position) sum in
different orders, so their last-position logits differ slightly and may flip a near-tie argmax.
``classify`` names the pair (tokenwise logits tw, batched logits bp):

- Structured  if max|tw - bp| is not finite or exceeds MAXDIFF;
- Match       else if argmax(tw) == argmax(bp);
- NearTieFlip else if top1 - top2 of tw <= MARGIN;
- Structured  otherwise.

MAXDIFF and MARGIN depend on the weights' quantisation type; ``THRESHOLDS`` holds the values
measured on our kernels by ``tools/verdict_sweep.py`` (BENCHMARKS.md, "Verdict thresholds"),
never values carried over from another engine. Plain Python: it runs in the browser too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

MATCH, NEAR_TIE_FLIP, STRUCTURED = "Match", "NearTieFlip", "Structured"
BATTERY = Path(__file__).with_name("verdict_prompts.txt")


@dataclass(frozen=True)
class Thresholds:
    maxdiff: float  # the largest max|tw - bp| a healthy engine may show
    margin: float   # the largest tokenwise top1 - top2 at which a healthy argmax may flip


# Measured 2026-12-01 on lavapipe by
#   python3 tools/verdict_sweep.py --shapes cpu                      (128 prompts per file)
#   python3 tools/verdict_sweep.py --shapes gpu --limit 12 --no-smollm2
#   python3 tools/verdict_sweep.py --shapes cpu --types "" --no-smollm2 --file gemma-3-270m-q4_k_m.gguf
# (merged: docs/verdict_sweep.json; BENCHMARKS.md, "Verdict thresholds"): the 128-prompt battery
# on SmolLM2-135M (Q4_1 matrices, Q8_0 head), Gemma-3-270M (Q8_0, Q5_0, Q4_K, Q6_K) and on synthetic llama files (d 256, 2 layers) with
# every matrix in one type, both kernel shapes of §8 (the GPU shape on its first 12 prompts).
# No first-token flip was seen anywhere. Rule (RULE): MAXDIFF = 4 x the largest healthy
# maxdiff; MARGIN = 2 x the largest healthy maxdiff (a flip needs the top two logits to move
# apart by the margin, so one of them by at least half of it), or the largest flip margin seen
# if larger; both rounded up to two significant digits, at least FLOOR. A type's numbers come
# from every file that holds it (Q4_1 and Q8_0: SmolLM2 too; Q8_0, Q5_0, Q4_K, Q6_K: Gemma).
RULE = "maxdiff = 4 x max healthy maxdiff; margin = max(2 x max healthy maxdiff, max flip margin); 2 sig. digits up"
FLOOR = 1e-6  # only where a sweep saw bit-identical logits everywhere
THRESHOLDS: dict = {  # type: Thresholds(MAXDIFF, MARGIN)   # largest healthy maxdiff seen
    "F32": Thresholds(0.00029, 0.00015),   # 7.25e-05
    "F16": Thresholds(0.00032, 0.00016),   # 7.77e-05
    "BF16": Thresholds(0.00029, 0.00015),  # 7.25e-05
    "Q8_0": Thresholds(0.00055, 0.00028),  # 1.36e-04 (SmolLM2)
    "Q4_0": Thresholds(0.00028, 0.00014),  # 6.87e-05
    "Q4_1": Thresholds(0.00055, 0.00028),  # 1.36e-04 (SmolLM2)
    "Q5_0": Thresholds(0.00048, 0.00024),  # 1.18e-04 (Gemma)
    "Q5_1": Thresholds(0.0003, 0.00015),   # 7.44e-05
    "Q4_K": Thresholds(0.00048, 0.00024),  # 1.18e-04 (Gemma)
    "Q5_K": Thresholds(0.00037, 0.00019),  # 9.16e-05
    "Q6_K": Thresholds(0.00048, 0.00024),  # 1.18e-04 (Gemma)
    # Measured 2026-12-04, same rule, synthetic files only (tools/verdict_sweep.py --types ...):
    # CPU shape on all 128 prompts; GPU shape on 128 (Q2_K, Q3_K) or the first 12 (IQ4_NL, IQ4_XS).
    "Q2_K": Thresholds(0.00036, 0.00018),   # 8.87e-05
    "Q3_K": Thresholds(0.00034, 0.00017),   # 8.39e-05
    "IQ4_NL": Thresholds(0.00035, 0.00018),  # 8.54e-05
    "IQ4_XS": Thresholds(0.00032, 0.00016),  # 7.77e-05
}


@dataclass(frozen=True)
class Verdict:
    kind: str        # MATCH, NEAR_TIE_FLIP or STRUCTURED
    maxdiff: float   # max |tw - bp| (inf or nan when either side is not finite)
    margin: float    # tokenwise top1 - top2
    tokenwise_top: int
    batched_top: int


def top_two(logits: list) -> tuple:
    """(index of the largest value, largest, second largest); the first index wins a tie."""
    best, first, second = 0, -math.inf, -math.inf
    for i, value in enumerate(logits):
        if value > first:
            best, first, second = i, value, first
        elif value > second:
            second = value
    return best, first, second


def classify(tokenwise: list, batched: list, thresholds: Thresholds) -> Verdict:
    """The §7 verdict of one pair of last-position logit vectors (same length)."""
    if len(tokenwise) != len(batched) or not tokenwise:
        raise InputError(f"logit vectors of {len(tokenwise)} and {len(batched)} values cannot be compared")
    diff = 0.0
    for a, b in zip(tokenwise, batched):
        d = abs(a - b)
        if d > diff:
            diff = d
        elif d != d:  # nan on either side (inf - inf too)
            diff = math.nan
            break
    tw_top, tw_first, tw_second = top_two(tokenwise)
    bp_top = top_two(batched)[0]
    margin = tw_first - tw_second
    if not math.isfinite(diff) or diff > thresholds.maxdiff:
        kind = STRUCTURED
    elif tw_top == bp_top:
        kind = MATCH
    elif margin <= thresholds.margin:
        kind = NEAR_TIE_FLIP
    else:
        kind = STRUCTURED
    return Verdict(kind, diff, margin, tw_top, bp_top)


def quant_types(model) -> list:
    """The quantisation types of a model's tensors (``describe()["quant_bytes"]``)."""
    return sorted(model.describe().get("quant_bytes", {}))


def thresholds_for(types, table: dict | None = None) -> Thresholds:
    """The loosest calibrated thresholds over ``types`` (a file mixes several); F32 vectors
    (norms, biases) are in every file and count only when nothing else is there."""
    table = THRESHOLDS if table is None else table
    types = [t for t in types if t != "F32"] or list(types)
    known = [table[t] for t in types if t in table]
    if not known:
        raise InputError(f"no calibrated verdict thresholds for {', '.join(types) or 'no types'} "
                         f"(calibrated: {', '.join(sorted(table))})")
    return Thresholds(max(t.maxdiff for t in known), max(t.margin for t in known))


def read_battery(path=None) -> list:
    """The prompts of a battery file (default: the shipped one), escapes decoded."""
    try:
        text = Path(path or BATTERY).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: a battery file is UTF-8 text ({exc.reason} at byte {exc.start})") from None
    prompts = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        prompts.append(line.replace("\\n", "\n").replace("\\t", "\t"))
    return prompts


def both_logits(model, ids: list, kv: str = "f32") -> tuple:
    """(tokenwise, batched) last-position logits of ``ids``, each from a fresh session."""
    out = []
    for tokenwise in (True, False):
        session = model.gpu.session(context=len(ids), kv=kv)
        try:
            out.append(session.last_logits(ids, tokenwise=tokenwise))
        finally:
            session.close()
    return tuple(out)


def compare(model, ids: list, thresholds: Thresholds, kv: str = "f32") -> Verdict:
    """The verdict of one prompt's ids on ``model`` (an ``api.Model``)."""
    tokenwise, batched = both_logits(model, ids, kv)
    return classify(tokenwise, batched, thresholds)


@dataclass
class BatteryResult:
    prompt: str
    tokens: int
    verdict: Verdict


def run_battery(model, prompts: list, thresholds: Thresholds, kv: str = "f32", report=None) -> list:
    """``compare`` every prompt (tokenised by the model's own tokenizer); ``report(result)``
    after each. Empty prompts (no ids) are skipped."""
    results = []
    for prompt in prompts:
        ids = model.encode_request(prompt)
        if not ids:
            continue
        ids = ids[: model.geometry.max_seq_len]
        result = BatteryResult(prompt, len(ids), compare(model, ids, thresholds, kv))
        results.append(result)
        if report is not None:
            report(result)
    return results


def summary(results: list) -> dict:
    counts = {MATCH: 0, NEAR_TIE_FLIP: 0, STRUCTURED: 0}
    for r in results:
        counts[r.verdict.kind] += 1
    finite = [r.verdict.maxdiff for r in results if math.isfinite(r.verdict.maxdiff)]
    flips = [r.verdict.margin for r in results if r.verdict.tokenwise_top != r.verdict.batched_top]
    return {"prompts": len(results), "counts": counts, "max_maxdiff": max(finite, default=0.0),
            "flips": len(flips), "max_flip_margin": max(flips, default=0.0)}


def round_up(value: float, digits: int = 2) -> float:
    """``value`` rounded up to ``digits`` significant digits."""
    if value <= 0:
        return 0.0
    scale = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return math.ceil(value / scale - 1e-9) * scale


def derive(maxdiffs: list, flip_margins: list) -> Thresholds:
    """Thresholds from a healthy sweep's maxdiffs and first-token flip margins (RULE)."""
    largest = max(maxdiffs, default=0.0)
    maxdiff = max(FLOOR, round_up(4 * largest))
    margin = max(FLOOR, round_up(max(2 * largest, max(flip_margins, default=0.0))))
    return Thresholds(float(f"{maxdiff:.6g}"), float(f"{margin:.6g}"))


def sweep_runs_holding(runs: list, qtype: str) -> list:
    """The sweep's runs (``tools/verdict_sweep.py`` JSON) whose file holds ``qtype``; F32 counts
    only for an all-F32 file (every file keeps its norms in F32)."""
    return [r for r in runs if qtype in r["types"] and (qtype != "F32" or r["types"] == ["F32"])]


def thresholds_from_sweep(runs: list) -> dict:
    """Thresholds per type from a sweep's runs by ``derive`` (how THRESHOLDS was made)."""
    table = {}
    for qtype in sorted({t for run in runs for t in run["types"]}):
        holding = sweep_runs_holding(runs, qtype)
        if holding:
            table[qtype] = derive([m for r in holding for m in r["all_maxdiffs"]],
                                  [f["margin"] for r in holding for f in r["flips"]])
    return table


def timed_battery(model, prompts, thresholds, kv="f32", report=None) -> tuple:
    started = time.perf_counter()
    results = run_battery(model, prompts, thresholds, kv, report)
    return results, time.perf_counter() - started
