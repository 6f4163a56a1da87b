"""An OpenAI-compatible HTTP server over needle-wgpu models (``needle-wgpu serve``; docs/api.md,
"The HTTP server"). Needs the ``server`` extra (FastAPI, uvicorn): ``pip install needle-wgpu[server]``.

The library never imports this package (``tests/server/test_layout.py``), so neither Pyodide
nor a plain install needs its dependencies.

- ``config``: what is served (models, limits, key, CORS);
- ``app``: the endpoints, the key/body guard, server-sent events;
- ``scheduler``: a bounded queue and a worker thread per model (the GPU's only user);
- ``work``: what a request runs on that thread; ``translate``: OpenAI fields -> engine keywords;
- ``metrics``: ``/metrics`` in Prometheus' text format; ``run``: uvicorn with a graceful SIGTERM;
- ``ray_serve``: the same app as a Ray Serve deployment (replicas).
"""

from .config import Limits, ModelSpec, ServerConfig

__all__ = ["Limits", "ModelSpec", "ServerConfig", "create_app"]


def create_app(config: ServerConfig):
    from .app import create_app as create

    return create(config)
