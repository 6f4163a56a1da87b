"""The HTTP surface (docs/api.md, "The HTTP server"): OpenAI's endpoints over the served models.

A request is checked (schema, then its fields), handed to its model's scheduler as a ``Job``,
and answered from the job's events: one JSON response, or server-sent events ``data: {chunk}``
... ``data: [DONE]`` when streamed. Nothing here touches the GPU; the handlers only wait.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServerConfig
from .errors import ApiError, error_of
from .hosting import ModelHost
from .metrics import Metrics
from .scheduler import Job
from .schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from .translate import chat_request, completion_request, embedding_inputs
from .work import chat_body, completion_body, embeddings_body

log = logging.getLogger("needle_wgpu.server")

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics")
ERROR_RESPONSES = {status: {"description": text} for status, text in (
    (400, "a request the engine refuses"), (401, "no or a wrong API key"), (404, "unknown model"),
    (413, "body too large"), (422, "body does not fit the schema"), (429, "queue full (Retry-After)"),
    (503, "shutting down or the GPU failed (Retry-After)"), (504, "past the time limit"))}


def create_app(config: ServerConfig) -> FastAPI:
    """The app for ``config``; its models load when the app starts (its lifespan)."""
    metrics = Metrics()
    host = ModelHost(config, metrics)

    @asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(host.start)
        try:
            yield
        finally:
            await asyncio.to_thread(host.stop)

    app = FastAPI(title="needle-wgpu", version="0.1.0", lifespan=lifespan,
                  description="An OpenAI-compatible server over needle-wgpu models")
    app.state.host, app.state.metrics = host, metrics
    limits = config.limits

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def schema_error(request, exc: RequestValidationError):
        problems = exc.errors()
        first = problems[0] if problems else {}
        if first.get("type") == "json_invalid":
            return error_response(ApiError(400, "the body is not valid JSON", code="invalid_json"))
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                            for e in problems[:5])
        return error_response(ApiError(422, message or "the body does not fit the schema", param=where or None,
                                       code="invalid_schema"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                                       else None))

    @app.exception_handler(ClientGone)
    async def client_gone(request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it; counted in /metrics as 499

    @app.exception_handler(Exception)
    async def bug(request, exc: Exception):
        return error_response(error_of(exc))

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        name, scheduler = host.find(body.model)
        options = chat_request(body, limits)
        stream = bool(body.stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        spec = host.specs[name]
        work = chat_body(options, served=name, stream=stream, include_usage=include_usage, context=spec.context,
                         kv=spec.kv)
        return await answer(request, scheduler, "chat", work, stream)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        name, scheduler = host.find(body.model)
        prompt, options, logprobs = completion_request(body, limits)
        stream = bool(body.stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        spec = host.specs[name]
        work = completion_body(prompt, served=name, stream=stream, include_usage=include_usage, options=options,
                               logprobs=logprobs, context=spec.context, kv=spec.kv)
        return await answer(request, scheduler, "completions", work, stream)

    @app.post("/v1/embeddings", responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request):
        name, scheduler = host.find(body.model)
        work = embeddings_body(embedding_inputs(body, limits), served=name, encoding_format=body.encoding_format)
        return await answer(request, scheduler, "embeddings", work, False)

    @app.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
    async def models():
        return {"object": "list", "data": host.catalogue()}

    @app.get("/v1/models/{model_id}", responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
    async def model(model_id: str):
        name, _ = host.find(model_id)
        return next(entry for entry in host.catalogue() if entry["id"] == name)

    @app.get("/health", responses={503: ERROR_RESPONSES[503]})
    async def health():
        models = {name: s.gauges() for name, s in host.schedulers.items()}
        if not host.accepting:
            return JSONResponse({"status": "shutting down", "models": models}, status_code=503,
                                headers={"Retry-After": "5"})
        return {"status": "ok", "models": models}

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: ERROR_RESPONSES[401]})
    async def metrics_page():
        return PlainTextResponse(metrics.render(host.schedulers), media_type="text/plain; version=0.0.4")

    async def answer(request: Request, scheduler, endpoint: str, work, stream: bool) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event) -> None:  # from the worker thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed: nobody is waiting
                pass

        job = Job(endpoint, work, deliver, limits.time_limit_s)
        scheduler.submit(job)
        try:
            kind, payload = await first_event(request, events)
        except BaseException:
            scheduler.cancel(job)
            raise
        if kind == "error":
            return error_response(payload)
        if not stream:
            return Response(dumps(payload), media_type="application/json")
        return StreamingResponse(server_sent(payload, events, job, scheduler), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.add_middleware(Guard, config=config, metrics=metrics)
    if config.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


class ClientGone(Exception):
    pass


async def first_event(request: Request, events: asyncio.Queue):
    """The job's first event; a client that disconnects while it waits (in the queue, during a
    whole non-streamed generation) cancels it."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise ClientGone() from None


async def server_sent(first: dict, events: asyncio.Queue, job: Job, scheduler):
    """``data: {chunk}`` lines, then ``data: [DONE]``; an error after the first chunk is one
    ``data: {"error": ...}`` line before ``[DONE]`` (the openai client raises it). A client
    that goes away cancels the job (Starlette cancels this generator)."""
    try:
        yield f"data: {dumps(first)}\n\n"
        while True:
            kind, payload = await events.get()
            if kind == "data":
                yield f"data: {dumps(payload)}\n\n"
                continue
            if kind == "error":
                yield f"data: {dumps(payload.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:
        if not job.finished:
            scheduler.cancel(job)


def error_response(error: ApiError) -> Response:
    return Response(dumps(error.body()), status_code=error.status, headers=error.headers(),
                    media_type="application/json")


def dumps(payload) -> str:
    """JSON text; a non-finite float (a -inf logprob) becomes ±9999.0 (OpenAI's floor) or null."""
    return json.dumps(_finite(payload), allow_nan=False, default=str)  # ASCII: lone surrogates survive


def _finite(value):
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return None if math.isnan(value) else math.copysign(9999.0, value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Guard:
    """Pure ASGI, in front of the app: the API key (every path but /health), the body limit
    (413, before the app reads a byte past it), and the request counts for /metrics."""

    def __init__(self, app, config: ServerConfig, metrics: Metrics):
        self.app, self.key, self.limit, self.metrics = app, config.api_key, config.limits.max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        label = path if path in PATHS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        status = [0]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._refusal(scope, path)
            if error is None:
                receive, error = await self._bounded(scope, receive)
            if error is not None:
                await _send_error(counted_send, error)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            self.metrics.http_request(label, status[0] or 499)

    def _refusal(self, scope, path):
        if self.key is None or path == "/health" or scope.get("method") == "OPTIONS":
            return None
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key.encode()):
            return None
        return ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", type="authentication_error",
                        code="invalid_api_key")

    async def _bounded(self, scope, receive):
        """The whole body read up front, up to the limit: (a receive that replays it, None) or
        (None, the 413)."""
        too_large = ApiError(413, f"the request body is larger than {self.limit} bytes", code="body_too_large")
        headers = dict(scope.get("headers") or ())
        try:
            if int(headers.get(b"content-length", b"0")) > self.limit:
                return None, too_large
        except ValueError:
            return None, ApiError(400, "Content-Length is not a number", code="bad_header")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return receive, None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return None, too_large
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), [False]

        async def replay():
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay, None


async def _send_error(send, error: ApiError) -> None:
    body = dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
