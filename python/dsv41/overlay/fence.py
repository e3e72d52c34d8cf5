"""The fenced HOLD for vLLM: an ASGI middleware in front of vLLM's OpenAI API server (rank 0).

vLLM 0.33.0's ``/pause`` (``VLLM_SERVER_DEV_MODE=1``) pauses the engine for every client, so a
window's (or promote/rollback's) own requests could not run under its HOLD. This middleware gives
vLLM the lab engine's fenced HOLD (``engine/server.py``): ``POST /pause?mode=wait&window=TOKEN``
closes admission for everyone except requests carrying ``X-DSV41-Window: TOKEN``, and the HOLD
outlives restarts through ``DSV41_ADMISSION_HOLD_FILE`` (the record format of ``engine/hold.py``).

vLLM loads it with ``--middleware dsv41.overlay.fence.AdmissionFence`` (FrontendArgs.middleware in
vllm/entrypoints/openai/cli_args.py: an import path; a class is added with
``app.add_middleware()``, i.e. called as ``AdmissionFence(app)``). Pure ASGI, no vLLM import.

Behaviour (docs/windows.md "The fence on vLLM"):

- The hold file is the state: it is read (cached by inode, mtime and size) on every request that
  can be refused, so a restarted API server, or another API server process of the same rank,
  sees the same HOLD.
- While a fenced HOLD is in force, every route except :data:`ALWAYS_ADMITTED` and the control
  routes answers 503 (OpenAI error JSON, ``Retry-After``) unless its ``X-DSV41-Window`` header
  equals the token. A hold file that exists but cannot be read or parsed keeps admission closed
  for everyone (fail safe) and logs one error line per distinct file; ``/resume`` clears it.
- Every control request (``dsv41.authz.is_control``: ``/pause``, ``/resume``, and vLLM's dev
  routes such as ``/sleep`` or ``/reset_prefix_cache``) must carry the operator credential
  (``X-DSV41-Operator``) and no browser cross-site shape; otherwise 401/403 here, never forwarded.
- ``POST /pause?mode=wait&window=TOKEN[&timeout_s=S]`` is answered here, never forwarded (vLLM's
  engine is not paused): it writes the record, then waits up to ``S`` seconds (default 600) for
  the requests in flight through this middleware to finish. The fence cannot abort requests
  inside vLLM's engine: requests that outlive ``S`` keep running and are counted
  (``outlived_drain`` in the answer, :attr:`AdmissionFence.drain_outlived_total`). Only
  ``mode=wait`` is accepted with ``window`` (400 otherwise).
- ``POST /pause`` without ``window`` is forwarded to vLLM unchanged; when vLLM answers 2xx the
  kept record is removed (a plain HOLD replaces a fenced one and is memory only, as in the lab).
- ``POST /resume`` removes the record, then is forwarded to vLLM when its dev routes are on
  (resuming a plain pause; idempotent in vLLM), else answered here.
- ``GET /is_paused`` is answered here while a fenced HOLD is in force (``{"is_paused": true,
  "paused_since": S}``); otherwise forwarded to vLLM with its dev routes on, else answered
  ``false`` (vLLM without dev routes cannot be paused).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from pathlib import Path
from urllib.parse import parse_qs, urlencode

from dsv41 import authz, envs, fileio
from dsv41.engine import drain as dr
from dsv41.engine.hold import (
    WINDOW_HEADER,
    WINDOW_TOKEN_RE,
    HoldFileError,
    HoldRecord,
    read_hold,
    remove_hold,
    write_hold,
)

log = logging.getLogger("dsv41.overlay.fence")

#: Routes admitted whatever the HOLD: liveness, readiness (the serve role's ``/v1/models``),
#: metrics and version. Everything else (completions, chat, responses, embeddings, tokenize,
#: ``/invocations``, dev routes ...) is refused without the token while held: fail safe for
#: routes added to vLLM later.
ALWAYS_ADMITTED = frozenset({"/health", "/ping", "/metrics", "/version", "/v1/models", "/is_paused"})
#: The control routes the fence answers (or forwards) itself.
CONTROL_ROUTES = frozenset({"/pause", "/resume", "/is_paused"})
#: Seconds a refused client is told to wait (``Retry-After``).
RETRY_AFTER_S = 10
#: Default drain bound of a fenced ``/pause`` (seconds), as the lab engine's ``timeout_s``.
DEFAULT_DRAIN_S = 600.0
# How often the drain checks the in-flight count (seconds).
_DRAIN_POLL_S = 0.02
_UNREADABLE = object()  # the cached state of a hold file that exists but is not a record


def _vllm_dev_routes(env=None) -> bool:
    """True when vLLM runs with ``VLLM_SERVER_DEV_MODE`` set to a non-zero integer (its own parse)."""
    raw = (os.environ if env is None else env).get("VLLM_SERVER_DEV_MODE", "0")
    try:
        return int(raw) != 0
    except ValueError:
        return False


def _json_response(status: int, doc: dict, headers: list[tuple[bytes, bytes]] | None = None):
    """An ASGI app answering ``doc`` as JSON with ``status``."""
    body = fileio.dumps_json(doc).encode()

    async def app(scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + (headers or []),
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def _error(status: int, message: str, etype: str, param: str | None = None, headers=None):
    """OpenAI's error shape, as vLLM and the lab engine answer errors."""
    return _json_response(
        status, {"error": {"message": message, "type": etype, "param": param, "code": status}}, headers
    )


