"""OpenAI-compatible HTTP API of the lab engine (FastAPI + uvicorn), rank 0 only.

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

import asyncio
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dsv41.engine import drain as dr
from dsv41.engine.drain import DrainBook
from dsv41.engine.hold import (WINDOW_HEADER, WINDOW_TOKEN_RE, HoldFileError, HoldRecord, read_hold, remove_hold,
                               write_hold)
from dsv41.engine import request_fields
from dsv41.engine.sampler import SamplingParams
from dsv41.engine.scheduler import RequestError
from dsv41.errors import Dsv41Error
from dsv41.tokenizer import VOCAB_SIZE, ByteTokenizer

log = logging.getLogger("dsv41.engine.server")

# How often a non-streaming handler checks whether its client is still connected (seconds).
DISCONNECT_POLL_S = 0.5
# Largest request body accepted (bytes): the longest useful prompt is max_position_embeddings
# tokens (a few KiB here); parsing and tokenizing runs on the event loop, so bound it (413 above).
MAX_BODY_BYTES = 4 << 20
# Seconds a pause (or the shutdown) waits for the aborts it issued to land (the engine applies
# them at its next step, milliseconds; more only when the step thread hangs).
ABORT_SETTLE_S = 5.0


class ApiError(Exception):
    """An error answered to the client: ``status`` code, ``message``, OpenAI error ``type``,
    ``param`` (the field at fault), ``close`` (answer with ``Connection: close``)."""

    def __init__(self, status: int, message: str, etype: str = "BadRequestError", param: str | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.etype, self.param, self.close = status, message, etype, param, close


def _too_large(n: int | str) -> ApiError:
    return ApiError(413, f"request body of {n} bytes is over the {MAX_BODY_BYTES} byte limit",
                    etype="RequestTooLargeError", close=True)


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
                return await _err_response(_too_large(v.decode()))(scope, receive, send)
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
        except Exception as exc:  # noqa: BLE001 - see class doc
            log.error("unhandled error in a request handler", exc_info=exc)
            if started:
                raise
            err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", etype="InternalServerError", close=True)
            await _err_response(err)(scope, receive, send)


def _show(v, limit: int = 60) -> str:
    """``repr(v)`` cut to ``limit`` characters, for error messages that echo a client's value."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class BigInt:
    """A JSON integer longer than Python's int-parsing limit (``sys.get_int_max_str_digits()``):
    kept as its digit count so the field's own check refuses it with the field's name."""

    def __init__(self, digits: str) -> None:
        self.digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str):
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
    return BigInt(text) if limit and len(text) > limit else int(text)


def _bad_text(obj) -> str | None:
    """The path of the first string (value or key) in ``obj`` holding a lone UTF-16 surrogate
    (JSON allows ``"\ud800"``; it is not Unicode text and cannot be encoded back), else None."""
    stack = [(obj, "")]
    while stack:
        o, path = stack.pop()
        if isinstance(o, str):
            if not o.isascii():
                try:
                    o.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(o, dict):
            for k, v in o.items():
                p = f"{path}.{k}" if path else str(k)
                if not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return path or "body"
                stack.append((v, p))
        elif isinstance(o, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(o))
    return None


def _bool(body: dict, key: str, default: bool = False) -> bool:
    """``body[key]`` as a JSON boolean (``default`` when absent/null); ``ApiError`` 400 otherwise."""
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be a boolean, got {_show(v)}", param=key)
    return v


