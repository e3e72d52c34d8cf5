"""OpenAI-compatible HTTP API of the lab engine (FastAPI + uvicorn), rank 0 only: the app's
assembly (:func:`create_app`) and its ASGI middleware. The routes are ``dsv41.engine.api_router``,
request validation and response bodies ``dsv41.engine.protocol``, admission state and the
shutdown drain ``dsv41.engine.server_state`` (the shape of vLLM's ``entrypoints/openai``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming: one chunk per
engine step that produced tokens; ``stream_options.include_usage`` and
``stream_options.continuous_usage_stats``; ``return_token_ids``; ``seed``, ``max_tokens``
(``max_completion_tokens`` for chat), ``min_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``ignore_eos``, ``cache_salt``; every other field of the OpenAI/vLLM request schemas is refused
with a 400 naming it unless it asks for nothing: ``dsv41.engine.request_fields``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``POST /pause?mode=abort|wait|keep``,
``POST /resume``, ``GET /is_paused``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad JSON or
parameters (incl. a request longer than the KV budget), 404 unknown model, 413 body over
``MAX_BODY_BYTES``, 500 one request failed inside the engine (or a handler bug), 503
paused/draining or engine failed. Every client mistake is a 4xx naming the field (``param``);
a 500 from a handler bug says ``Connection: close`` (the client's pool opens a fresh
connection), as does a 413.

Request bodies are counted as they arrive (``BodyLimit``, an ASGI middleware in front of every
route): the read stops at ``MAX_BODY_BYTES`` with a 413, whether the body declares a
``Content-Length`` or is chunked, so memory stays bounded by about the limit times the
concurrent uploads.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dsv41 import authz
from dsv41.engine.api_router import ApiContext, router
from dsv41.engine.protocol import ApiError, error_response
from dsv41.engine.server_state import ServerState
from dsv41.tokenizer import ByteTokenizer

log = logging.getLogger("dsv41.engine.server")

# Largest request body accepted (bytes): the longest useful prompt is max_position_embeddings
# tokens (a few KiB here); parsing and tokenizing runs on the event loop, so bound it (413 above).
MAX_BODY_BYTES = 4 << 20


def _too_large(n: int | str) -> ApiError:
    """The 413 of a body of ``n`` bytes (or "more than N") over ``MAX_BODY_BYTES``."""
    return ApiError(
        413,
        f"request body of {n} bytes is over the {MAX_BODY_BYTES} byte limit",
        etype="RequestTooLargeError",
        close=True,
    )


class BodyLimit:
    """ASGI middleware bounding every request body to ``limit`` bytes (default ``MAX_BODY_BYTES``).

    A declared ``Content-Length`` over the limit is answered 413 before any body is read; a
    chunked (or lying) body is counted as the app receives it, and the receive that crosses the
    limit raises ``ApiError`` 413 (answered with ``Connection: close``, so the server stops
    reading the rest). At most ``limit`` plus one received chunk is ever held per request.
    """

    def __init__(self, app, limit: int | None = None) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = MAX_BODY_BYTES if self.limit is None else self.limit
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                return await error_response(_too_large(v.decode()))(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _too_large(f"more than {limit}")
            return msg

        return await self.app(scope, counted, send)


class CatchAll:
    """ASGI middleware: an exception escaping a handler (a bug) is logged once and answered as an
    OpenAI-shaped 500 with ``Connection: close``, instead of propagating to uvicorn (which would
    close the connection under a client that believes it is reusable). A response already under
    way cannot be changed: uvicorn then closes the connection, so the client sees it end early."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            # the client went away before its whole body arrived (or the request deadline closed
            # it: dsv41.httpd.uvicorn_protocol): nobody to answer, not a bug
            log.info(
                "%s %s: the client disconnected before its request body arrived",
                scope.get("method", ""),
                scope.get("path", ""),
            )
        except Exception as exc:  # noqa: BLE001 - see class doc
            log.error("unhandled error in a request handler", exc_info=exc)
            if started:
                raise
            err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", etype="InternalServerError", close=True)
            await error_response(err)(scope, receive, send)


