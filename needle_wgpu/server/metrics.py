"""``GET /metrics``: counters, histograms and gauges in Prometheus' text format (version 0.0.4),
written here rather than through a client library: a dozen series need no dependency.

Updated from the HTTP layer (requests by path and status) and from the models' worker threads
(tokens, latencies), hence the lock. Gauges that describe a scheduler's state right now (queue
depth, active sequences, KV bytes) are read from the schedulers when the page is rendered.
"""

from __future__ import annotations

import math
import threading

# Seconds. Time to first token spans a warm tiny model to a long prompt on a CPU "GPU";
# per-token latency a fast GPU to lavapipe.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

PREFIX = "needle_wgpu_"


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.http = {}  # (path, status) -> count
        self.requests = {}  # (model, endpoint, outcome) -> count
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = {}, {}, {}  # model -> count
        self.ttft, self.per_token = {}, {}  # model -> Histogram

    def http_request(self, path: str, status: int) -> None:
        with self.lock:
            key = (path, str(status))
            self.http[key] = self.http.get(key, 0) + 1

    def finished(self, model: str, endpoint: str, outcome: str, prompt_tokens: int = 0, completion_tokens: int = 0,
                 ttft_s: float | None = None, per_token_s: float | None = None, cached_tokens: int = 0) -> None:
        """One request of a model ended (``outcome``: "ok" or the error code)."""
        with self.lock:
            key = (model, endpoint, outcome)
            self.requests[key] = self.requests.get(key, 0) + 1
            self.prompt_tokens[model] = self.prompt_tokens.get(model, 0) + prompt_tokens
            self.completion_tokens[model] = self.completion_tokens.get(model, 0) + completion_tokens
            self.cached_tokens[model] = self.cached_tokens.get(model, 0) + cached_tokens
            if ttft_s is not None:
                self.ttft.setdefault(model, Histogram(TTFT_BUCKETS)).observe(ttft_s)
            if per_token_s is not None:
                self.per_token.setdefault(model, Histogram(TOKEN_BUCKETS)).observe(per_token_s)

    def render(self, schedulers: dict) -> str:
        """The exposition text; ``schedulers``: served name -> ``Scheduler`` (for the gauges)."""
        out = []

        def family(name, kind, help_text):
            out.append(f"# HELP {PREFIX}{name} {help_text}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")

        def sample(name, labels: dict, value):
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            out.append(f"{PREFIX}{name}{{{inner}}} {_number(value)}" if inner else f"{PREFIX}{name} {_number(value)}")

        with self.lock:
            family("http_requests_total", "counter", "HTTP requests answered, by path and status")
            for (path, status), n in sorted(self.http.items()):
                sample("http_requests_total", {"path": path, "status": status}, n)
            family("requests_total", "counter", "Model requests finished, by model, endpoint and outcome")
            for (model, endpoint, outcome), n in sorted(self.requests.items()):
                sample("requests_total", {"model": model, "endpoint": endpoint, "outcome": outcome}, n)
            family("prompt_tokens_total", "counter", "Prompt tokens of finished requests")
            for model, n in sorted(self.prompt_tokens.items()):
                sample("prompt_tokens_total", {"model": model}, n)
            family("completion_tokens_total", "counter", "Generated tokens of finished requests")
            for model, n in sorted(self.completion_tokens.items()):
                sample("completion_tokens_total", {"model": model}, n)
            family("prompt_tokens_cached_total", "counter", "Prompt tokens taken from the prefix cache, not prefilled")
            for model, n in sorted(self.cached_tokens.items()):
                sample("prompt_tokens_cached_total", {"model": model}, n)
            for name, histograms, help_text in (
                    ("time_to_first_token_seconds", self.ttft, "Arrival to the first generated token"),
                    ("time_per_output_token_seconds", self.per_token,
                     "Mean decode time per generated token after the first, one sample per request")):
                family(name, "histogram", help_text)
                for model, h in sorted(histograms.items()):
                    for bound, n in zip(h.buckets, h.counts):
                        sample(f"{name}_bucket", {"model": model, "le": _number(bound)}, n)
                    sample(f"{name}_bucket", {"model": model, "le": "+Inf"}, h.count)
                    sample(f"{name}_sum", {"model": model}, h.sum)
                    sample(f"{name}_count", {"model": model}, h.count)
        gauges = {name: s.gauges() for name, s in sorted(schedulers.items())}
        for key, help_text in (("queue_depth", "Requests waiting for a model's worker"),
                               ("active_sequences", "Sequences a model's worker is running"),
                               ("kv_bytes_in_use", "KV cache bytes held by the running sequences"),
                               ("prefix_cache_bytes", "KV cache bytes the prefix cache holds for later requests"),
                               ("kv_pool_bytes", "KV cache bytes a model's pool of sequences has open (running, "
                                                 "kept by the prefix cache, or free for the next request)"),
                               ("kv_pool_sequences", "Sequences a model's KV pool may hold at once")):
            family(key, "gauge", help_text)
            for model, values in gauges.items():
                sample(key, {"model": model}, values[key])
        return "\n".join(out) + "\n"


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
