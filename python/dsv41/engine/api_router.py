"""The lab engine API's routes (vLLM's ``entrypoints/openai/api_router.py`` shape): module-level
handlers on one ``APIRouter``, each taking what it serves from ``request.app.state.api``
(:class:`ApiContext`, set by ``dsv41.engine.server.create_app``).

Threads: handlers run on the event loop; the engine calls each request's sink from its own
thread, which hands events to the handler's ``asyncio.Queue`` with ``call_soon_threadsafe``.
Admission (:func:`_admission`) and ``engine.submit`` run with no ``await`` between them, so a
``/pause`` can never slip in between the check and the submit. A client that goes away
(streaming or not) has its request aborted, freeing its slot and KV reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dsv41.authz import same_secret
from dsv41.engine import drain as dr
from dsv41.engine.hold import WINDOW_HEADER, WINDOW_TOKEN_RE
from dsv41.engine.protocol import (
    ApiError,
    CompletionRequest,
    Reply,
    error_body,
    parse_completion_request,
    parse_json_body,
    sse,
)
from dsv41.engine.scheduler import RequestError
from dsv41.engine.server_state import ABORT_SETTLE_S, ServerState
from dsv41.errors import Dsv41Error
from dsv41.tokenizer import ByteTokenizer

# The API's one logger (its journal lines read "dsv41.engine.server" whichever module logs).
log = logging.getLogger("dsv41.engine.server")

# How often a non-streaming handler checks whether its client is still connected (seconds).
DISCONNECT_POLL_S = 0.5

router = APIRouter()


@dataclass
class ApiContext:
    """What the handlers serve: ``engine`` (an ``engine.Engine``), ``model_name`` (the one
    served model), ``max_model_len`` (tokens per request), ``state`` (admission), ``metrics``
    (``engine.metrics.EngineMetrics`` or None: ``/metrics`` answers 404), ``tok`` (tokenizer)."""

    engine: Any
    model_name: str
    max_model_len: int
    state: ServerState
    metrics: Any
    tok: ByteTokenizer


def _ctx(request: Request) -> ApiContext:
    return request.app.state.api


async def _body(request: Request) -> dict:
    """The request body as a JSON object (bounded by the server's ``BodyLimit``); ApiError 400."""
    raw = await request.body()
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _admission(ctx: ApiContext, body: dict, request: Request) -> None:
    """404 for another model; 503 when the engine failed, the server drains, or admission is
    held (unless the request carries the fenced window's token)."""
    st = ctx.state
    m = body.get("model")
    if m is not None and m != ctx.model_name:
        raise ApiError(404, f"The model `{m}` does not exist.", etype="NotFoundError", param="model")
    if ctx.engine.fatal:
        raise ApiError(503, f"engine failed: {ctx.engine.fatal}", etype="ServiceUnavailableError")
    if st.draining:
        raise ApiError(
            503, "the server is shutting down (draining); not admitting new requests", etype="ServiceUnavailableError"
        )
    if st.paused and not same_secret(request.headers.get(WINDOW_HEADER), st.window_token):
        raise ApiError(
            503, "the server is paused (POST /resume to admit requests again)", etype="ServiceUnavailableError"
        )


async def _run(request: Request, body: dict, chat: bool):
    """Validate, admit, submit and answer one completion (JSON, or SSE when streaming)."""
    ctx = _ctx(request)
    engine, st = ctx.engine, ctx.state
    req = parse_completion_request(body, ctx.tok, ctx.max_model_len, chat)
    _admission(ctx, body, request)
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    # Entered in the drain book with no await before the submit: a /pause sees it or not at all.
    key = st.book.admit(request.headers.get(WINDOW_HEADER))

    def sink(ev: dict) -> None:
        if ev["type"] == "finish":
            loop.call_soon_threadsafe(st.book.finished, key, ev["reason"])
        loop.call_soon_threadsafe(q.put_nowait, ev)

    try:
        submitted = engine.submit(req.prompt_ids, req.params, sink)
    except RequestError as exc:
        st.book.forget(key)
        raise ApiError(400, str(exc), param="max_tokens") from None
    except Dsv41Error as exc:
        st.book.forget(key)
        raise ApiError(503, str(exc), etype="ServiceUnavailableError") from None
    st.book.bind(key, submitted.request_id)

    def client_gone() -> None:
        st.book.ask_abort(key, dr.BY_CLIENT)
        engine.abort(submitted.request_id)

    reply = Reply.new(req, ctx.model_name)
    dec = ctx.tok.incremental()
    if req.stream:
        return StreamingResponse(_stream(engine, req, reply, dec, q, client_gone), media_type="text/event-stream")
    return await _complete(request, engine, reply, dec, q, client_gone, submitted.request_id)


async def _complete(request: Request, engine, reply: Reply, dec, q: asyncio.Queue, client_gone, request_id: str):
    """The non-streaming answer: collect the tokens, polling the client's connection."""
    out: list[int] = []
    finished = False
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while True:
            # Token events may arrive every few ms, so check the clock, not only timeouts.
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    # Nobody will read the answer: free the engine slot now (vLLM aborts too).
                    log.info("client of %s went away; aborting it", request_id)
                    client_gone()
                    finished = True
                    return Response(status_code=499)
            try:
                ev = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue
            if ev["type"] == "tokens":
                out += ev["ids"]
                continue
            finished = True
            break
    finally:
        if not finished:  # the handler was cancelled (its connection was lost)
            client_gone()
    if ev["reason"] == "error":
        if engine.fatal:
            raise ApiError(503, ev.get("error", "engine failed"), etype="ServiceUnavailableError")
        raise ApiError(500, ev.get("error", "request failed"), etype="InternalServerError")
    return JSONResponse(reply.body(dec.feed(out, final=True), out, ev))


async def _stream(engine, req: CompletionRequest, reply: Reply, dec, q: asyncio.Queue, client_gone):
    """The SSE answer: one chunk per engine step that produced tokens, the last chunk (finish
    reason), the usage chunk (``include_usage``), ``[DONE]``; an error ends it with an error event."""
    first = True
    finished = False
    try:
        while True:
            ev = await q.get()
            if ev["type"] == "tokens":
                yield sse(reply.chunk(dec.feed(ev["ids"]), ev["ids"], None, ev, first))
                first = False
                continue
            finished = True
            if ev["reason"] == "error":
                code, etype = (503, "ServiceUnavailableError") if engine.fatal else (500, "InternalServerError")
                yield sse(error_body(code, ev.get("error", "engine failed"), etype))
                break
            tail = dec.feed([], final=True)
            yield sse(reply.chunk(tail, [] if req.return_token_ids else None, ev["reason"], ev, first))
            if req.include_usage:
                yield sse(reply.usage_chunk(ev))
            break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # client went away: free the engine's slot
            client_gone()


@router.post("/v1/completions")
async def completions(request: Request):
    """OpenAI completions (see ``dsv41.engine.server`` for the fields honoured)."""
    return await _run(request, await _body(request), chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    """OpenAI chat completions over the lab chat template (``ByteTokenizer.chat_prompt``)."""
    return await _run(request, await _body(request), chat=True)


@router.get("/v1/models")
async def models(request: Request):
    """The one served model (readiness probe of the playbooks and the harness)."""
    ctx = _ctx(request)
    return {
        "object": "list",
        "data": [
            {
                "id": ctx.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "dsv41",
                "root": ctx.model_name,
                "max_model_len": ctx.max_model_len,
            }
        ],
    }


@router.get("/health")
async def health(request: Request):
    """200 ``{"status": "ok"}``, or 503 with the error once the engine has failed."""
    engine = _ctx(request).engine
    if engine.fatal:
        return JSONResponse(status_code=503, content={"status": "failed", "error": engine.fatal})
    return {"status": "ok"}


@router.get("/metrics")
async def metrics_ep(request: Request):
    """Prometheus text (names in ``dsv41.engine.metrics``); 404 when metrics are not enabled."""
    metrics = _ctx(request).metrics
    if metrics is None:
        raise ApiError(404, "metrics are not enabled", etype="NotFoundError")
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/pause")
async def pause(request: Request, mode: str | None = None, timeout_s: float = 600.0, window: str | None = None):
    """vLLM 0.33.0's ``/pause``: stop admitting (new requests get 503), then by ``mode`` (query,
    or a JSON body ``{"mode": ...}``): ``abort`` (the default, as in vLLM) aborts the requests
    in flight; ``wait`` lets them finish for at most ``timeout_s`` seconds, then aborts what
    is left of them (``aborted_after_timeout``, also counted in
    ``dsv41_engine_pause_drain_aborts_total``); ``keep`` freezes the engine until ``/resume``.
    ``window`` (dsv41's fenced window, not in vLLM): while paused, requests whose
    ``X-DSV41-Window`` header equals it are still admitted; a later ``/pause`` replaces it,
    ``/resume`` clears it.

    The drain covers only the requests in flight at this pause that its HOLD refuses (the
    epoch scope of ``engine/drain.py``): a ``/resume`` or a later ``/pause`` ends a pending
    ``wait`` drain at once without aborting anything (``drain``: ``resumed``/``superseded``),
    so a request admitted after a resume is never aborted by an earlier pause. The engine is
    frozen exactly while the latest pause is ``keep``. Reply: ``paused`` (the state now),
    ``mode``, ``drain`` (``drained``, ``timed_out``, ``resumed``, ``superseded``,
    ``shutdown`` or ``frozen``), ``in_flight_at_pause`` (the drain's scope), ``aborted`` and
    ``aborted_after_timeout`` (requests of the scope this pause aborted that ended ``abort``:
    exact), ``still_running`` (of the scope, still in flight at the reply). 503 while the
    server shuts down. Full table: docs/engine.md, "Pause, resume and drains"."""
    ctx = _ctx(request)
    engine, st, metrics = ctx.engine, ctx.state, ctx.metrics
    if mode is None:
        raw = await request.body()
        if raw.strip():
            b = parse_json_body(raw)
            if not isinstance(b, dict):
                raise ApiError(400, 'request body must be a JSON object like {"mode": "wait"}')
            mode = b.get("mode")
        mode = mode or "abort"
    if mode not in ("abort", "wait", "keep"):
        raise ApiError(400, f"mode must be 'abort', 'wait' or 'keep', got {mode!r}", param="mode")
    if not 0 < timeout_s < float("inf"):  # NaN fails too
        raise ApiError(400, f"timeout_s must be a positive number of seconds, got {timeout_s}", param="timeout_s")
    if window is not None and not WINDOW_TOKEN_RE.fullmatch(window):
        raise ApiError(400, "window must be 1-128 characters of [A-Za-z0-9._-]", param="window")
    if st.draining:
        raise ApiError(503, "the server is shutting down (draining); nothing to pause", etype="ServiceUnavailableError")
    kept_err = None
    try:
        st.hold(window)
    except OSError as exc:
        kept_err = exc  # held in memory all the same (the safe side); answered 500 below
    d = st.book.begin(mode, window or None)
    if mode == "keep" or getattr(engine, "frozen", False):  # frozen exactly while the latest pause is keep
        engine.freeze(mode == "keep")
    try:
        if mode == "abort":
            _abort_scope(ctx, d)
        if kept_err is not None:
            raise ApiError(
                500,
                f"admission is held, but the HOLD could not be kept in {st.hold_file}: {kept_err}",
                etype="InternalServerError",
            )
        if mode == "keep":
            d.outcome = dr.FROZEN
        elif mode == "abort":
            d.outcome = dr.DRAINED if await st.book.settle(d, timeout_s) else dr.TIMED_OUT
        elif await st.book.wait(d, timeout_s) == dr.TIMED_OUT:
            n = _abort_scope(ctx, d)
            log.warning("pause: %d in-flight requests outlived the %g s drain; aborting them", n, timeout_s)
            await st.book.settle(d, ABORT_SETTLE_S)
            if metrics is not None and d.aborted:
                metrics.pause_drain_aborts.inc(d.aborted)
    finally:
        st.book.end(d)
    return {
        "paused": st.paused,
        "mode": mode,
        "drain": d.outcome,
        "in_flight_at_pause": d.in_flight_at_pause,
        "aborted": d.aborted,
        "aborted_after_timeout": d.aborted if mode == "wait" else 0,
        "still_running": d.still_running,
    }


def _abort_scope(ctx: ApiContext, d) -> int:
    """Abort every request of drain ``d``'s scope nobody asked to abort yet; returns how many."""
    n = 0
    for key in sorted(d.scope):
        rid = ctx.state.book.ask_abort(key, d)
        if rid is not None and key in d.asked:
            ctx.engine.abort(rid)
            n += 1
    return n


@router.post("/resume")
async def resume(request: Request):
    """Admit requests again, end every pending ``wait`` drain (``resumed``: nothing more is
    aborted) and unfreeze a ``keep`` pause (idempotent)."""
    ctx = _ctx(request)
    st = ctx.state
    try:
        st.open()
        failed = None
    except OSError as exc:
        failed = exc
    st.book.resume()
    ctx.engine.freeze(False)
    if failed is not None:
        raise ApiError(
            500,
            f"admission is open, but the kept HOLD {st.hold_file} could not be removed: {failed}",
            etype="InternalServerError",
        )
    return {"paused": False}


@router.get("/is_paused")
async def is_paused(request: Request):
    """``{"is_paused": bool}`` (vLLM's dev-mode endpoint shape) plus ``paused_since``: Unix
    time (s) admission was closed, null while open (what ``dsv41 status`` shows as "since")."""
    st = _ctx(request).state
    return {"is_paused": st.paused, "paused_since": st.paused_since if st.paused else None}
