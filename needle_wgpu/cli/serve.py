"""``needle-wgpu serve [MODEL ...]``: the OpenAI-compatible server (``needle_wgpu.server``; needs
the ``server`` extra). Each MODEL is ``PATH`` (served under the file's name without its
extension) or ``NAME=PATH``; none: the default model."""

from __future__ import annotations

import os
import sys

from ..errors import NeedleError

API_KEY_VARIABLE = "NEEDLE_WGPU_API_KEY"


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install needle-wgpu[server])")
    serve.add_argument("models", nargs="*", metavar="MODEL",
                       help="PATH or NAME=PATH of a .gguf/.cact file (repeatable; default: the default model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (or ${API_KEY_VARIABLE})")
    serve.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                       help="allow browser requests from ORIGIN (repeatable; default: no CORS)")
    serve.add_argument("--context", type=int, default=None, help="context length of every session (default: the "
                       "model's own; each running request holds a KV cache this long)")
    serve.add_argument("--kv", default=None, help="KV cache mode of every session (default: the model's own)")
    serve.add_argument("--max-queue", type=int, default=32, help="requests waiting per model; more get 429")
    serve.add_argument("--max-sequences", type=int, default=8,
                       help="per model, requests decoded together in one batched step, each holding a KV cache of "
                            "the context (the pool; more wait in the queue)")
    serve.add_argument("--time-limit", type=float, default=300.0, help="seconds a request may take (504 past it)")
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    serve.add_argument("--shutdown-grace", type=float, default=10.0,
                       help="on SIGTERM, seconds running requests get to finish")
    serve.add_argument("--prefix-cache-bytes", type=int, default=512 << 20,
                       help="per model, KV caches of recent chats kept so a request sharing their prefix prefills "
                            "only the rest (default 512 MiB; 0: none)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(run=cmd_serve)


def run_streams_benchmark(args) -> dict:
    """``bench --streams``: concurrent streams through the server's scheduler (needs its extra)."""
    from ..server.bench_streams import run_streams_benchmark as run

    return run(args)


def cmd_serve(args) -> int:
    try:
        from ..server import Limits, ModelSpec, ServerConfig
        from ..server.run import serve
    except ImportError as exc:
        raise NeedleError(f"the server needs its extra: pip install 'needle-wgpu[server]' ({exc})") from None
    sources = args.models
    if not sources:
        from ..default_model import default_model

        sources = [str(default_model(lambda m: print(m, file=sys.stderr)))]
    specs = [ModelSpec.parse(text, context=args.context, kv=args.kv) for text in sources]
    if len({spec.name for spec in specs}) != len(specs):
        raise NeedleError("two models have the same name: give them names, NAME=PATH")
    for spec in specs:
        if not os.path.isfile(spec.source):
            raise NeedleError(f"{spec.source}: no such file")
    limits = Limits(max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                    max_sequences=max(1, args.max_sequences), time_limit_s=args.time_limit,
                    shutdown_grace_s=args.shutdown_grace, prefix_cache_bytes=args.prefix_cache_bytes)
    config = ServerConfig(models=tuple(specs), api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
                          cors=tuple(args.cors), limits=limits)
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"needle-wgpu: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    return serve(config, host=args.host, port=args.port, log_level=args.log_level)
