"""Running the app under uvicorn (``needle-wgpu serve``), with a graceful SIGTERM: the schedulers
stop taking requests at once and give the running ones ``Limits.shutdown_grace_s`` to finish
(then they end with an error chunk), while uvicorn stops listening and waits for them."""

from __future__ import annotations

import uvicorn

from ..errors import NeedleError
from .app import create_app
from .config import ServerConfig

SHUTDOWN_MARGIN_S = 5.0  # uvicorn's own limit past the schedulers' grace: a backstop, never reached


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the models about a SIGTERM/SIGINT as soon as it arrives (uvicorn
    itself would only wait for the open streams, which might never end)."""

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.host.begin_shutdown()
        super().handle_exit(sig, frame)


def server(config: ServerConfig, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> GracefulServer:
    app = create_app(config)
    return GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                         timeout_graceful_shutdown=config.limits.shutdown_grace_s + SHUTDOWN_MARGIN_S))


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> int:
    """Load the models, then serve until SIGTERM/SIGINT (uvicorn re-raises the signal once it has
    shut down). A model that cannot be loaded is a ``NeedleError`` naming it, before anything
    listens; 1 when uvicorn cannot start (the port is taken)."""
    runner = server(config, host, port, log_level)
    try:
        runner.config.app.state.host.start()
    except RuntimeError as exc:
        raise NeedleError(str(exc)) from None
    runner.run()
    return 0 if runner.started else 1