def parse_json_body(raw: bytes):
    """Decode a request body; ``ApiError`` 400 on anything that is not JSON text (bad UTF-8,
    syntax, nesting deep enough to hit Python's recursion limit, strings with lone surrogates,
    naming the field). Integers beyond Python's int-parsing limit become ``BigInt`` (the field's
    own check refuses them by name)."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # any other literal Python refuses to convert
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    bad = _bad_text(body)
    if bad is not None:
        raise ApiError(400, f"{bad}: a string holds a lone UTF-16 surrogate (not valid Unicode)", param=bad)
    return body


def _err_response(e: ApiError):
    """The OpenAI-shaped JSON error response of ``e`` (``Connection: close`` when ``e.close``)."""
    return JSONResponse(status_code=e.status, headers={"connection": "close"} if e.close else None,
                        content={"error": {"message": e.message, "type": e.etype, "param": e.param, "code": e.status}})


def _int(body: dict, key: str, default, lo: int | None = None, hi: int | None = None):
    """``body[key]`` as an int in [lo, hi] (``default`` when absent/null); ``ApiError`` 400 otherwise
    (floats, strings and booleans are refused, as OpenAI's schema types them as integers)."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, BigInt):
        raise ApiError(400, f"{key} must be an integer in range, got {v!r}", param=key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer, got {_show(v)}", param=key)
    if lo is not None and v < lo:
        raise ApiError(400, f"{key} must be >= {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise ApiError(400, f"{key} must be <= {hi}, got {v}", param=key)
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    """``body[key]`` as a finite float in [lo, hi] (or (lo, hi] with ``lo_open``); ``ApiError`` 400
    otherwise (NaN, strings, booleans, integers beyond float range)."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{key} must be a number, got {_show(v)}", param=key)
    try:
        v = float(v)
    except OverflowError:  # a JSON integer beyond float range, e.g. 10**400
        raise ApiError(400, f"{key} must be in [{lo}, {hi}], got an integer of {len(str(v))} digits", param=key) from None
    if v != v or v > hi or v < lo or (lo_open and v <= lo):
        raise ApiError(400, f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=key)
    return v


def parse_sampling(body: dict, default_max_tokens: int, chat: bool) -> SamplingParams:
    """Validate the sampling fields of a request body; raises ``ApiError`` (400)."""
    if _int(body, "n", 1) != 1:
        raise ApiError(400, "n must be 1 (the lab engine returns one choice)", param="n")
    if _int(body, "best_of", 1) != 1:
        raise ApiError(400, "best_of is not supported", param="best_of")
    # Every field of the OpenAI/vLLM schemas is implemented, metadata, or refused unless it asks
    # for nothing (engine/request_fields.py; docs/engine.md "Request fields"): none is ignored.
    refused = request_fields.check(body, chat, _show)
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 1024):
        raise ApiError(400, f"cache_salt must be a string of 1 to 1024 characters, got {_show(salt)}",
                       param="cache_salt")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, default_max_tokens, lo=0)
    min_tokens = _int(body, "min_tokens", 0, lo=0)
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    seed = _int(body, "seed", None)
    ignore_eos = _bool(body, "ignore_eos")
    top_k = _int(body, "top_k", 0, lo=-1, hi=VOCAB_SIZE)  # vLLM: 0 or -1 disables top-k
    return SamplingParams(temperature=_float(body, "temperature", 1.0, 0.0, 100.0),
                          top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=seed,
                          max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                          top_k=max(0, top_k), min_p=_float(body, "min_p", 0.0, 0.0, 1.0))


def parse_prompt(body: dict, tok: ByteTokenizer, max_len: int | None = None) -> list[int]:
    """``prompt``: a string, a list of token ids, or a one-element list of either -> raw ids.

    ``max_len``: when given, a prompt that cannot fit (more characters or ids than ``max_len``;
    every character is at least one byte token) is refused before tokenizing. Raises ``ApiError``
    400 for an empty, too long or malformed prompt and for ids outside ``[0, VOCAB_SIZE)``.
    """
    p = body.get("prompt")
    if isinstance(p, BigInt) or (isinstance(p, list) and any(isinstance(t, BigInt) for t in p)):
        raise ApiError(400, "prompt token ids must be integers in [0, {VOCAB_SIZE})".replace("{VOCAB_SIZE}", str(VOCAB_SIZE)),
                       param="prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if max_len is not None and isinstance(p, (str, list)) and len(p) > max_len:
        raise ApiError(400, f"the prompt has {len(p)} {'characters' if isinstance(p, str) else 'tokens'}, "
                            f"but the engine holds at most {max_len} tokens per request", param="prompt")
    if isinstance(p, str):
        ids = tok.encode(p)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {VOCAB_SIZE})", param="prompt")
        ids = list(p)
    elif isinstance(p, list):
        raise ApiError(400, "prompt must be a string, a list of token ids, or a one-element list of those "
                            "(batched prompts are not supported)", param="prompt")
    else:
        raise ApiError(400, "prompt is required (a string or a list of token ids)", param="prompt")
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    return ids


# A fenced window's requests carry WINDOW_HEADER; a HOLD taken with ``/pause?window=TOKEN`` still
# admits requests whose header equals TOKEN (the window's cells and its restore checks). The
# record format is shared with the vLLM admission fence (engine/hold.py).


class ServerState:
    """Admission state shared by the handlers: ``paused``, ``draining``, ``paused_since``
    (Unix time in seconds when admission was last closed; None while open) and ``window_token``
    (the fenced window admitted while paused; None when none).

    ``hold_file`` (``DSV41_ADMISSION_HOLD_FILE``; None: memory only, as vLLM) keeps a *fenced*
    HOLD (one taken with ``/pause?window=TOKEN``: window.yml, promote.yml, rollback.yml) across
    engine restarts: :meth:`hold` writes ``{"since": s, "window": TOKEN}`` there (atomic rename),
    :meth:`open` removes it, and a state built while the file holds a valid record starts held,
    admitting only that token's requests. So a rank 0 restarted under such a HOLD comes up held
    until its owner's checks pass and it reopens. A plain ``/pause`` is not kept (vLLM's
    behaviour), and an unreadable or malformed file is ignored with a warning, never a crash.
    Raises OSError from :meth:`hold`/:meth:`open` only when the file cannot be written/removed."""

    def __init__(self, hold_file: str | os.PathLike | None = None) -> None:
        self.paused = False
        self.draining = False
        self.paused_since: float | None = None
        self.window_token: str | None = None
        self.hold_file = Path(hold_file) if hold_file else None
        self.book = DrainBook()  # admitted requests and pending pause drains (engine/drain.py)
        self.shutdown_report: dict | None = None
        if self.hold_file is not None:
            self._load()

    def _load(self) -> None:
        try:
            rec = read_hold(self.hold_file)
        except HoldFileError as exc:
            log.warning("%s: starting open", exc)
            return
        if rec is None:
            return
        self.paused, self.paused_since, self.window_token = True, rec.since, rec.window
        log.info("starting held: the fenced HOLD %s (since %.0f) outlived the restart", rec.window, rec.since)

    def hold(self, window: str | None) -> None:
        """Close admission (``window``: the fenced token still admitted, or None); a fenced HOLD
        is written to ``hold_file``, a plain one removes a stale record."""
        if not self.paused:
            self.paused_since = time.time()
        self.paused = True
        self.window_token = window or None
        if self.hold_file is None:
            return
        if self.window_token is None:
            remove_hold(self.hold_file)
            return
        write_hold(self.hold_file, HoldRecord(self.paused_since, self.window_token))

    def open(self) -> None:
        """Admit requests again; the kept HOLD record (if any) is removed."""
        self.paused = False
        self.window_token = None
        self.paused_since = None
        if self.hold_file is not None:
            remove_hold(self.hold_file)


async def shutdown_drain(engine, st: ServerState, timeout_s: float) -> dict:
    """The shutdown drain (SIGTERM, a draining TP peer): stop admitting (``st.draining``; new
    requests and ``/pause`` get 503), end every pending ``wait`` drain (``drain``: ``shutdown``),
    then give the requests in flight ``timeout_s`` seconds (``DSV41_ENGINE_DRAIN_TIMEOUT_S``) to
    finish and abort the rest. A frozen engine (the latest pause was ``keep``) cannot finish
    anything, so its requests are aborted at once. Returns (and keeps in ``st.shutdown_report``)
    ``{"in_flight": n, "aborted": n, "still_running": n, "seconds": s}``; ``still_running`` is
    non-zero only when aborts did not land within ``ABORT_SETTLE_S`` (a hung step thread). Ends
    within ``timeout_s + ABORT_SETTLE_S`` seconds in every state."""
    t0 = time.monotonic()
    st.draining = True
    st.book.shutdown()
    in_flight = len(st.book.entries)
    if not getattr(engine, "frozen", False):
        await st.book.idle(timeout_s)
    keys = list(st.book.entries)
    for key in keys:
        rid = st.book.ask_abort(key, dr.BY_SHUTDOWN)
        if rid is not None:
            engine.abort(rid)
    if keys:
        log.warning("shutdown: aborting %d requests still in flight after the %g s drain%s", len(keys), timeout_s,
                    " (the engine is frozen by a keep pause)" if getattr(engine, "frozen", False) else "")
        await st.book.idle(ABORT_SETTLE_S)
    st.shutdown_report = {"in_flight": in_flight, "aborted": st.book.shutdown_aborted,
                          "still_running": len(st.book.entries), "seconds": round(time.monotonic() - t0, 3)}
    return st.shutdown_report


def create_app(engine, model_name: str, max_model_len: int, state: ServerState | None = None, metrics=None):
    """Build the FastAPI app serving ``engine`` (an ``engine.Engine``) as ``model_name``.

    Threads: handlers run on the event loop; ``engine`` calls each request's sink from its own
    thread, which hands events to the handler's ``asyncio.Queue`` with ``call_soon_threadsafe``.
    Admission (``_admission``) and ``engine.submit`` run with no ``await`` between them, so a
    ``/pause`` can never slip in between the check and the submit. A client that goes away
    (streaming or not) has its request aborted, freeing its slot and KV reservation.
    """
    tok = ByteTokenizer()
    st = state or ServerState()
    app = FastAPI(title="dsv41 lab engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server_state = st
    # add_middleware puts the last one outermost: BodyLimit sees the request first.
    app.add_middleware(CatchAll)
    app.add_middleware(BodyLimit)

    @app.exception_handler(ApiError)
    async def _api_error(_req, exc: ApiError):
        return _err_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, exc: RequestValidationError):
        # FastAPI's own 422 (e.g. ``/pause?timeout_s=abc``) in OpenAI's error shape.
        errs = exc.errors()
        where = ".".join(str(x) for x in errs[0].get("loc", ())) if errs else ""
        msg = f"{where}: {errs[0].get('msg')}" if errs else "invalid request"
        return _err_response(ApiError(400, msg, param=where or None))

    @app.exception_handler(Exception)
    async def _unexpected(_req, exc: Exception):
        # A bug must still answer in OpenAI's shape (and be logged), never as a bare text 500.
        # Only reached for errors outside CatchAll (the middleware stack itself).
        log.error("unhandled error in a request handler", exc_info=exc)
        return _err_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", etype="InternalServerError",
                                      close=True))

    async def _body(request: Request) -> dict:
        raw = await request.body()  # bounded by BodyLimit
        body = parse_json_body(raw)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _admission(body: dict, request: Request) -> None:
        m = body.get("model")
        if m is not None and m != model_name:
            raise ApiError(404, f"The model `{m}` does not exist.", etype="NotFoundError", param="model")
        if engine.fatal:
            raise ApiError(503, f"engine failed: {engine.fatal}", etype="ServiceUnavailableError")
        if st.draining:
            raise ApiError(503, "the server is shutting down (draining); not admitting new requests",
                           etype="ServiceUnavailableError")
        if st.paused and not (st.window_token and request.headers.get(WINDOW_HEADER) == st.window_token):
            raise ApiError(503, "the server is paused (POST /resume to admit requests again)",
                           etype="ServiceUnavailableError")

    def _stream_opts(body: dict) -> tuple[bool, bool]:
        so = body.get("stream_options")
        if so is None:
            return False, False
        if not isinstance(so, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        if so and not body.get("stream"):
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        return _bool(so, "include_usage"), _bool(so, "continuous_usage_stats")

    async def _run(request: Request, body: dict, chat: bool):
        stream = _bool(body, "stream")
        include_usage, continuous = _stream_opts(body)
        rti = _bool(body, "return_token_ids")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            try:
                ids = tok.chat_prompt(msgs)
            except Dsv41Error as exc:
                raise ApiError(400, str(exc), param="messages") from None
            default_max = max(1, min(256, max_model_len - len(ids)))
        else:
            ids = parse_prompt(body, tok, max_model_len)
            default_max = 16
        params = parse_sampling(body, default_max, chat)
        _admission(body, request)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        # Entered in the drain book with no await before the submit: a /pause sees it or not at all.
        key = st.book.admit(request.headers.get(WINDOW_HEADER))

        def sink(ev: dict) -> None:
            if ev["type"] == "finish":
                loop.call_soon_threadsafe(st.book.finished, key, ev["reason"])
            loop.call_soon_threadsafe(q.put_nowait, ev)

        try:
            req = engine.submit(ids, params, sink)
        except RequestError as exc:
            st.book.forget(key)
            raise ApiError(400, str(exc), param="max_tokens") from None
        except Dsv41Error as exc:
            st.book.forget(key)
            raise ApiError(503, str(exc), etype="ServiceUnavailableError") from None
        st.book.bind(key, req.request_id)

        def client_gone() -> None:
            st.book.ask_abort(key, dr.BY_CLIENT)
            engine.abort(req.request_id)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        dec = tok.incremental()

        def usage(ev: dict) -> dict:
            return {"prompt_tokens": ev["prompt_tokens"], "completion_tokens": ev["completion_tokens"],
                    "total_tokens": ev["prompt_tokens"] + ev["completion_tokens"]}

        if not stream:
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
                            log.info("client of %s went away; aborting it", req.request_id)
                            client_gone()
                            finished = True
                            return Response(status_code=499)
                    try:
                        ev = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
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
            text = dec.feed(out, final=True)
            choice: dict[str, Any] = {"index": 0, "finish_reason": ev["reason"], "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if rti:
                choice["token_ids"] = out
                choice["prompt_token_ids"] = ids
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                                 "choices": [choice], "usage": usage(ev)})

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, tids: list[int] | None, finish: str | None, ev: dict | None, first: bool) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if rti and tids is not None:
                c["token_ids"] = tids
                if first:
                    c["prompt_token_ids"] = ids
            d: dict[str, Any] = {"id": rid, "object": chunk_obj, "created": created, "model": model_name, "choices": [c]}
            if include_usage and continuous and ev is not None:
                d["usage"] = usage(ev)
            return f"data: {json.dumps(d)}\n\n"

        async def gen():
            first = True
            finished = False
            try:
                while True:
                    ev = await q.get()
                    if ev["type"] == "tokens":
                        yield chunk(dec.feed(ev["ids"]), ev["ids"], None, ev, first)
                        first = False
                        continue
                    finished = True
                    if ev["reason"] == "error":
                        code, etype = (503, "ServiceUnavailableError") if engine.fatal else (500, "InternalServerError")
                        err = {"error": {"message": ev.get("error", "engine failed"), "type": etype,
                                         "param": None, "code": code}}
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    tail = dec.feed([], final=True)
                    yield chunk(tail, [] if rti else None, ev["reason"], ev, first)
                    if include_usage:
                        yield f"data: {json.dumps({'id': rid, 'object': chunk_obj, 'created': created, 'model': model_name, 'choices': [], 'usage': usage(ev)})}\n\n"
                    break
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # client went away: free the engine's slot
                    client_gone()

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI completions (see module doc for the fields honoured)."""
        return await _run(request, await _body(request), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI chat completions over the lab chat template (``ByteTokenizer.chat_prompt``)."""
        return await _run(request, await _body(request), chat=True)

    @app.get("/v1/models")
    async def models():
        """The one served model (readiness probe of the playbooks and the harness)."""
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dsv41",
                                            "root": model_name, "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        """200 ``{"status": "ok"}``, or 503 with the error once the engine has failed."""
        if engine.fatal:
            return JSONResponse(status_code=503, content={"status": "failed", "error": engine.fatal})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_ep():
        """Prometheus text (names in ``dsv41.engine.metrics``)."""
        if metrics is None:
            raise ApiError(404, "metrics are not enabled", etype="NotFoundError")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/pause")
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
        if mode is None:
            raw = await request.body()
            if raw.strip():
                b = parse_json_body(raw)
                if not isinstance(b, dict):
                    raise ApiError(400, "request body must be a JSON object like {\"mode\": \"wait\"}")
                mode = b.get("mode")
            mode = mode or "abort"
        if mode not in ("abort", "wait", "keep"):
            raise ApiError(400, f"mode must be 'abort', 'wait' or 'keep', got {mode!r}", param="mode")
        if not 0 < timeout_s < float("inf"):  # NaN fails too
            raise ApiError(400, f"timeout_s must be a positive number of seconds, got {timeout_s}", param="timeout_s")
        if window is not None and not WINDOW_TOKEN_RE.fullmatch(window):
            raise ApiError(400, "window must be 1-128 characters of [A-Za-z0-9._-]", param="window")
        if st.draining:
            raise ApiError(503, "the server is shutting down (draining); nothing to pause",
                           etype="ServiceUnavailableError")
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
                _abort_scope(d)
            if kept_err is not None:
                raise ApiError(500, f"admission is held, but the HOLD could not be kept in {st.hold_file}: {kept_err}",
                               etype="InternalServerError")
            if mode == "keep":
                d.outcome = dr.FROZEN
            elif mode == "abort":
                d.outcome = dr.DRAINED if await st.book.settle(d, timeout_s) else dr.TIMED_OUT
            elif await st.book.wait(d, timeout_s) == dr.TIMED_OUT:
                n = _abort_scope(d)
                log.warning("pause: %d in-flight requests outlived the %g s drain; aborting them", n, timeout_s)
                await st.book.settle(d, ABORT_SETTLE_S)
                if metrics is not None and d.aborted:
                    metrics.pause_drain_aborts.inc(d.aborted)
        finally:
            st.book.end(d)
        return {"paused": st.paused, "mode": mode, "drain": d.outcome, "in_flight_at_pause": d.in_flight_at_pause,
                "aborted": d.aborted, "aborted_after_timeout": d.aborted if mode == "wait" else 0,
                "still_running": d.still_running}

    def _abort_scope(d) -> int:
        """Abort every request of ``d``'s scope nobody asked to abort yet; returns how many."""
        n = 0
        for key in sorted(d.scope):
            rid = st.book.ask_abort(key, d)
            if rid is not None and key in d.asked:
                engine.abort(rid)
                n += 1
        return n

    @app.post("/resume")
    async def resume():
        """Admit requests again, end every pending ``wait`` drain (``resumed``: nothing more is
        aborted) and unfreeze a ``keep`` pause (idempotent)."""
        try:
            st.open()
            failed = None
        except OSError as exc:
            failed = exc
        st.book.resume()
        engine.freeze(False)
        if failed is not None:
            raise ApiError(500, f"admission is open, but the kept HOLD {st.hold_file} could not be removed: {failed}",
                           etype="InternalServerError")
        return {"paused": False}

    @app.get("/is_paused")
    async def is_paused():
        """``{"is_paused": bool}`` (vLLM's dev-mode endpoint shape) plus ``paused_since``: Unix
        time (s) admission was closed, null while open (what ``dsv41 status`` shows as "since")."""
        return {"is_paused": st.paused, "paused_since": st.paused_since if st.paused else None}

    return app
