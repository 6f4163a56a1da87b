"""What a server runs: the models (``ModelSpec``), their limits (``Limits``), the key and the
CORS origins (``ServerConfig``). Plain frozen records; the CLI's ``serve`` and the Ray Serve
deployment build them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask and on how much waits."""

    max_body_bytes: int = 4 << 20  # a request body past this is a 413
    max_messages: int = 1024  # messages (chat) or inputs (embeddings, completions) in one request
    max_queue: int = 32  # requests waiting per model beyond the running ones; more is a 429
    max_sequences: int = 8  # per model: requests decoded together, each with its KV cache (the pool)
    time_limit_s: float = 300.0  # from arrival to the last token; past it a 504 (or an error chunk)
    shutdown_grace_s: float = 10.0  # SIGTERM: running requests get this long to finish
    prefix_cache_bytes: int = 512 << 20  # per model: KV caches of recent chats kept for their prefixes (0: none)


@dataclass(frozen=True)
class ModelSpec:
    """One served model: the name requests choose it by, and where it comes from (a file path,
    a file's bytes, or a function returning a loaded ``api.Model``, called on the model's own
    worker thread). ``context`` and ``kv`` are given to every session (None: the model's own)."""

    name: str
    source: str | Path | bytes | Callable
    context: int | None = None
    kv: str | None = None
    aliases: tuple = ()

    @classmethod
    def parse(cls, text: str, **options) -> "ModelSpec":
        """``PATH`` (named after the file, without its extension) or ``NAME=PATH``."""
        name, sep, path = text.partition("=")
        if not sep or not name or "/" in name:
            name, path = Path(text).stem, text
        return cls(name=name, source=path, **options)


@dataclass(frozen=True)
class ServerConfig:
    models: tuple
    api_key: str | None = None  # Bearer key on every endpoint but /health
    cors: tuple = ()  # allowed origins; none: no CORS headers at all
    limits: Limits = field(default_factory=Limits)
