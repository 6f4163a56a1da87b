"""llama.cpp as a test oracle (spec dense-gguf.md §9), through PyPI `xllamacpp`.

`xllamacpp.Server` runs llama.cpp's server in this process: completions are plain Python calls
(`handle_completions(dict) -> dict`), `/tokenize` is HTTP on its 127.0.0.1 listening address.
One `LlamaCppOracle` per model file; `oracle_for(path)` keeps one per path for the session.

Settings, and why:
- threads 2 (the test machine's cores), one slot, a small context;
- `cache_prompt` off: every request evaluates its prompt from scratch, so a result does not
  depend on which request came before;
- K/V cache f32 and flash attention off by default: both are f16 paths in llama.cpp's CPU
  backend and only add noise to a parity check; the weights' own quantisation and the 8-bit
  activations of the quantised matmuls are what is left (pass kv="f16", flash_attn=True for
  llama.cpp's defaults).
Log-probabilities are of the raw logits (softmax over the whole vocabulary, no temperature),
`post_sampling_probs` off.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Step:
    """One generated token: its id and the top-k (id, log-prob) pairs of that step, best first."""

    id: int
    top: tuple[tuple[int, float], ...]

    @property
    def margin(self) -> float:
        """log p(top-1) − log p(top-2) of this step."""
        return self.top[0][1] - self.top[1][1]


class LlamaCppOracle:
    def __init__(self, model_path: str | Path, *, n_ctx: int = 256, threads: int = 2,
                 kv: str = "f32", flash_attn: bool = False):
        import xllamacpp  # here, so the comparison helpers import without it

        params = xllamacpp.CommonParams()
        params.model.path = str(model_path)
        params.n_ctx = n_ctx
        params.n_parallel = 1
        params.cpuparams.n_threads = threads
        params.cpuparams_batch.n_threads = threads
        kv_type = {"f32": xllamacpp.ggml_type.GGML_TYPE_F32, "f16": xllamacpp.ggml_type.GGML_TYPE_F16}[kv]
        params.cache_type_k = kv_type
        params.cache_type_v = kv_type
        params.flash_attn_type = (xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.warmup = False
        self.path = Path(model_path)
        self.server = xllamacpp.Server(params)
        self.address = self.server.listening_address

    def close(self) -> None:
        self.server = None  # ~Server stops llama.cpp's loop

    def _complete(self, ids: list[int], max_tokens: int, n_probs: int) -> list[Step]:
        body = {"prompt": [int(i) for i in ids], "max_tokens": max_tokens, "n_probs": n_probs,
                "temperature": 0.0, "top_k": 1, "cache_prompt": False, "post_sampling_probs": False,
                "repeat_penalty": 1.0, "seed": 0}
        reply = self.server.handle_completions(body)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp: {reply['error']}")
        if reply["usage"]["prompt_tokens"] != len(ids):  # e.g. a BOS added to the ids
            raise RuntimeError(f"llama.cpp evaluated {reply['usage']['prompt_tokens']} prompt tokens, "
                               f"not the {len(ids)} given")
        logprobs = reply["choices"][0]["logprobs"]
        steps = logprobs["content"] if logprobs else []
        if len(steps) != reply["usage"]["completion_tokens"]:
            # The server holds back the text of a token that ends inside a UTF-8 sequence, and
            # drops its log-probs with it (synth_gguf gives such tokens near-zero head rows).
            raise RuntimeError(f"llama.cpp returned log-probs for {len(steps)} of "
                               f"{reply['usage']['completion_tokens']} tokens (a partial UTF-8 token?)")
        return [Step(s["id"], tuple((t["id"], t["logprob"]) for t in s["top_logprobs"])) for s in steps]

    def top_logprobs(self, ids: list[int], k: int = 10) -> list[tuple[int, float]]:
        """The k most likely next tokens after `ids` as (id, log-prob), best first. k may be the
        whole vocabulary (49152 entries take ~0.6 s)."""
        return list(self._complete(ids, 1, k)[0].top)

    def greedy(self, ids: list[int], steps: int, k: int = 2) -> list[Step]:
        """Greedy continuation of `ids` (stops early at an end-of-generation token)."""
        return self._complete(ids, steps, k)

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        body = json.dumps({"content": text, "add_special": add_special,
                           "parse_special": parse_special}).encode()
        request = urllib.request.Request(f"{self.address}/tokenize", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())["tokens"]


_ORACLES: dict[str, LlamaCppOracle] = {}


def oracle_for(path: str | Path) -> LlamaCppOracle:
    """One oracle per model file for the whole test session (loading costs ~1 s)."""
    key = str(Path(path).resolve())
    if key not in _ORACLES:
        _ORACLES[key] = LlamaCppOracle(path)
    return _ORACLES[key]


def close_all() -> None:
    for oracle in _ORACLES.values():
        oracle.close()
    _ORACLES.clear()


# ---------------------------------------------------------------------------------- comparisons


def log_softmax(logits) -> np.ndarray:
    """Log-probabilities of one logit vector, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max()
    return x - (top + np.log(np.exp(x - top).sum()))


