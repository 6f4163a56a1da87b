"""``needle-wgpu bench --streams 1,4,8,16``: concurrent streams through the server's own path
(``server.scheduler.Scheduler`` with its ``BatchingStepper``: each stream a job running the one
generation loop on pooled sessions, decoded together), without HTTP. All streams of a run are
submitted at once; per stream count it reports the aggregate decode speed while every stream
decodes, the mean per-stream decode speed, time to first token (submission to first id: the
prefills of the others queue before it), and the device's work per batched step. A script that
prints and saves numbers, not a timed test."""

from __future__ import annotations

import json
import os
import platform
import random
import threading
import time

from .. import load
from ..cli.options import Progress
from ..default_model import default_model
from ..sampling import clamp_count
from .scheduler import Job, Scheduler

WAIT_S = 3600  # a run that takes longer than this is reported as unfinished


def _stream_body(prompt: list, tokens: int, context: int):
    def body(model, job):
        for event in model.stream(ids=prompt, max_tokens=tokens, should_stop=job.should_stop, temperature=0.0,
                                  context=context):
            if event.id is not None:
                yield time.perf_counter()

    return body


def run_streams(model, counts: list, prompt_tokens: int, decode_tokens: int, seed: int = 0) -> list:
    """One run per stream count; each stream's session holds ``prompt_tokens + decode_tokens + 2``
    positions (as ``bench`` sizes its one session)."""
    g, device = model.geometry, model.gpu.device
    rng = random.Random(seed)
    rows = []
    for count in counts:
        scheduler = Scheduler(f"bench{count}", lambda: model, max_queue=count, max_sequences=count)
        scheduler.start()
        scheduler.ready.wait()
        if scheduler.load_error is not None:
            raise scheduler.load_error
        times = [[] for _ in range(count)]
        done = threading.Semaphore(0)
        errors = []

        def deliver(i):
            def on(event):
                kind, value = event
                if kind == "data":
                    times[i].append(value)
                else:
                    if kind == "error":
                        errors.append(value)
                    done.release()
            return on

        prompts = [[2] + [rng.randrange(4, g.vocab) for _ in range(prompt_tokens - 1)] for _ in range(count)]
        context = prompt_tokens + decode_tokens + 2
        for i in range(count):  # compiles the pipelines, builds the pieces of batches up to this size
            scheduler.submit(Job("bench", _stream_body(prompts[i][:8], 3, context),
                                 lambda event: done.release() if event[0] != "data" else None, time_limit_s=WAIT_S))
        for _ in range(count):
            done.acquire(timeout=WAIT_S)
        before = (device.counters.dispatches, device.counters.submits)
        stepper = scheduler.stepper
        steps0, rows0 = stepper.steps, stepper.rows
        t0 = time.perf_counter()
        for i in range(count):
            scheduler.submit(Job("bench", _stream_body(prompts[i], decode_tokens, context), deliver(i), time_limit_s=WAIT_S))
        finished = sum(done.acquire(timeout=WAIT_S) for _ in range(count))
        wall = time.perf_counter() - t0
        dispatches, submits = device.counters.dispatches - before[0], device.counters.submits - before[1]
        steps, stepped = stepper.steps - steps0, stepper.rows - rows0
        scheduler.stop()
        firsts = [t[0] for t in times if t]
        ends = [t[-1] for t in times if t]
        start, end = max(firsts), min(ends)  # every stream decoding between these
        together = sum(sum(1 for x in t[1:] if start < x <= end) for t in times)
        per_stream = [(len(t) - 1) / (t[-1] - t[0]) for t in times if len(t) > 1 and t[-1] > t[0]]
        ttft = sorted(f - t0 for f in firsts)
        rows.append({
            "streams": count, "finished": finished, "errors": [str(e) for e in errors],
            "tokens": [len(t) for t in times],
            "aggregate_decode_tok_s": round(together / (end - start), 3) if end > start else None,
            "per_stream_decode_tok_s": round(sum(per_stream) / len(per_stream), 3) if per_stream else None,
            "ttft_s_mean": round(sum(ttft) / len(ttft), 3), "ttft_s_max": round(ttft[-1], 3),
            "wall_s": round(wall, 3),
            "batched_steps": steps, "mean_rows_per_step": round(stepped / steps, 2) if steps else 0,
            "dispatches_per_submit": round(dispatches / submits, 1) if submits else 0,
            "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        })
        print(json.dumps(rows[-1]), flush=True)
    one = next((r["aggregate_decode_tok_s"] for r in rows if r["streams"] == 1), None)
    for row in rows:
        if one and row["aggregate_decode_tok_s"]:
            row["aggregate_over_one_stream"] = round(row["aggregate_decode_tok_s"] / one, 2)
    return rows


def best_of(rows: list) -> list:
    """Per stream count over the repeated series: the fastest aggregate and per-stream speeds and
    the shortest times to first token (the figures machine load disturbs least), and the best
    aggregate over the best one-stream speed."""
    out = []
    for count in sorted({r["streams"] for r in rows}):
        mine = [r for r in rows if r["streams"] == count]
        pick = lambda key, f: f(r[key] for r in mine if r[key] is not None) if any(r[key] is not None for r in mine) \
            else None
        out.append({"streams": count, "aggregate_decode_tok_s": pick("aggregate_decode_tok_s", max),
                    "per_stream_decode_tok_s": pick("per_stream_decode_tok_s", max),
                    "ttft_s_mean": pick("ttft_s_mean", min), "ttft_s_max": pick("ttft_s_max", min)})
    one = next((r["aggregate_decode_tok_s"] for r in out if r["streams"] == 1), None)
    for row in out:
        if one and row["aggregate_decode_tok_s"]:
            row["aggregate_over_one_stream"] = round(row["aggregate_decode_tok_s"] / one, 2)
    return out


def run_streams_benchmark(args) -> dict:
    path = args.model or str(default_model())
    model = load(path, progress=Progress())
    g = model.geometry
    counts = sorted({max(1, int(c)) for c in str(args.streams).split(",") if c.strip()})
    prompt_tokens = clamp_count(args.prompt_tokens, 1, g.max_seq_len - 1, 64)
    decode_tokens = clamp_count(args.decode_tokens, 2, g.max_seq_len - prompt_tokens, 16)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    repeats = clamp_count(getattr(args, "repeat", 1), 1, 100, 1)
    rows = [row for r in range(repeats) for row in run_streams(model, counts, prompt_tokens, decode_tokens, seed=r)]
    result = {"model": str(path), "adapter": model.gpu.device.adapter_name, "started": started,
              "host": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
                      f"{platform.python_version()}",
              "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "runs": rows,
              "best": best_of(rows)}
    text = json.dumps(result, indent=2)
    print(text)
    with open(args.json, "w") as f:
        f.write(text + "\n")
    return result
