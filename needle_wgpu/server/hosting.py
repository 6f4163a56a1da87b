"""The served models: each loaded on its own worker thread (``scheduler.Scheduler``), found by
the request's ``model`` (its name, an alias, or the file's own ``general.name``)."""

from __future__ import annotations

import time
from pathlib import Path

from .config import ModelSpec, ServerConfig
from .errors import unknown_model
from .scheduler import Scheduler


class ModelHost:
    def __init__(self, config: ServerConfig, metrics):
        self.config, self.metrics = config, metrics
        self.specs = {spec.name: spec for spec in config.models}
        if len(self.specs) != len(config.models):
            raise ValueError("two served models have the same name")
        self.schedulers = {spec.name: Scheduler(spec.name, _loader(spec), max_queue=config.limits.max_queue,
                                                max_sequences=config.limits.max_sequences,
                                                metrics=metrics, probe_kv=_kv_probe(spec),
                                                prefix_cache_bytes=config.limits.prefix_cache_bytes,
                                                served=(spec.context, spec.kv))
                           for spec in config.models}
        self.names = {}  # every name a request may use -> the served name
        for spec in config.models:
            for alias in (spec.name, *spec.aliases):
                self.names.setdefault(alias, spec.name)
        self.created = int(time.time())
        self.started = False

    def start(self) -> None:
        """Load every model (in parallel, each on its own thread); raise when one fails. Once
        only: the command line loads before it listens, the app's start-up then finds them."""
        if self.started:
            return
        self.started = True
        for scheduler in self.schedulers.values():
            scheduler.start()
        failed = []
        for name, scheduler in self.schedulers.items():
            scheduler.ready.wait()
            if scheduler.load_error is not None:
                failed.append(f"{name}: {scheduler.load_error}")
            else:  # the file's own name finds it too, when no other model has it
                self.names.setdefault(scheduler.model.gpu.name, name)
        if failed:
            self.stop()
            raise RuntimeError("cannot load " + "; ".join(failed))

    def find(self, requested) -> tuple:
        """(served name, scheduler) for a request's ``model``; 404 for another name."""
        name = self.names.get(requested) if isinstance(requested, str) else None
        if name is None:
            raise unknown_model(requested, list(self.schedulers))
        return name, self.schedulers[name]

    def begin_shutdown(self) -> None:
        for scheduler in self.schedulers.values():
            scheduler.begin_shutdown(self.config.limits.shutdown_grace_s)

    def stop(self) -> None:
        for scheduler in self.schedulers.values():
            scheduler.stop()

    @property
    def accepting(self) -> bool:
        return all(s.accepting for s in self.schedulers.values())

    def catalogue(self) -> list:
        """``GET /v1/models``' entries."""
        out = []
        for name, scheduler in self.schedulers.items():
            model, spec = scheduler.model, self.specs[name]
            entry = {"id": name, "object": "model", "created": self.created, "owned_by": "needle-wgpu"}
            if model is not None:
                described = model.describe() if hasattr(model.gpu, "describe") else {}
                entry["meta"] = {"family": described.get("family"), "file_name": model.gpu.name,
                                 "context": spec.context, "embeddings": model.capabilities.embeds,
                                 "kv_bytes_per_sequence": scheduler.kv_bytes}
            out.append(entry)
        return out


def _loader(spec: ModelSpec):
    def load():
        if callable(spec.source):
            return spec.source()
        from .. import load as load_model

        source = spec.source if isinstance(spec.source, (bytes, bytearray)) else Path(spec.source)
        return load_model(source)

    return load


def _kv_probe(spec: ModelSpec):
    """One sequence's KV bytes at the served context: a session opened and closed at load,
    counted by the device (``Counters.bytes_allocated["kv"]``); 0 where the device counts none."""

    def probe(model) -> int:
        counters = getattr(getattr(model.gpu, "device", None), "counters", None)
        if counters is None:
            return 0
        before = counters.bytes_allocated.get("kv", 0)
        model.gpu.session(context=spec.context, kv=spec.kv).close()
        return counters.bytes_allocated.get("kv", 0) - before

    return probe