class HeadAsGet:
    """ASGI middleware: ``HEAD`` on any path is routed as ``GET`` and answered with the GET's
    status and headers, without the body (``HEAD /health`` is a load balancer's probe)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(msg):
            if msg["type"] == "http.response.body":
                if msg.get("more_body", False):
                    return
                msg = {"type": "http.response.body", "body": b""}
            await send(msg)

        return await self.app(dict(scope, method="GET"), receive, headers_only)


_ROUTING_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError", 422: "UnprocessableEntityError"}


async def _http_error(req, exc: StarletteHTTPException):
    # Starlette's routing errors (unknown path 404, wrong method 405) in OpenAI's shape, keeping
    # their headers (405's Allow).
    msg = f"{req.method} {req.url.path}: {exc.detail}"
    resp = error_response(ApiError(exc.status_code, msg, etype=_ROUTING_TYPES.get(exc.status_code, "BadRequestError")))
    for k, v in (exc.headers or {}).items():
        resp.headers[k] = v
    return resp


class Guard:
    """ASGI middleware: who may do what (``dsv41.authz``). A control request (``authz.is_control``:
    ``/pause``, ``/resume``, any non-read route outside the OpenAI API) without the operator
    ``credential`` or with a browser's cross-site shape is refused before its body is read (401/403,
    OpenAI error shape); with an ``api_key`` (vLLM's ``--api-key``), ``/v1`` requests without
    ``Authorization: Bearer KEY`` get 401. ``credential`` None: every control request is refused.
    ``allowed_hosts``: Host names accepted besides IP literals and ``localhost``."""

    def __init__(
        self, app, credential: str | None = None, api_key: str | None = None, allowed_hosts: tuple[str, ...] = ()
    ) -> None:
        self.app, self.credential, self.api_key, self.allowed_hosts = app, credential, api_key, allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path, headers = scope.get("method", "GET"), scope.get("path", ""), scope.get("headers", ())
        why = (
            authz.control_refusal(headers, self.credential, self.allowed_hosts)
            if authz.is_control(method, path)
            else authz.api_key_refusal(method, path, headers, self.api_key)
        )
        if why is not None:
            code, msg = why
            etype = "AuthenticationError" if code == 401 else "PermissionDeniedError"
            return await error_response(ApiError(code, msg, etype=etype, close=True))(scope, receive, send)
        return await self.app(scope, receive, send)


async def _api_error(_req, exc: ApiError):
    return error_response(exc)


async def _validation_error(_req, exc: RequestValidationError):
    # FastAPI's own 422 (e.g. ``/pause?timeout_s=abc``) in OpenAI's error shape.
    errs = exc.errors()
    where = ".".join(str(x) for x in errs[0].get("loc", ())) if errs else ""
    msg = f"{where}: {errs[0].get('msg')}" if errs else "invalid request"
    return error_response(ApiError(400, msg, param=where or None))


async def _unexpected(_req, exc: Exception):
    # A bug must still answer in OpenAI's shape (and be logged), never as a bare text 500.
    # Only reached for errors outside CatchAll (the middleware stack itself).
    log.error("unhandled error in a request handler", exc_info=exc)
    return error_response(
        ApiError(500, f"internal error: {type(exc).__name__}: {exc}", etype="InternalServerError", close=True)
    )


def create_app(
    engine,
    model_name: str,
    max_model_len: int,
    state: ServerState | None = None,
    metrics=None,
    request_limit: tuple[int, int] | None = None,
    operator_credential: str | None = None,
    api_key: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
) -> FastAPI:
    """Build the FastAPI app serving ``engine`` (an ``engine.Engine``) as ``model_name``.

    ``max_model_len``: tokens one request may hold; ``state``: the admission state (default: a
    fresh, open, memory-only ``ServerState``); ``metrics``: ``engine.metrics.EngineMetrics`` for
    ``/metrics`` (None: 404). The routes (``api_router.router``) read all of it from
    ``app.state.api`` (an ``ApiContext``); ``app.state.server_state`` is ``state``.
    ``request_limit``: ``(max_requests, per_client)`` of ``dsv41.httpd.ShedRequests`` (default
    ``dsv41.httpd.request_limit`` of the environment's settings). ``operator_credential``
    (``dsv41.authz``; None: the control routes ``/pause`` and ``/resume`` refuse everyone),
    ``api_key`` (vLLM's ``--api-key``: None, the ``/v1`` routes are open) and ``allowed_hosts``
    (``DSV41_CONTROL_HOSTS``): :class:`Guard`.
    Middleware, outermost first: ``HeadAsGet``, ``Guard``, ``ShedRequests`` (health and metrics never
    shed), ``BodyLimit``, ``CatchAll``; errors (routing 404/405 too) answer in OpenAI's shape.
    """
    from dsv41 import envs, httpd

    st = state or ServerState()
    app = FastAPI(title="dsv41 lab engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server_state = st
    app.state.api = ApiContext(engine, model_name, max_model_len, st, metrics, ByteTokenizer())
    # add_middleware puts the last one outermost: BodyLimit sees the request first.
    app.add_middleware(CatchAll)
    app.add_middleware(BodyLimit)
    max_requests, per_client = request_limit or httpd.request_limit(envs.parse())
    app.add_middleware(httpd.ShedRequests, max_requests=max_requests, per_client=per_client)
    app.add_middleware(Guard, credential=operator_credential, api_key=api_key, allowed_hosts=tuple(allowed_hosts))
    app.add_middleware(HeadAsGet)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
    app.include_router(router)
    return app
