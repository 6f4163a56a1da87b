"""Every error the server answers, in OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status that says whose problem it is (docs/api.md, "The HTTP server").

``ApiError`` is raised by the server's own checks; ``error_of`` maps whatever a request's work
raised: a ``NeedleError`` is the caller's problem (400, its message), a ``DeviceError`` the
server's (503, retry later), anything else is a bug (500, logged with its traceback).
"""

from __future__ import annotations

import logging
import math

from ..errors import ContextFullError, DeviceError, NeedleError

log = logging.getLogger("needle_wgpu.server")


class ApiError(Exception):
    """One error response: status, OpenAI ``type`` and ``code``, the offending ``param``, and
    for 429/503 the seconds a client should wait (``Retry-After``)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unknown_model(name, served) -> ApiError:
    return ApiError(404, f"the model {name!r} is not served here (served: {', '.join(served)})",
                    param="model", code="model_not_found")


def queue_full(model: str, retry_after: float) -> ApiError:
    return ApiError(429, f"the queue of {model!r} is full: retry later", type="rate_limit_error",
                    code="queue_full", retry_after=retry_after)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down",
                    retry_after=5)


def timed_out(limit_s: float) -> ApiError:
    return ApiError(504, f"the request ran past the server's time limit of {limit_s:g} s", type="timeout_error",
                    code="timeout")


def cancelled() -> ApiError:
    # Nobody reads it (the client has gone); it ends the request's event stream.
    return ApiError(499, "the client closed the connection", code="cancelled")


def error_of(exc: BaseException) -> ApiError:
    """The response for an exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, DeviceError):
        log.warning("device error: %s", exc)
        return ApiError(503, f"the GPU failed: {exc}", type="service_unavailable", code="device_error",
                        retry_after=5)
    if isinstance(exc, ContextFullError):
        return ApiError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, NeedleError):
        return ApiError(400, str(exc), code=type(exc).__name__)
    log.error("internal error", exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); the server log has the details",
                    type="server_error", code="internal_error")