def kl_divergence(oracle_top: list[tuple[int, float]], ours: np.ndarray) -> float:
    """KL(llama.cpp || ours) from llama.cpp's top-k (id, log-prob) and our full log-probs.

    The ids outside the top-k form one "tail" bucket on both sides: sum over the top-k of
    p (log p − log q), plus p_tail log(p_tail / q_tail). By the data-processing inequality that
    is a lower bound of the full KL, tight when the tail is small; asked for the whole
    vocabulary it is the exact KL (llama.cpp's probabilities are then renormalised: its f32
    softmax sums to 1 ± 1e-4).
    """
    ids = np.array([i for i, _ in oracle_top])
    log_p = np.array([lp for _, lp in oracle_top], dtype=np.float64)
    log_q = ours[ids]
    if len(ids) == len(ours):
        log_p = log_softmax(log_p)
        return float(np.sum(np.exp(log_p) * (log_p - log_q)))
    p, q = np.exp(log_p), np.exp(log_q)
    kl = float(np.sum(p * (log_p - log_q)))
    p_tail, q_tail = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 1e-300)
    return kl + (p_tail * np.log(p_tail / q_tail) if p_tail > 0 else 0.0)


def top_overlap(oracle_top: list[tuple[int, float]], ours: np.ndarray, k: int = 10) -> int:
    """How many of llama.cpp's top-k ids are among our top-k."""
    ours_top = set(np.argsort(-ours, kind="stable")[:k].tolist())
    return len({i for i, _ in oracle_top[:k]} & ours_top)


def compare_next_token(next_logits, vocab: int, oracle: LlamaCppOracle, prompts, kl_limit: float,
                       exact_next_logits=None) -> list:
    """Top-10 overlap and KL(llama.cpp || ours) at the last position of each prompt, over the
    whole vocabulary (so the KL is exact: no tail to estimate); asserts overlap >= 8 and
    KL <= ``kl_limit``. ``next_logits(ids)`` is ours (the NumPy reference or the engine). With
    ``exact_next_logits`` (a float64 forward) also check that ours, not llama.cpp, is the one
    next to it. Returns (T, top-10 overlap, KL[, max |ours - f64|, max |llama.cpp - f64|]) per
    prompt."""
    figures = []
    for ids in prompts:
        ours = log_softmax(next_logits(ids))
        top = oracle.top_logprobs(ids, k=vocab)
        kl, overlap = kl_divergence(top, ours), top_overlap(top, ours)
        row = [len(ids), overlap, kl]
        if exact_next_logits is not None:
            truth = log_softmax(exact_next_logits(ids))
            theirs = np.full(vocab, -np.inf)
            theirs[[i for i, _ in top]] = [lp for _, lp in top]
            likely = truth > -20  # log-probs of the tokens that carry any mass
            row += [np.abs(ours - truth)[likely].max(), np.abs(theirs - truth)[likely].max()]
        figures.append(tuple(row))
        assert overlap >= 8, figures
        assert kl <= kl_limit, figures
        if exact_next_logits is not None:
            assert row[3] < 1e-3 and row[4] > 10 * row[3], figures
    return figures
