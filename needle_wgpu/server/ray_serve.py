"""The same app on Ray Serve: small models scale out as replicas, each a whole server (its own
device, models, queues and worker threads) behind Ray's router and autoscaler. Needs the
``ray`` extra (``pip install needle-wgpu[ray]``).

One command, on a single machine or a cluster (``ray start --head`` on one node, ``ray start
--address=HEAD:6379`` on the others; every node needs the model files at the same paths)::

    serve run needle_wgpu.server.ray_serve:build models=/models/a.gguf,b=/models/b.cact replicas=2

``build``'s arguments: ``models`` (comma-separated PATH or NAME=PATH), ``replicas`` (a number, or
``auto`` for Ray's autoscaling between ``min_replicas`` and ``max_replicas``), ``context``,
``gpus_per_replica`` (0 on lavapipe; 1 puts each replica on its own GPU) and
``cpus_per_replica``. From Python: ``serve.run(deployment(config, replicas=2))``.
"""

from __future__ import annotations

from ray import serve

from .app import create_app
from .config import ModelSpec, ServerConfig


@serve.ingress()
class NeedleServer:
    """One replica: the app built on the replica itself (its lifespan loads the models there)."""

    def __init__(self, config: ServerConfig):
        self.config = config

    def __serve_build_asgi_app__(self):
        return create_app(self.config)


def deployment(config: ServerConfig, *, replicas: int | str = 2, min_replicas: int = 1, max_replicas: int = 4,
               gpus_per_replica: float = 0, cpus_per_replica: float = 1, name: str = "needle-wgpu"):
    """A bound Ray Serve application of ``config``: ``replicas`` copies, or ``"auto"`` for Ray's
    autoscaling on the requests in flight (each replica runs one sequence per model at a time)."""
    options = {"name": name, "ray_actor_options": {"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica},
               "max_ongoing_requests": config.limits.max_queue + 1}
    if replicas == "auto":
        options["autoscaling_config"] = {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": 2}
    else:
        options["num_replicas"] = int(replicas)
    return serve.deployment(NeedleServer, **options).bind(config)


def build(args: dict):
    """``serve run needle_wgpu.server.ray_serve:build models=... replicas=...`` (module docstring)."""
    context = int(args["context"]) if args.get("context") else None
    specs = tuple(ModelSpec.parse(text, context=context) for text in str(args.get("models", "")).split(",") if text)
    if not specs:
        from ..default_model import default_model

        specs = (ModelSpec.parse(str(default_model()), context=context),)
    replicas = args.get("replicas", 2)
    return deployment(ServerConfig(models=specs, api_key=args.get("api_key")),
                      replicas=replicas if replicas == "auto" else int(replicas),
                      min_replicas=int(args.get("min_replicas", 1)), max_replicas=int(args.get("max_replicas", 4)),
                      gpus_per_replica=float(args.get("gpus_per_replica", 0)),
                      cpus_per_replica=float(args.get("cpus_per_replica", 1)))
