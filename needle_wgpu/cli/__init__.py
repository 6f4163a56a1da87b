"""The ``needle-wgpu`` command: generate, chat, info, logits, bench, heads, verdict, synth, serve.

It never prints a traceback: a ``NeedleError`` is one line on stderr and exit status 2, output
that cannot be written (a full disk, a closed pipe) is handled, and text that the terminal's
encoding cannot show is escaped rather than fatal.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
from pathlib import Path

from .. import load, verdict
from ..default_model import default_model
from ..engine import GenerationResult
from ..errors import InputError, NeedleError
from ..families import describe
from ..grammar import GrammarError, compile_schema
from ..sampling import clamp_count
from .bench import run_benchmark, run_constrained_benchmark, speculative_pairs
from .chat import run_chat
from .serve import add_serve_parser, run_streams_benchmark
from .options import Progress, add_sampling_options, join_option_values, sampling_keywords, writes_utf8

DEFAULT_QUERY = "What's the weather in Paris?"
DEFAULT_TOOLS = ('[{"name":"get_weather","description":"Current weather for a city",'
                 '"parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}]')


def _load(path, progress, numerics="float", depth=None):
    return load(path, progress=progress, numerics=numerics, depth=depth)


def _load_args(args, path, progress):
    """``_load`` with the command's ``--numerics`` and ``--depth`` (a rung of a Needle 3 file,
    §10), where given."""
    numerics, depth = getattr(args, "numerics", "float"), getattr(args, "depth", None)
    return _load(path, progress, numerics) if depth is None else _load(path, progress, numerics, depth=depth)


def read_json_schema(path) -> tuple:
    """``--json-schema FILE``: (the schema, its grammar's nodes), compiled before the model
    loads. A file that cannot be read, is not JSON or is outside the schema subset is a
    ``NeedleError`` (one line, exit status 2)."""

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NeedleError(f"--json-schema: cannot read {path} ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"--json-schema: {path} is not JSON ({exc})") from None
    try:
        return schema, compile_schema(schema)
    except GrammarError as exc:
        raise GrammarError(f"--json-schema: {path}: {exc}") from None


def schema_constraint(model, schema, nodes):
    return model.constraint("schema:" + json.dumps(schema, ensure_ascii=False), lambda: nodes)


def cmd_generate(args) -> int:
    schema = read_json_schema(args.json_schema) if args.json_schema else None
    if schema is not None and (args.prompt is None or args.query is not None or args.tools is not None or args.stop):
        raise NeedleError("--json-schema constrains a raw completion: give --prompt, and no --query, --tools "
                          "or --stop")
    if args.speculative is not None and (schema is not None or args.logprobs is not None):
        raise NeedleError("--speculative decodes unconstrained, without logprobs: drop --json-schema / --logprobs")
    model = _load_args(args, _path_of(args), Progress(args.quiet))
    options = dict(sampling_keywords(args), kv=args.kv, stop=args.stop or (), context=args.context)
    if args.logprobs is not None:
        options.update(logprobs=True, top_logprobs=args.logprobs)
    if args.speculative is not None:
        options["speculative"] = speculative_pairs([args.speculative], 0)[0]
        options["constrained"] = False
    if schema is not None:
        options["constrained"] = schema_constraint(model, *schema)
    if args.prompt is not None:
        request = dict(prompt=args.prompt)
    else:
        request = dict(query=args.query or DEFAULT_QUERY, tools=args.tools or DEFAULT_TOOLS)

    result = GenerationResult("", [], "empty", 0)
    for event in model.stream(**request, result=result, **options):
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    completion = model.chat_format.parse(result.text) if "query" in request else None
    if args.json:
        print(json.dumps(_result_json(result, completion), ensure_ascii=not writes_utf8(sys.stdout)))
        return 0
    sys.stdout.write("\n")
    if completion is not None:
        calls = {"tool_calls": completion.tool_calls, "problems": completion.problems}
        print(json.dumps(calls, ensure_ascii=not writes_utf8(sys.stdout)))
    print(f"[{len(result.ids)} tokens, finish: {result.finish_reason}, prompt {result.prompt_tokens} tokens, "
          f"first token {result.time_to_first_token_s * 1000:.0f} ms, prefill {result.prefill_tokens_per_s:.1f} tok/s, "
          f"decode {result.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
    return 0


def _result_json(result, completion) -> dict:
    """``generate --json``: the whole result as one JSON object."""
    out = {"ids": result.ids, "text": result.text, "finish_reason": result.finish_reason,
           "prompt_tokens": result.prompt_tokens, "clamped_ids": result.clamped_ids,
           "timings": {"time_to_first_token_s": round(result.time_to_first_token_s, 6),
                       "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 3),
                       "decode_tokens_per_s": round(result.decode_tokens_per_s, 3)}}
    if completion is not None:
        out["tool_calls"], out["problems"] = completion.tool_calls, completion.problems
    if result.logprobs is not None:
        out["logprobs"] = result.logprobs
    return out


def cmd_heads(args) -> int:
    """``heads``: the probe heads of a Needle 3 model over a text or ids, as one JSON object."""
    model = _load_args(args, Path(args.model), Progress(args.quiet))
    if args.ids is not None:
        try:
            source = dict(ids=[int(i) for i in args.ids.split(",") if i.strip()])
        except ValueError:
            raise NeedleError(f"--ids: {args.ids!r} is not a comma-separated list of integers") from None
    else:
        source = dict(text=args.text or "")
    wanted = args.head or ["embedding", "confidence", "router"]
    present = {1: "embedding", 2: "confidence", 3: "router"}
    have = {present[c] for c in model.capabilities.heads}
    out = {}
    for name in wanted:
        if name not in have and args.head is None:
            continue  # by default, only the heads the file has
        if name == "embedding":
            out["embedding"] = model.embed(**source)
        elif name == "router":
            route = model.route(**source)
            out["router"] = {"logits": route.logits, "calibration": route.calibration}
        else:
            ids = source.get("ids")
            out["confidence"] = model.confidence(ids) if ids is not None else \
                model.confidence(prompt=source["text"])
    print(json.dumps(out))
    return 0


def cmd_chat(args) -> int:
    schema = read_json_schema(args.json_schema) if args.json_schema else None
    model = _load(_path_of(args), Progress(args.quiet))
    args.constraint = schema_constraint(model, *schema) if schema is not None else None
    return run_chat(args, model)


def cmd_info(args) -> int:
    described = describe(args.model, context=args.context) if args.depth is None else \
        describe(args.model, context=args.context, depth=args.depth)
    print(json.dumps(described, indent=2))
    return 0


def cmd_logits(args) -> int:
    """``logits``: the logits after every id (or only the last, ``--last``) as JSON."""
    model = _load_args(args, Path(args.model), Progress(args.quiet))
    ids = _ids_option(args.ids)
    rows = model.logits(ids)
    print(json.dumps({"ids": ids, "depth": model.geometry.num_layers if model.capabilities.depth_ladder else None,
                      "logits": rows[-1:] if args.last else rows}))
    return 0


def _ids_option(text: str) -> list:
    try:
        return [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        raise NeedleError(f"--ids: {text!r} is not a comma-separated list of integers") from None


def cmd_bench(args) -> int:
    if args.constrained and (args.rungs is not None or args.speculative is not None):
        raise NeedleError("bench --constrained measures the grammar mask alone: run --rungs/--speculative "
                          "separately")
    if args.streams is not None and (args.constrained or args.rungs is not None or args.speculative is not None):
        raise NeedleError("bench --streams measures concurrent streams alone: run the other options separately")
    _check_writable(args.json)  # before minutes of benchmarking, not after
    if args.streams is not None:
        run_streams_benchmark(args)
        return 0
    (run_constrained_benchmark if args.constrained else run_benchmark)(args)
    return 0


def cmd_verdict(args) -> int:
    """Spec dense-gguf §7 over a battery: one line per prompt, then a summary. Exit status 3
    when any prompt is Structured (1 stays "output could not be written")."""

    prompts = verdict.read_battery(args.prompts)
    prompts = prompts[: clamp_count(args.limit, 0, len(prompts), len(prompts))]
    model = _load(Path(args.model), Progress(args.quiet))
    types = verdict.quant_types(model)
    thresholds = verdict.thresholds_for(types)
    print(f"# {args.model}: types {', '.join(types)}; MAXDIFF {thresholds.maxdiff:g}, MARGIN {thresholds.margin:g}")
    count = [0]

    def report(result) -> None:
        count[0] += 1
        v = result.verdict
        text = result.prompt if len(result.prompt) <= 48 else result.prompt[:45] + "..."
        print(f"{count[0]:4d} {v.kind:<11} maxdiff {v.maxdiff:.3g} margin {v.margin:.3g} top {v.tokenwise_top}/"
              f"{v.batched_top} tokens {result.tokens:3d} {json.dumps(text, ensure_ascii=False)}", flush=True)

    results, seconds = verdict.timed_battery(model, prompts, thresholds, kv=args.kv, report=report)
    s = verdict.summary(results)
    c = s["counts"]
    print(f"# {s['prompts']} prompts: {c[verdict.MATCH]} Match, {c[verdict.NEAR_TIE_FLIP]} NearTieFlip, "
          f"{c[verdict.STRUCTURED]} Structured; max maxdiff {s['max_maxdiff']:.3g}; {s['flips']} first-token flips"
          f" (max margin {s['max_flip_margin']:.3g}); {seconds:.1f} s")
    return 3 if c[verdict.STRUCTURED] else 0


def _check_writable(path) -> None:
    """Raise the OSError that writing ``path`` would raise, leaving no new file behind."""
    existed = os.path.lexists(path)
    open(path, "a").close()
    if not existed:
        os.remove(path)


MODEL_HELP = (".gguf or .cact file (default: $NEEDLE_WGPU_MODEL, else the installed SmolLM2-135M-Instruct, "
              "else Needle 3)")


DEPTH_HELP = "Needle 3: run the depth-N rung of the file's elastic-depth ladder (spec §10)"


def _path_of(args) -> Path:
    return Path(args.model) if args.model else default_model(lambda m: print(m, file=sys.stderr))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="needle-wgpu", description="needle-wgpu: WebGPU inference for small language models (dense GGUF files such as SmolLM2, and Needle 3 .cact files), all math in WGSL")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text or tool calls")
    gen.add_argument("model", nargs="?", help=MODEL_HELP)
    gen.add_argument("--prompt", help="free text prompt")
    gen.add_argument("--tools", help="tools JSON (tool-calling prompt)")
    gen.add_argument("--query", help="user query (tool-calling prompt)")
    add_sampling_options(gen, max_tokens=64)
    gen.add_argument("--logprobs", type=float, default=None, metavar="N",
                     help="with --json: each token's logprob and its N (0 to 20) most likely alternatives")
    gen.add_argument("--kv", choices=("f32", "int8", "f16", "cq2", "cq3", "cq4"), default=None,
                     help="KV cache: f32 (default), int8 (Needle 3), f16 (dense GGUF models); with "
                     "--numerics deploy the default is the file's kv_bits and cq2/cq3/cq4 are CQ K/V")
    gen.add_argument("--numerics", choices=("float", "deploy"), default="float",
                     help="Needle 3: float (default) or deploy (upstream's quant=True arithmetic)")
    gen.add_argument("--context", type=float, default=None, help="context length (default: the model's "
                     "own for Needle 3, 4096 positions for GGUF models)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json-schema", metavar="FILE", help="constrain the completion of --prompt to JSON "
                     "matching this schema (the supported subset, docs/api.md)")
    gen.add_argument("--json", action="store_true", help="print the result as one JSON object")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.add_argument("--depth", type=int, default=None, help=DEPTH_HELP)
    gen.add_argument("--speculative", metavar="DEPTH,K", default=None,
                     help="self-speculative decoding: the DEPTH rung drafts K ids per round (Needle 3; unconstrained)")
    gen.set_defaults(run=cmd_generate)

    chat = sub.add_parser("chat", help="a conversation: interactive, or --message TEXT answered in turn")
    chat.add_argument("model", nargs="?", help=MODEL_HELP)
    chat.add_argument("--message", action="append", help="a user message to answer (repeatable; no prompt loop)")
    chat.add_argument("--system", help="system message (default: the template's own, if any)")
    chat.add_argument("--tools", help="tools JSON, passed to the chat template")
    chat.add_argument("--json-schema", metavar="FILE", help="every reply is JSON matching this schema")
    add_sampling_options(chat, max_tokens=256)
    chat.add_argument("--kv", choices=("f32", "f16"), default="f32", help="KV cache precision")
    chat.add_argument("--context", type=float, default=None, help="context length (default 4096 positions)")
    chat.add_argument("--json", action="store_true", help="with --message: print the turns as one JSON object")
    chat.add_argument("--quiet", action="store_true", help="no progress bar")
    chat.set_defaults(run=cmd_chat)

    info = sub.add_parser("info", help="print a model file's geometry and layout")
    info.add_argument("model")
    info.add_argument("--context", type=float, default=None, help="GGUF: KV bytes for this context")
    info.add_argument("--depth", type=int, default=None, help=DEPTH_HELP)
    info.set_defaults(run=cmd_info)

    logits = sub.add_parser("logits", help="logits after every id, as JSON")
    logits.add_argument("model")
    logits.add_argument("--ids", required=True, help="comma-separated token ids")
    logits.add_argument("--last", action="store_true", help="only the last position's logits")
    logits.add_argument("--depth", type=int, default=None, help=DEPTH_HELP)
    logits.add_argument("--quiet", action="store_true", help="no progress bar")
    logits.set_defaults(run=cmd_logits)

    bench = sub.add_parser("bench", help="benchmark prefill/decode and write JSON")
    bench.add_argument("model", nargs="?")
    bench.add_argument("--prompt-tokens", type=float, default=64)
    bench.add_argument("--decode-tokens", type=float, default=16)
    bench.add_argument("--reference", action="store_true", default=True)
    bench.add_argument("--no-reference", dest="reference", action="store_false")
    bench.add_argument("--constrained", action="store_true",
                       help="grammar-masked decode: mask ms per step, constrained vs unconstrained tok/s")
    bench.add_argument("--json", default="bench.json")
    bench.add_argument("--numerics", choices=("float", "deploy"), default="float",
                       help="Needle 3: float (default) or deploy numerics (the reference runs float)")
    bench.add_argument("--depth", type=int, default=None, help=DEPTH_HELP + " (the whole benchmark)")
    bench.add_argument("--rungs", nargs="+", metavar="D", default=None,
                       help="also time these rungs over the same weights ('all': every rung)")
    bench.add_argument("--tokens-per-round", nargs="+", type=float, metavar="K", default=None,
                       help="the host cost per token at these decode steps per submit (default: 1 4)")
    bench.add_argument("--no-pipeline", action="store_true",
                       help="read each round before submitting the next (rounds are pipelined by default)")
    bench.add_argument("--speculative", nargs="*", metavar="DEPTH,K", default=None,
                       help="also time greedy self-speculative decoding for these pairs (none: a default set)")
    bench.add_argument("--streams", default=None, metavar="N,N,...",
                       help="concurrent streams through the server's batching scheduler (e.g. 1,4,8,16): aggregate "
                            "and per-stream decode tok/s and time to first token per count")
    bench.add_argument("--repeat", type=float, default=1,
                       help="with --streams: run the series this many times and report the best of each count too")
    bench.set_defaults(run=cmd_bench)

    heads = sub.add_parser("heads", help="Needle 3 probe heads: embedding, router and confidence as JSON")
    heads.add_argument("model")
    heads.add_argument("--text", help="text to score (BOS + its ids)")
    heads.add_argument("--ids", help="comma-separated token ids instead of text")
    heads.add_argument("--head", action="append", choices=("embedding", "confidence", "router"),
                       help="a head to run (repeatable; default: every head the file has)")
    heads.add_argument("--quiet", action="store_true", help="no progress bar")
    heads.add_argument("--depth", type=int, default=None, help=DEPTH_HELP)
    heads.set_defaults(run=cmd_heads)

    check = sub.add_parser("verdict", help="batched prefill vs token-by-token over a prompt battery (§7)")
    check.add_argument("model", help=".gguf or .cact file")
    check.add_argument("--prompts", help="battery file, one prompt per line (default: the shipped one)")
    check.add_argument("--limit", type=float, default=None, help="run only the first N prompts")
    check.add_argument("--kv", choices=("f32", "int8", "f16"), default="f32", help="KV cache mode")
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.set_defaults(run=cmd_verdict)

    sub.add_parser("synth", help="write a seeded synthetic Needle 3 model (synth --help)")
    add_serve_parser(sub)
    return parser


def private_runtime_dir() -> None:
    """Vulkan drivers (Mesa's lavapipe) print "XDG_RUNTIME_DIR is invalid or not set" twice
    when the process has none: give it a private one (mode 0700) before any GPU is opened."""
    current = os.environ.get("XDG_RUNTIME_DIR")
    if current and os.path.isdir(current):
        return
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = os.path.join(tempfile.gettempdir(), f"needle-wgpu-runtime-{uid}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return
    try:
        info = os.lstat(path)
        private = stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not info.st_mode & 0o077
        os.environ["XDG_RUNTIME_DIR"] = path if private else tempfile.mkdtemp(prefix="needle-wgpu-runtime-")
    except OSError:
        pass


def _prepare_streams() -> None:
    """Output never fails on a character the encoding lacks (``PYTHONIOENCODING=ascii``, a lone
    surrogate): it is written escaped. A closed stdout or stderr becomes a null device."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w"))
        elif hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError, AttributeError):
                pass


