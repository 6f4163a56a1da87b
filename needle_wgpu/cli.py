"""The ``needle-wgpu`` command: generate, info, bench, synth."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import NeedleError

DEFAULT_QUERY = "What's the weather in Paris?"
DEFAULT_TOOLS = ('[{"name":"get_weather","description":"Current weather for a city",'
                 '"parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}]')


def cache_dir() -> Path:
    return Path(os.environ.get("NEEDLE_WGPU_CACHE", Path.home() / ".cache" / "needle-wgpu"))


def default_model(say=print) -> Path:
    """The model used when none is named: $NEEDLE3_MODEL, a needle3.cact in the cache directory,
    or else a seeded synthetic model of the shipped geometry, written there once."""
    named = os.environ.get("NEEDLE3_MODEL")
    if named:
        return Path(named)
    real = cache_dir() / "needle3.cact"
    if real.exists():
        return real
    synthetic = cache_dir() / "needle3-synthetic-shipped-seed0.cact"
    if not synthetic.exists():
        from .synth import synthesize

        say(f"no needle3.cact found; writing a synthetic model of the shipped geometry to {synthetic}")
        synthetic.parent.mkdir(parents=True, exist_ok=True)
        data = synthesize("shipped", 0)
        tmp = synthetic.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(synthetic)
    return synthetic


class Progress:
    """A one-line progress bar on stderr for loading and compiling."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet or not sys.stderr.isatty()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.quiet or total <= 0:
            return
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r{stage:>10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _load(path, progress):
    from .engine import Needle3

    return Needle3.load(path, progress=progress)


def cmd_generate(args) -> int:
    path = Path(args.model) if args.model else default_model(lambda m: print(m, file=sys.stderr))
    model = _load(path, Progress(args.quiet))
    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, kv=args.kv, stop=args.stop or ())
    if args.prompt is not None:
        request = dict(prompt=args.prompt)
    else:
        request = dict(query=args.query or DEFAULT_QUERY, tools=args.tools or DEFAULT_TOOLS)
    from .engine import GenerationResult

    result = GenerationResult("", [], "empty", 0)
    for event in model.stream(**request, result=result, **options):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if "query" in request:
        from .prompt import parse_completion

        completion = parse_completion(result.text)
        print(json.dumps({"tool_calls": completion.tool_calls, "problems": completion.problems}, ensure_ascii=False))
    print(f"[{len(result.ids)} tokens, finish: {result.finish_reason}, prompt {result.prompt_tokens} tokens, "
          f"first token {result.time_to_first_token_s * 1000:.0f} ms, prefill {result.prefill_tokens_per_s:.1f} tok/s, "
          f"decode {result.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from .formats import cact

    container = cact.load(args.model)
    g = container.geometry
    info = {"geometry": {k: getattr(g, k) for k in g.__dataclass_fields__},
            "records": len(container.tensors) + (1 if container.tokenizer is not None else 0),
            "tensor_bytes": container.tensor_bytes, "file_bytes": container.file_size,
            "heads": list(container.head_codes),
            "tokenizer_bytes": len(container.tokenizer) if container.tokenizer is not None else 0,
            "warnings": container.warnings}
    print(json.dumps(info, indent=2))
    return 0


def cmd_bench(args) -> int:
    from .bench import run_benchmark

    run_benchmark(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="needle-wgpu", description="WebGPU inference for Needle 3")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text or tool calls")
    gen.add_argument("model", nargs="?", help=".cact file (default: $NEEDLE3_MODEL or a synthetic model)")
    gen.add_argument("--prompt", help="free text prompt")
    gen.add_argument("--tools", help="tools JSON (tool-calling prompt)")
    gen.add_argument("--query", help="user query (tool-calling prompt)")
    gen.add_argument("--max-tokens", type=float, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=float, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=float, default=0)
    gen.add_argument("--kv", choices=("f32", "int8"), default="f32")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(run=cmd_generate)

    info = sub.add_parser("info", help="print a model file's geometry and layout")
    info.add_argument("model")
    info.set_defaults(run=cmd_info)

    bench = sub.add_parser("bench", help="benchmark prefill/decode and write JSON")
    bench.add_argument("model", nargs="?")
    bench.add_argument("--prompt-tokens", type=int, default=64)
    bench.add_argument("--decode-tokens", type=int, default=16)
    bench.add_argument("--reference", action="store_true", default=True)
    bench.add_argument("--no-reference", dest="reference", action="store_false")
    bench.add_argument("--json", default="bench.json")
    bench.set_defaults(run=cmd_bench)

    sub.add_parser("synth", help="write a seeded synthetic Needle 3 model (synth --help)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["synth"]:  # synth has its own parser (needle_wgpu.synth.synth_main)
        from .synth import synth_main

        return synth_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except NeedleError as exc:
        print(f"needle-wgpu: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout closed early (e.g. piped into head): not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
