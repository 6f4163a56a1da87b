"""``needle-wgpu bench``: prefill and decode speed, work per decode step, memory, and a CPU
reference measured in the same run (Needle 3: the NumPy reference; GGUF models: llama.cpp's CPU
engine through xllamacpp, same prompt ids and thread count). A script that prints and saves
numbers, not a timed test."""

from __future__ import annotations

import json
import platform
import random
import time

from .. import load
from ..default_model import default_model
from ..errors import DepthError, InputError
from ..generation import Decoded, Steps, decode
from ..gpu.device import thread_clock
from ..grammar import compile_schema
from ..sampling import Sampling, clamp_count
from ..speculative import MAX_DRAFT, SpeculativeDecoder, speculative_option
from .options import Progress


def host_cost(model, prompt: list, tokens: int, round_tokens: int = 1, pipeline: bool = True) -> dict:
    """The host's cost per decoded token through the one generation loop (``generation.decode``,
    as every surface runs it: the tokenizer's stream decoder, stop checks, bookkeeping), greedy,
    ``tokens`` ids with no end-of-generation id, ``round_tokens`` steps per submit (rounds
    pipelined unless ``pipeline`` is false: ``generation.Steps``). Measured
    from the last id of the first round (whose plan is built then) to the last: the calling thread's CPU time (``gpu.device.thread_clock``:
    GPU work on other threads does not count) split into encode+submit, readback and the rest,
    the readback's wall time, and the ceiling that host time alone allows (1000 / host ms).
    Dispatches, submits and bytes read are counted from the prompt's id to the end, over every
    id after it (the round run ahead and taken back at the end included)."""
    device = model.gpu.device
    session = model.gpu.session(context=len(prompt) + tokens + 1)
    decoder = model.tokenizer.stream_decoder(at_text_start=False) if model.tokenizer is not None else None
    c = device.counters
    marks, counts = [], []

    def mark():
        marks.append((thread_clock(), time.perf_counter(), c.encode_cpu_s, c.read_cpu_s, c.read_wall_s))

    try:
        out = Decoded()
        for event in decode(Steps(session, round_tokens=round_tokens, pipeline=pipeline), prompt, out, sampling=Sampling(),
                            budget=tokens, stop_ids=set(), decoder=decoder):
            if event.id is not None and len(out.ids) == 1:
                counts.append((c.dispatches, c.submits, c.bytes_read))
            if event.id is not None and len(out.ids) == round_tokens + 1:
                mark()
        mark()
        counts.append((c.dispatches, c.submits, c.bytes_read))
    finally:
        session.close()
    if len(marks) < 2:
        raise InputError(f"the host cost needs more than {round_tokens + 1} decode tokens at {round_tokens} a round")
    steps = len(out.ids) - 1 - round_tokens
    cpu, wall, encode, read_cpu, read_wall = ((b - a) / steps for a, b in zip(marks[0][:5], marks[-1][:5]))
    dispatches, submits, read = ((b - a) / (len(out.ids) - 1) for a, b in zip(counts[0], counts[-1]))
    host_ms = 1000 * cpu
    return {"tokens_per_round": round_tokens, "pipelined": pipeline and round_tokens > 1, "decoded": len(out.ids),
            "host_cpu_ms_per_token": round(host_ms, 3), "encode_submit_ms": round(1000 * encode, 3),
            "readback_cpu_ms": round(1000 * read_cpu, 3), "other_ms": round(host_ms - 1000 * (encode + read_cpu), 3),
            "readback_wall_ms": round(1000 * read_wall, 3), "wall_ms_per_token": round(1000 * wall, 3),
            "tok_s": round(1 / max(wall, 1e-9), 3), "host_ceiling_tok_s": round(1000 / max(host_ms, 1e-6), 1),
            "dispatches_per_token": round(dispatches, 2), "submits_per_token": round(submits, 3),
            "bytes_read_per_token": round(read, 2)}


def _rounds(args) -> list:
    """The round lengths ``--tokens-per-round`` asks the host-cost table for (default 1 and 4)."""
    asked = getattr(args, "tokens_per_round", None) or [1, 4]
    return sorted({clamp_count(k, 1, 64, 1) for k in asked})


def _counters(device) -> tuple:
    c = device.counters
    return c.dispatches, c.submits, c.bytes_read