def _silence_stdout() -> None:
    """After stdout failed (a closed pipe, /dev/full), point it at the null device so that the
    interpreter's last flush at exit does not fail again and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured output)
        pass


def _say(message: str) -> None:
    """One line on stderr; a stderr that cannot be written is not a second failure."""
    try:
        print(f"needle-wgpu: {message}", file=sys.stderr)
    except (OSError, ValueError):
        pass


def _output_failed(exc: OSError) -> int:
    _silence_stdout()
    _say(f"cannot write output: {exc.strerror or exc}")
    return 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _prepare_streams()
    private_runtime_dir()
    try:
        if argv[:1] == ["synth"]:  # synth has its own parser (cli/synth.py)
            from .synth import synth_main  # the synthetic writer needs numpy, a development tool

            status = synth_main(argv[1:])
        else:
            parser = build_parser()
            args = parser.parse_args(join_option_values(parser, argv))
            status = args.run(args)
        sys.stdout.flush()
        return status
    except NeedleError as exc:
        _say(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout closed early (e.g. piped into head): not an error
        _silence_stdout()
        return 0
    except OSError as exc:  # output that cannot be written: a full disk, a bench.json path
        if exc.filename is not None:
            _say(f"{exc.filename}: {exc.strerror or exc}")
            return 1
        return _output_failed(exc)
    except Exception as exc:  # a bug: still one line, never a traceback
        _say(f"internal error, please report it: {type(exc).__name__}: {exc}")
        return 70


if __name__ == "__main__":
    sys.exit(main())