class AdmissionFence:
    """ASGI middleware: the fenced HOLD in front of vLLM's API (module docstring).

    ``app``: the ASGI app it wraps (vLLM's FastAPI app). ``hold_file``: where the fenced HOLD is
    kept (default ``DSV41_ADMISSION_HOLD_FILE``; empty: the fence never holds, ``/pause?window=``
    answers 500). ``dev_routes``: whether vLLM serves its dev routes (default: from
    ``VLLM_SERVER_DEV_MODE``). ``credential``: the operator credential every control request
    (``dsv41.authz.is_control``: ``/pause``, ``/resume``, vLLM's dev routes) must carry, without a
    cross-site shape (default: ``DSV41_OPERATOR_CREDENTIAL_FILE``; none: they are all refused);
    ``allowed_hosts``: Host names accepted on them besides IP literals and ``localhost`` (default
    ``DSV41_CONTROL_HOSTS``). Raises ``dsv41.envs.ConfigError`` on a bad ``DSV41_*`` environment
    and ``dsv41.authz.CredentialError`` on an unusable credential file (vLLM then does not start). Counters: :attr:`in_flight` (requests being served that a HOLD
    could refuse), :attr:`refused_total`, :attr:`drain_outlived_total`.
    """

    def __init__(
        self,
        app,
        hold_file: str | os.PathLike | None = None,
        dev_routes: bool | None = None,
        credential: str | None = None,
        allowed_hosts: tuple[str, ...] | None = None,
    ) -> None:
        self.app = app
        settings = envs.parse()
        path = hold_file if hold_file is not None else settings.admission_hold_file
        loaded, hosts = authz.server_settings(settings) if credential is None else (credential, ())
        self.credential = loaded
        self.allowed_hosts = tuple(hosts if allowed_hosts is None else allowed_hosts)
        if self.credential is None:
            log.warning(
                "DSV41_OPERATOR_CREDENTIAL_FILE is not set: /pause, /resume and every other control "
                "route refuse every request"
            )
        self.hold_file = Path(path) if path else None
        self.dev_routes = _vllm_dev_routes() if dev_routes is None else dev_routes
        self.book = dr.DrainBook()  # requests in flight through the fence, pending drains
        self.refused_total = 0
        self.drain_outlived_total = 0
        self._key: tuple | None = None
        self._state: HoldRecord | object | None = None
        if self.hold_file is None:
            log.warning("DSV41_ADMISSION_HOLD_FILE is empty: the admission fence cannot take a fenced HOLD")
        else:
            state = self.hold()
            if isinstance(state, HoldRecord):
                # the token is a secret (it admits requests past the HOLD): never logged
                log.info("starting held: a fenced HOLD (since %.0f) outlived the restart", state.since)

    @property
    def in_flight(self) -> int:
        """Requests being served through the fence that a HOLD could refuse."""
        return len(self.book.entries)

    def hold(self) -> HoldRecord | object | None:
        """The HOLD in force: a :class:`HoldRecord`, None (open), or the unreadable marker (held,
        no token admitted). Re-reads the file only when its inode, mtime or size changed; an
        unreadable file logs one error line per change, never raises."""
        if self.hold_file is None:
            return None
        try:
            st = os.stat(self.hold_file)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except (FileNotFoundError, NotADirectoryError):  # no record can exist there
            key = None
        except OSError as exc:
            key = ("error", str(exc))
        if key == self._key and self._key is not None:
            return self._state
        self._key = key
        if key is None:
            self._state = None
            return None
        try:
            self._state = read_hold(self.hold_file)
        except HoldFileError as exc:
            log.error("%s: admission stays HELD for every request until POST /resume removes it", exc)
            self._state = _UNREADABLE
        return self._state

    def held(self) -> bool:
        """True while a fenced HOLD (or an unreadable hold file) is in force."""
        return self.hold() is not None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if authz.is_control(method, path):
            why = authz.control_refusal(scope.get("headers", ()), self.credential, self.allowed_hosts)
            if why is not None:
                self.refused_total += 1
                etype = "AuthenticationError" if why[0] == 401 else "PermissionDeniedError"
                return await _error(why[0], why[1], etype)(scope, receive, send)
        if path == "/pause" and method == "POST":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            if "window" in query:
                answer = self._fenced_pause(query)
                # vLLM's uvicorn access log prints the query string of this scope: never the token
                scope["query_string"] = urlencode(
                    [(k, "REDACTED" if k == "window" else v) for k, vs in query.items() for v in vs]
                ).encode()
                return await answer(scope, receive, send)
            return await self._plain_pause(scope, receive, send)
        if path == "/resume" and method == "POST":
            return await self._resume(scope, receive, send)
        if path == "/is_paused" and method == "GET":
            state = self.hold()
            if state is not None:
                since = state.since if isinstance(state, HoldRecord) else None
                return await _json_response(200, {"is_paused": True, "paused_since": since})(scope, receive, send)
            if not self.dev_routes:
                return await _json_response(200, {"is_paused": False, "paused_since": None})(scope, receive, send)
            return await self.app(scope, receive, send)
        if path in ALWAYS_ADMITTED or path in CONTROL_ROUTES:
            return await self.app(scope, receive, send)
        state = self.hold()
        token = next(
            (v.decode("latin-1") for k, v in scope.get("headers", ()) if k.decode("latin-1").lower() == WINDOW_HEADER),
            None,
        )
        if state is not None:
            if not (isinstance(state, HoldRecord) and authz.same_secret(token, state.window)):
                self.refused_total += 1
                return await _error(
                    503,
                    "the server is paused (a fenced HOLD is in force; POST /resume to admit requests again)",
                    "ServiceUnavailableError",
                    headers=[(b"retry-after", str(RETRY_AFTER_S).encode())],
                )(scope, receive, send)
        key = self.book.admit(token)  # no await since the check above: a /pause sees it or not
        try:
            return await self.app(scope, receive, send)
        finally:
            self.book.finished(key, "done")

    def _fenced_pause(self, query: dict[str, list[str]]):
        """The ASGI app answering ``POST /pause?window=...`` (validation, record, drain)."""
        window = query["window"][-1]
        mode = query.get("mode", [None])[-1]
        if mode != "wait":
            return _error(
                400, f"a fenced HOLD on vLLM drains: mode must be 'wait', got {mode!r}", "BadRequestError", "mode"
            )
        try:
            timeout_s = float(query.get("timeout_s", [DEFAULT_DRAIN_S])[-1])
        except ValueError:
            timeout_s = math.nan
        if not 0 < timeout_s < math.inf:  # NaN fails too
            return _error(
                400,
                f"timeout_s must be a positive number of seconds, got {query['timeout_s'][-1]!r}",
                "BadRequestError",
                "timeout_s",
            )
        if not WINDOW_TOKEN_RE.fullmatch(window):
            return _error(400, "window must be 1-128 characters of [A-Za-z0-9._-]", "BadRequestError", "window")
        if self.hold_file is None:
            return _error(
                500, "admission is NOT held: DSV41_ADMISSION_HOLD_FILE is not set on this server", "InternalServerError"
            )
        state = self.hold()
        since = state.since if isinstance(state, HoldRecord) else time.time()
        record = HoldRecord(since, window)
        try:
            write_hold(self.hold_file, record)
        except OSError as exc:
            return _error(
                500,
                f"admission is NOT held: the fenced HOLD could not be written to {self.hold_file}: {exc}",
                "InternalServerError",
            )
        self.hold()  # cache the record just written
        d = self.book.begin("wait", window)  # supersedes a pending drain of this process
        log.info("fenced HOLD taken; draining %d in-flight requests (at most %g s)", d.in_flight_at_pause, timeout_s)

        async def app(scope, receive, send):
            try:
                late = await self.drain(d, record, timeout_s)
            finally:
                self.book.end(d)
            await _json_response(
                200,
                {
                    "paused": self.held(),
                    "mode": "wait",
                    "window": window,
                    "drain": d.outcome,
                    "in_flight_at_pause": d.in_flight_at_pause,
                    "aborted": 0,
                    "aborted_after_timeout": 0,
                    "outlived_drain": late,
                    "still_running": d.still_running,
                },
            )(scope, receive, send)

        return app

    async def drain(self, d: dr.Drain, record: HoldRecord, timeout_s: float) -> int:
        """Wait until the requests of ``d``'s scope (in flight through the fence at its pause and
        refused by its HOLD) have finished, at most ``timeout_s`` seconds. Ends early, counting
        nothing, when the HOLD it took is gone: a ``/resume`` (``resumed``) or another pause
        (``superseded``), in this process or another one sharing the hold file. Returns how many
        of its scope were still in flight at the deadline (0 otherwise); those keep running (the
        fence cannot abort inside vLLM), are logged and added to :attr:`drain_outlived_total`.
        Requests admitted after the pause, a resume, or with the token, are never counted."""
        deadline = time.monotonic() + timeout_s
        while d.outcome is None:
            if not d.scope:
                d.outcome = dr.DRAINED
                break
            now = self.hold()
            if now != record:  # removed, replaced, or unreadable: this HOLD's drain is over
                self.book.end_waits(dr.RESUMED if now is None else dr.SUPERSEDED)
                break
            if time.monotonic() >= deadline:
                d.outcome = dr.TIMED_OUT
                late = len(d.scope)
                self.drain_outlived_total += late
                log.warning(
                    "fenced HOLD: %d in-flight requests outlived the %g s drain; they run to completion",
                    late,
                    timeout_s,
                )
                return late
            await asyncio.sleep(_DRAIN_POLL_S)
        return 0

    async def _plain_pause(self, scope, receive, send):
        """Forward vLLM's own ``/pause``; a 2xx answer replaces the fenced HOLD (record removed)."""

        async def watched(msg):
            if msg["type"] == "http.response.start" and 200 <= msg["status"] < 300:
                self.book.end_waits(dr.SUPERSEDED)
            if msg["type"] == "http.response.start" and 200 <= msg["status"] < 300 and self.hold_file is not None:
                try:
                    remove_hold(self.hold_file)
                except OSError as exc:
                    log.error("plain /pause: the fenced HOLD record %s could not be removed: %s", self.hold_file, exc)
            await send(msg)

        return await self.app(scope, receive, watched)

    async def _resume(self, scope, receive, send):
        """Remove the record; then vLLM's ``/resume`` (dev routes on) or an answer here."""
        if self.hold_file is not None:
            try:
                remove_hold(self.hold_file)
            except OSError as exc:
                return await _error(
                    500,
                    f"admission is still HELD: the fenced HOLD {self.hold_file} could not be removed: {exc}",
                    "InternalServerError",
                )(scope, receive, send)
        self.book.resume()
        if self.dev_routes:
            return await self.app(scope, receive, send)
        return await _json_response(200, {"paused": False})(scope, receive, send)