def run_benchmark(args) -> dict:
    path = args.model or str(default_model())
    started = time.perf_counter()
    numerics, depth = getattr(args, "numerics", "float"), getattr(args, "depth", None)
    model = load(path, progress=Progress(), numerics=numerics, depth=depth)
    load_s = time.perf_counter() - started
    g = model.geometry
    device = model.gpu.device
    rng = random.Random(0)
    # Both counts saturate so that prompt + decode fits the model's context.
    prompt_tokens = clamp_count(args.prompt_tokens, 1, g.max_seq_len - 1, 64)
    decode_tokens = clamp_count(args.decode_tokens, 0, g.max_seq_len - prompt_tokens, 16)
    prompt = [2] + [rng.randrange(4, g.vocab) for _ in range(prompt_tokens - 1)]
    greedy = Sampling.saturate(0.0)

    # Warm-up: compiles every pipeline of both plans (not part of the timings).
    session = model.gpu.session(context=len(prompt) + decode_tokens + 2)
    session.prefill(prompt[: min(len(prompt), session.chunk)], greedy)
    session.step(greedy)
    session.close()

    session = model.gpu.session(context=len(prompt) + decode_tokens + 2)
    t0 = time.perf_counter()
    next_id = session.prefill(prompt, greedy)
    prefill_s = time.perf_counter() - t0
    before = _counters(device)
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        next_id = session.step(greedy)
    decode_s = time.perf_counter() - t1
    after = _counters(device)
    steps = max(decode_tokens, 1)
    per_step = [(a - b) / steps for a, b in zip(after, before)]
    allocated = dict(device.counters.bytes_allocated)
    described = model.describe()
    result = {
        "model": str(path),
        "family": described["family"],
        "numerics": numerics,
        "geometry": {"d_model": g.d_model, "layers": g.num_layers, "vocab": g.vocab},
        "adapter": device.adapter_name,
        "host": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "load_s": round(load_s, 3),
        "prompt_tokens": len(prompt),
        "decode_tokens": decode_tokens,
        "prefill_tok_s": round(len(prompt) / max(prefill_s, 1e-9), 3),
        "decode_tok_s": round(decode_tokens / max(decode_s, 1e-9), 3),
        "dispatches_per_decode_step": per_step[0],
        "dispatches_per_layer": round(per_step[0] / g.num_layers, 2),
        "submits_per_decode_step": per_step[1],
        "bytes_read_per_decode_step": per_step[2],
        "gpu_bytes": allocated,
        "file_tensor_bytes": described["tensor_bytes"],
        "weights_over_file_tensor_bytes": round(allocated.get("weights", 0) / described["tensor_bytes"], 4),
        "last_token": next_id,
    }
    session.close()
    if depth is not None:
        result["depth"] = model.describe()["depth"]
    pipeline = not getattr(args, "no_pipeline", False)
    result["host_cost"] = [host_cost(model, prompt, decode_tokens, k, pipeline) for k in _rounds(args)]
    rungs = getattr(args, "rungs", None)
    if rungs:
        result["rungs"] = [_rung_speed(model.gpu, d, prompt, decode_tokens) for d in _depths(rungs, model.gpu)]
    pairs = getattr(args, "speculative", None)
    if pairs is not None:
        result["speculative"] = _speculative_speeds(model.gpu, pairs, prompt, decode_tokens)
    if args.reference:
        reference_speed = {"needle3": _reference_speed, "dense": _llamacpp_speed}[described["family"]]
        result.update(reference_speed(path, prompt, decode_tokens))
        for phase in ("prefill", "decode"):
            reference = max(result[f"reference_{phase}_tok_s"], 1e-9)
            result[f"gpu_over_reference_{phase}"] = round(result[f"{phase}_tok_s"] / reference, 3)
    text = json.dumps(result, indent=2)
    print(text)
    with open(args.json, "w") as f:
        f.write(text + "\n")
    return result


def _reference_speed(path, prompt, decode_tokens) -> dict:
    """The NumPy reference on the same prompt: batched prefill, then cached decode steps."""
    from ..reference.needle3.model import ReferenceModel

    reference = ReferenceModel.from_path(path)
    cache = reference.new_cache()
    t0 = time.perf_counter()
    logits = reference.prefill(prompt, cache)
    prefill_s = time.perf_counter() - t0
    token = int(logits[-1].argmax())
    steps = max(1, min(decode_tokens, 8))
    t1 = time.perf_counter()
    for _ in range(steps):
        token = int(reference.decode_step(token, cache).argmax())
    decode_s = time.perf_counter() - t1
    return {"reference_prefill_tok_s": round(len(prompt) / max(prefill_s, 1e-9), 3),
            "reference_decode_tok_s": round(steps / max(decode_s, 1e-9), 3)}


def _llamacpp_speed(path, prompt, decode_tokens) -> dict:
    """llama.cpp's CPU engine (PyPI xllamacpp, a dev dependency) on the same ids: its own
    prompt and generation timings, with as many threads as this machine has cores."""
    import os

    try:
        import xllamacpp
    except ImportError:
        return {"reference": "llama.cpp not measured (pip install xllamacpp)",
                "reference_prefill_tok_s": 0.0, "reference_decode_tok_s": 0.0}
    threads = os.cpu_count() or 1
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = len(prompt) + decode_tokens + 8
    params.n_parallel = 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    server = xllamacpp.Server(params)
    body = {"prompt": list(prompt), "max_tokens": max(decode_tokens, 1), "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "ignore_eos": True, "seed": 0}
    server.handle_completions(dict(body, max_tokens=1))  # warm-up
    timings = server.handle_completions(body)["timings"]
    return {"reference": f"llama.cpp CPU (xllamacpp {getattr(xllamacpp, '__version__', '?')}), {threads} threads",
            "reference_prefill_tok_s": round(timings["prompt_per_second"], 3),
            "reference_decode_tok_s": round(timings["predicted_per_second"], 3)}


def _depths(requested, gpu) -> list:
    """``--rungs``: depths as given ("all": every rung 2 … L of the file)."""
    layers = gpu.full.stored_geometry.num_layers
    if "all" in requested:
        return list(range(min(2, layers), layers + 1))

    try:
        return [int(d) for d in requested]
    except ValueError:
        raise DepthError(f"--rungs: {requested!r} are not whole numbers (or 'all')") from None


def _rung_speed(gpu, depth: int, prompt: list, decode_tokens: int) -> dict:
    """Prefill and greedy decode speed of one rung over the loaded weights (warm-up first)."""

    greedy = Sampling()
    rung = gpu.full.at_depth(depth)
    context = len(prompt) + decode_tokens + 3
    warm = rung.session(context=context)
    warm.prefill(prompt[: warm.chunk], greedy)
    warm.step(greedy)
    warm.close()
    prefill_s = decode_s = float("inf")
    for _ in range(REPEATS):  # the fastest of a few runs (a shared machine)
        session = rung.session(context=context)
        t0 = time.perf_counter()
        session.prefill(prompt, greedy)
        prefill_s = min(prefill_s, time.perf_counter() - t0)
        session.step(greedy)  # builds the step plan outside the timing
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            session.step(greedy)
        decode_s = min(decode_s, time.perf_counter() - t1)
        session.close()
    return {"depth": depth, "prefill_tok_s": round(len(prompt) / max(prefill_s, 1e-9), 3),
            "decode_tok_s": round(decode_tokens / max(decode_s, 1e-9), 3)}


def speculative_pairs(text_pairs, layers: int) -> list:
    """``--speculative D,K ...`` as (depth, k) pairs; none given: depths 2, L/4, L/2 (below L)
    with k 3 and 7 (verify chunks of 4 and 8 positions: the CPU adapter's matmul tiles)."""
    if text_pairs:
        out = []
        for text in text_pairs:
            try:
                depth, k = (int(v) for v in str(text).split(","))
            except ValueError:
                raise InputError(f"--speculative: {text!r} is not DEPTH,K") from None
            out.append((depth, k))
        return out
    depths = sorted({d for d in (2, layers // 4, layers // 2) if 2 <= d < layers})
    return [(d, k) for d in depths for k in (3, 7)]


REPEATS = 3  # timed runs per configuration, interleaved; the fastest counts (a shared machine)


def _speculative_speeds(gpu, text_pairs, prompt: list, decode_tokens: int) -> dict:
    """Greedy self-speculative decoding for each (depth, k): tok/s over the same prompt and
    budget as plain greedy decoding timed alongside, acceptance, and whether its ids equal the
    plain ones. Every configuration keeps its sessions, rewound to the prompt's end before each
    run: a first run builds the plans (and compiles pipelines), then ``REPEATS`` rounds of timed
    runs interleave plain and speculative decoding, and each one's fastest run is reported."""

    greedy = Sampling()
    layers = gpu.full.stored_geometry.num_layers
    end = len(prompt)
    context = end + decode_tokens + MAX_DRAFT + 3  # rounds never shrink before the budget is out
    plain = gpu.session(context=context)
    # Rewinds reach back at most max_rewind positions: the timed budget fits inside them.
    decode_tokens = max(1, min(decode_tokens, plain.max_rewind - MAX_DRAFT - 2))
    first = plain.prefill(prompt, greedy)

    def run_plain():
        plain.rewind(end)
        return [first] + [plain.step(greedy) for _ in range(decode_tokens)]

    def run_speculative(decoder):
        decoder.full.rewind(end)
        decoder.draft.rewind(end)
        decoder.pending, decoder.lag, decoder.rounds, decoder.drafted, decoder.accepted = first, None, 0, 0, 0
        ids = [first]
        while len(ids) < decode_tokens + 1:
            ids += decoder.round()
        return ids[: decode_tokens + 1]

    configs = [("plain", run_plain)]
    for pair in speculative_pairs(text_pairs, gpu.geometry.num_layers):  # drafts below the depth it runs at
        depth, k = speculative_option(pair, layers, gpu.geometry.num_layers)
        decoder = SpeculativeDecoder(gpu.session(context=context), gpu.at_depth(depth).session(context=context),
                                     k, greedy)
        decoder.start(prompt)
        configs.append((decoder, lambda decoder=decoder: run_speculative(decoder)))
    best, ids_of = {}, {}
    for _ in range(REPEATS + 1):  # the first pass is the warm-up
        for name, run in configs:
            t0 = time.perf_counter()
            ids = run()
            seconds = time.perf_counter() - t0
            if name in ids_of:
                best[name] = min(best.get(name, seconds), seconds)
            ids_of[name] = ids
    plain_tok_s = round(decode_tokens / max(best["plain"], 1e-9), 3)
    runs = []
    for decoder, _ in configs[1:]:
        tok_s = decode_tokens / max(best[decoder], 1e-9)
        runs.append({"depth": decoder.draft.model.geometry.num_layers, "k": decoder.k,
                     "decode_tok_s": round(tok_s, 3), "acceptance": round(decoder.acceptance, 4),
                     "rounds": decoder.rounds, "ids_equal_plain": ids_of[decoder] == ids_of["plain"],
                     "over_plain": round(tok_s / max(plain_tok_s, 1e-9), 3)})
        decoder.full.close()
        decoder.draft.close()
    plain.close()
    fastest = max(runs, key=lambda r: r["decode_tok_s"], default=None)
    faster = fastest is not None and fastest["decode_tok_s"] > plain_tok_s
    return {"decode_tokens": decode_tokens, "repeats": REPEATS, "plain_decode_tok_s": plain_tok_s, "runs": runs,
            "fastest": {"speculative": [fastest["depth"], fastest["k"]] if faster else None}}


# ---------------------------------------------------------------------------- constrained decode

BENCH_TOOLS = [  # the tool-call grammar's load: a number, an enum, free strings, an optional field
    {"name": "set_timer", "parameters": {"type": "object", "properties": {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 600}, "label": {"type": "string", "maxLength": 40}},
        "required": ["minutes"]}},
    {"name": "lights", "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall", "bedroom"]},
        "level": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["on"]}}]
BENCH_SCHEMA = {"type": "object", "properties": {  # a JSON response for families without a tool grammar
    "city": {"type": "string", "maxLength": 40}, "population": {"type": "integer", "minimum": 0},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4}},
    "required": ["city", "population", "landmarks"]}
BENCH_QUERY = "Set a timer for 10 minutes, then turn on the kitchen lights."
BENCH_PROMPT = ("Describe Paris as JSON with the keys city, population and landmarks "
                "(a list of at most four names).")


def run_constrained_benchmark(args) -> dict:
    """Greedy decode with and without the grammar mask on the same prompt and step count: the
    mask's cost per step (mean, p95, max; the first answer's walks cold, later answers on the
    warm cache) and decode tok/s both ways. Needle 3 decodes its tool-call grammar; a family
    without one (the dense GGUF models) a JSON-schema response. After each EOS a fresh answer
    begins in the same session, so both runs step over the same positions."""

    path = args.model or str(default_model())
    numerics, depth = getattr(args, "numerics", "float"), getattr(args, "depth", None)
    model = load(path, progress=Progress(), numerics=numerics, depth=depth)
    g = model.geometry
    calls = model.chat_format.tool_calls
    grammar_of = calls.answer_grammar if calls is not None else None
    if grammar_of is not None:
        grammar, prompt = grammar_of(BENCH_TOOLS), model.encode_request(query=BENCH_QUERY, tools=BENCH_TOOLS)
    else:
        grammar, prompt = compile_schema(BENCH_SCHEMA), model.encode_request(query=BENCH_PROMPT)
    steps = clamp_count(args.decode_tokens, 1, g.max_seq_len - len(prompt) - 2, 16)
    greedy = Sampling.saturate(0.0)
    started = time.perf_counter()  # the vocabulary's tries (once per model) and the automaton
    constraint = model.constraint("bench:" + ("tools" if grammar_of is not None else "schema"), lambda: grammar)
    trie_s = time.perf_counter() - started

    def session():
        return model.gpu.session(context=len(prompt) + steps + 2)

    warm = session()  # compiles the plans with and without the mask (not part of the timings)
    warm.prefill(prompt[: warm.chunk], greedy)
    warm.step(greedy)
    warm.step(greedy, mask=constraint.matcher().mask())
    warm.close()

    def free_run() -> float:
        s = session()
        s.prefill(prompt, greedy)
        t0 = time.perf_counter()
        for _ in range(steps):
            s.step(greedy)
        elapsed = time.perf_counter() - t0
        s.close()
        return elapsed

    free_s = free_run()
    s = session()
    matcher = constraint.matcher()
    next_id = s.prefill(prompt, greedy, mask=matcher.mask(steps + 1))
    mask_times, answers = [], []
    first_answer_steps = None
    t0 = time.perf_counter()
    for done in range(steps):
        matcher.accept(next_id)
        if matcher.ended:  # an answer is complete: the next one starts on the warm cache
            answers.append(matcher.text.decode("utf-8", "replace"))
            first_answer_steps = done if first_answer_steps is None else first_answer_steps
            matcher = constraint.matcher()
        m0 = time.perf_counter()
        left = steps - done  # ids still to sample, this one included
        mask = matcher.mask(left if matcher.fits(left) else None)  # a late answer may run past the end
        mask_times.append(time.perf_counter() - m0)
        next_id = s.step(greedy, mask=mask)
    constrained_s = time.perf_counter() - t0
    s.close()
    free_s = (free_s + free_run()) / 2  # before and after: load drift shows less in the ratio
    ordered = sorted(t * 1000 for t in mask_times)
    first = mask_times[: first_answer_steps or len(mask_times)]
    result = {
        "model": str(path),
        "family": model.describe()["family"],
        "numerics": numerics,
        "depth": model.describe().get("depth"),
        "vocab": g.vocab,
        "grammar": "tool calls" if grammar_of is not None else "JSON schema",
        "adapter": model.gpu.device.adapter_name,
        "host": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "prompt_tokens": len(prompt),
        "decode_steps": steps,
        "trie_build_s": round(trie_s, 3),
        "mask_ms_mean": round(sum(ordered) / len(ordered), 3),
        "mask_ms_p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
        "mask_ms_max": round(ordered[-1], 3),
        "mask_ms_mean_first_answer": round(1000 * sum(first) / max(len(first), 1), 3),
        "trie_walks": constraint.walks,
        "trie_nodes_visited": constraint.nodes_visited,
        "mask_lookups": constraint.lookups,
        "answers_completed": len(answers),
        "first_answer": answers[0] if answers else matcher.text.decode("utf-8", "replace"),
        "unconstrained_decode_tok_s": round(steps / max(free_s, 1e-9), 3),
        "constrained_decode_tok_s": round(steps / max(constrained_s, 1e-9), 3),
        "constrained_over_unconstrained": round(free_s / max(constrained_s, 1e-9), 3),
    }
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    with open(args.json, "w") as f:
        f.write(text + "\n")
    return result
