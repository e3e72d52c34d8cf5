"""The authorization campaign (issue 45; ``make fuzz``, outside ``make test``). The request
generator and its oracle: tests/fuzz/authzshotutil.py.

Every HTTP server of python/dsv41 (``httpserverutil.STARTERS``, which
tests/unit/test_http_servers_every_endpoint.py keeps complete) and the vLLM admission fence
(``dsv41.overlay.fence.AdmissionFence``, a middleware inside vLLM's server) is either in the
campaign or shown to have no state-changing route:

* **In the campaign**: the lab engine's app (``create_app``; its control and read routes
  enumerated from the app's own routes) and the fence (its ``CONTROL_ROUTES`` and vLLM's dev
  routes, in front of a stand-in for vLLM that serves those routes with vLLM's methods).
  ``AUTHZ_FUZZ_EXAMPLES`` (default 2000) requests each, in process (httpx's ASGI transport, as
  tests/unit/test_authz.py), every one built from random choices of a ``random.Random`` seeded
  from ``FUZZ_SEED`` (default 45): the method (the route's, others, lower case: the ASGI scope
  keeps a method as sent), the path (trailing or doubled slash, percent-encoded characters, case,
  a query string, a ``/v1/..`` prefix), the operator credential (absent, empty, wrong, its prefix
  or suffix, one character changed, padded, twice, in two headers, the header name in other
  case, in the query string, a cookie or ``Authorization: Bearer`` instead), ``Host``,
  ``Origin``, ``Sec-Fetch-Site``, the content type and body (JSON, text/plain, form, none, junk,
  chunked).
* **No state-changing route** (the ``http.server`` endpoints): ``AUTHZ_FUZZ_EXAMPLES // 10``
  requests of the same generator on loopback, at the server's GET paths (its own ``GET_PATHS``),
  ``/pause``, ``/resume`` and an unknown path; no request with a method other than
  GET/HEAD/OPTIONS may be answered 2xx or 3xx (such a server must join the campaign), and no 5xx
  but http.server's 501 for a method its handler does not implement (RFC 9110 15.6.2; documented
  in docs/operations.md) and a 503 of a full connection book (retried after ``Retry-After``).

The oracle mirrors ``dsv41.authz.control_refusal`` from the generator's own choices: a request
may change state only with exactly one operator header equal to the credential (header names are
case-insensitive; surrounding whitespace is not part of an HTTP field value), a Host that is an IP
literal, ``localhost`` or a configured name, no Origin other than the Host's, no
``Sec-Fetch-Site`` other than ``same-origin``/``none``, and no body unless typed
``application/json``. Any other request must leave the state as it was (read before and after
each request: ``/is_paused`` and the engine's or fence's state; for the fence, nothing
forwarded to vLLM but inference paths, which vLLM answers 404 for these), and, when its method
is not a read (``authz.SAFE_METHODS``), be answered 4xx (or, while a HOLD is in force, the
HOLD's 503 with ``Retry-After``: admission closed); a read of a control route is never answered
2xx. No request is ever answered 5xx but that HOLD's 503; no answer (body or headers) and no log
record (all loggers but the test client's own ``httpx``/``httpcore``) holds the credential, unless
the request put it in its own URL (echoed, counted). One ``FUZZ {json}`` line per server with the
counts, for docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
pytest.importorskip("fastapi")
from authutil import TEST_HOSTS, VLLM_READ_ROUTES, engine_control_routes, engine_read_routes, fence_control_paths  # noqa: E402
from authzshotutil import HOST, Shot, _request, _secret, make_shot  # noqa: E402
from dsv41 import authz  # noqa: E402
from dsv41.engine.server import create_app  # noqa: E402
from dsv41.engine.server_state import ServerState  # noqa: E402
from dsv41.overlay.fence import AdmissionFence  # noqa: E402
from engineutil import FakeEngine  # noqa: E402
from httpserverutil import STARTERS  # noqa: E402

EXAMPLES = int(os.environ.get("AUTHZ_FUZZ_EXAMPLES", "2000"))
SEED = int(os.environ.get("FUZZ_SEED", "45"))
ENGINE, FENCE = "dsv41/entrypoints/engine_serve.py", "dsv41/overlay/fence.py"
#: Servers with state-changing routes, run in process (every other STARTERS entry is probed).
IN_CAMPAIGN = (ENGINE, FENCE)


class LogTap(logging.Handler):
    """Every log record of the process, formatted with its traceback (not the test client's
    own ``httpx`` logger, which prints the URLs the campaign sends)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith(("httpx", "httpcore")):
            self.lines.append(self.format(record))


@pytest.fixture
def log_tap():
    """A :class:`LogTap` on the root logger at DEBUG for the test's duration."""
    tap, root = LogTap(), logging.getLogger()
    old = root.level
    root.addHandler(tap)
    root.setLevel(logging.DEBUG)
    try:
        yield tap
    finally:
        root.removeHandler(tap)
        root.setLevel(old)


class RecordingEngine(FakeEngine):
    """FakeEngine that keeps the freeze state the pause routes set (the real engine's ``frozen``)."""

    frozen = False

    def freeze(self, on):
        self.frozen = bool(on)


class EngineUnderTest:
    """The lab engine's app with a kept HOLD file; its control and read routes from the app."""

    def __init__(self, tmp_path: Path, cred: str) -> None:
        self.engine, self.st = RecordingEngine(), ServerState(tmp_path / "hold")
        self.app = create_app(self.engine, "m", 64, state=self.st, operator_credential=cred, allowed_hosts=TEST_HOSTS)
        self.control, self.reads = engine_control_routes(self.app), engine_read_routes(self.app)
        self.hold_file = tmp_path / "hold"

    def forwarded(self) -> list:
        """Requests passed to an app behind this server: none (the engine is the app)."""
        return []

    def held(self) -> bool:
        """Admission is closed (a HOLD): requests it refuses are answered 503 with Retry-After."""
        return self.st.paused

    async def state(self, c: httpx.AsyncClient) -> tuple:
        """The admission state, through ``/is_paused`` and inside the engine."""
        r = await c.get(f"http://{HOST}/is_paused")
        st, eng = self.st, self.engine
        hold = self.hold_file.read_bytes() if self.hold_file.exists() else None
        return (
            r.status_code,
            r.content,
            st.paused,
            st.paused_since,
            st.window_token,
            st.book.epoch,
            len(st.book.entries),
            len(st.book.pending),
            eng.frozen,
            len(eng.aborted),
            len(eng.prompts),
            hold,
        )


class VllmStandIn:
    """Raw ASGI stand-in for vLLM behind the fence: its dev routes with vLLM's methods (the
    fence's control paths POST, :data:`VLLM_READ_ROUTES` GET; HEAD as GET), 405 on another method
    (Starlette compares methods as sent), 404 elsewhere. Records every request it is given
    (``forwarded``) and the state its POST routes change."""

    def __init__(self) -> None:
        self.routes = {p: "POST" for p in fence_control_paths()} | {p: "GET" for p in VLLM_READ_ROUTES}
        self.forwarded: list[tuple[str, str]] = []
        self.paused = self.sleeping = False
        self.calls = 0

    async def __call__(self, scope, receive, send):
        method, path = scope["method"], scope["path"]
        self.forwarded.append((method, path))
        want = self.routes.get(path)
        if want is None or method not in ((want, "HEAD") if want == "GET" else (want,)):
            status = 404 if want is None else 405
            doc = {"detail": "Not Found" if want is None else "Method Not Allowed"}
        else:
            status, doc = 200, {}
            if path in ("/pause", "/resume"):
                self.paused = path == "/pause"
            elif path in ("/sleep", "/wake_up"):
                self.sleeping = path == "/sleep"
            elif path == "/is_paused":
                doc = {"is_paused": self.paused}
            elif path == "/is_sleeping":
                doc = {"is_sleeping": self.sleeping}
            else:
                self.calls += 1
        body = json.dumps(doc).encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": body})


class FenceUnderTest:
    """The fence (dev routes on, a kept HOLD file) in front of :class:`VllmStandIn`."""

    def __init__(self, tmp_path: Path, cred: str) -> None:
        self.vllm = VllmStandIn()
        self.hold_file = tmp_path / "hold"
        self.app = AdmissionFence(
            self.vllm, hold_file=self.hold_file, dev_routes=True, credential=cred, allowed_hosts=TEST_HOSTS
        )
        self.control = [("POST", p) for p in fence_control_paths()]
        self.reads = [("GET", p) for p in sorted(VLLM_READ_ROUTES)]

    def forwarded(self) -> list:
        """Every request the fence passed to the stand-in so far."""
        return self.vllm.forwarded

    def held(self) -> bool:
        """A fenced HOLD is in force: requests it refuses are answered 503 with Retry-After."""
        return self.app.held()

    async def state(self, c: httpx.AsyncClient) -> tuple:
        """The HOLD through ``/is_paused``, the hold file, the stand-in's state and the drains."""
        r = await c.get(f"http://{HOST}/is_paused")
        hold = self.hold_file.read_bytes() if self.hold_file.exists() else None
        v = self.vllm
        return (
            r.status_code,
            r.content,
            hold,
            v.paused,
            v.sleeping,
            v.calls,
            self.app.in_flight,
            len(self.app.book.pending),
        )


def _leak_check(cred: str, shot: Shot, r: httpx.Response | None, lines: list[str], n: Counter) -> list[str]:
    """Violations of "no answer (body, headers) and no log record holds the credential". A
    request that put the credential in its own URL may see it echoed (a redirect's Location, the
    path in an error message, an access log's request line): counted in ``n["echoed"]``, not a
    leak (nothing the sender did not write; a server cannot redact a URL it does not parse)."""
    in_answer = r is not None and (cred in r.content.decode("latin-1") or any(cred in v for v in r.headers.values()))
    in_log = any(cred in line for line in lines)
    if not (in_answer or in_log):
        return []
    if cred in shot.url:
        n["echoed"] += 1
        return []
    return ["credential in the answer"] * in_answer + ["credential in a log record"] * in_log


async def _campaign(server, cred: str, rng: random.Random, tap: LogTap) -> tuple[dict, list]:
    """Run :data:`EXAMPLES` shots at ``server``; returns (counts, violations)."""
    n = Counter()
    refused, read_codes, violations = Counter(), Counter(), []
    transport = httpx.ASGITransport(app=server.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, follow_redirects=False, timeout=60) as c:
        before = await server.state(c)
        for _ in range(EXAMPLES):
            read = rng.random() < 0.15
            shot = make_shot(rng, cred, rng.choice(server.reads if read else server.control), read)
            n_fwd, n_log, held = len(server.forwarded()), len(tap.lines), server.held()
            # the transport itself, not the client: the client parses a 3xx's Location (built from
            # the Host sent) and raises on a malformed one; the answer as the server gave it is wanted
            r = await transport.handle_async_request(_request(c, shot))
            await r.aread()
            fwd = server.forwarded()[n_fwd:]
            after = await server.state(c)
            changed = after != before
            control = shot.method.upper() not in authz.SAFE_METHODS
            why = []
            # the HOLD's own refusal (admission closed, Retry-After) is a refusal, not a fault
            hold_503 = held and r.status_code == 503 and "retry-after" in r.headers
            if r.status_code >= 500 and not hold_503:
                why.append("5xx")
            why += _leak_check(cred, shot, r, tap.lines[n_log:], n)
            if not shot.permitted:
                if changed:
                    why.append("state changed")
                if control and not (400 <= r.status_code < 500 or hold_503):
                    why.append("control request not answered 4xx")
                if control and any(not authz.is_inference(p) for _m, p in fwd):
                    why.append("forwarded to vLLM")
                elif control and fwd:  # an OpenAI path (/v1/%2e%2e/pause): vLLM routes it as written, 404
                    n["forwarded_inference"] += 1
                if not control and not shot.read_target and 200 <= r.status_code < 300:
                    why.append("read of a control route answered 2xx")
            if why:
                violations.append({"why": why, "status": r.status_code, "forwarded": fwd, **shot.labels})
            n["requests"] += 1
            n["forwarded"] += len(fwd)
            if control:
                n["control_requests"] += 1
                n["credentialed"] += shot.permitted
                if 400 <= r.status_code < 500 or hold_503:
                    refused[str(r.status_code)] += 1
                else:
                    n["admitted"] += 1
            else:
                n["read_requests"] += 1
                read_codes[str(r.status_code)] += 1
            n["state_changes"] += changed
            before = after
    counts = {
        "requests": n["requests"],
        "control_requests": n["control_requests"],
        "credentialed": n["credentialed"],
        "refused": dict(sorted(refused.items())),
        "admitted": n["admitted"],
        "state_changes": n["state_changes"],
        "read_requests": n["read_requests"],
        "read_codes": dict(sorted(read_codes.items())),
        "forwarded": n["forwarded"],
        "forwarded_inference": n["forwarded_inference"],
        "echoed": n["echoed"],
    }
    return counts, violations


def _probe(addr, cred: str, rng: random.Random, paths: list[str], tap: LogTap) -> tuple[dict, list]:
    """``EXAMPLES // 10`` shots (at least 20) over loopback at a server without control routes, at
    its GET paths, the control paths of the others and an unknown one; returns (counts, violations)."""
    codes, violations, n = Counter(), [], Counter()
    base = f"http://{addr[0]}:{addr[1]}"
    with httpx.Client(timeout=30, follow_redirects=False) as c:
        for _ in range(max(20, EXAMPLES // 10)):
            target = rng.choice(paths + ["/pause", "/resume", "/no-such-route"])
            shot = make_shot(rng, cred, (rng.choice(["POST", "PUT", "DELETE", "PATCH"]), target), False)
            shot.url = shot.url.replace(f"http://{HOST}", base, 1)
            n_log = len(tap.lines)
            try:
                for _retry in range(5):  # a full connection book answers 503 Retry-After: as a client would
                    r = c.send(_request(c, shot))
                    if r.status_code != 503 or "retry-after" not in r.headers:
                        break
                    n["retried_503"] += 1
                    time.sleep(0.1)
                code = str(r.status_code)
            except httpx.LocalProtocolError:  # h11 will not send it (a padded header value): not a request
                n["unsendable"] += 1
                continue
            except httpx.TransportError as exc:  # closed unanswered: refused all the same
                r, code = None, type(exc).__name__
            control = shot.method.upper() not in authz.SAFE_METHODS
            n["control_requests" if control else "read_requests"] += 1
            codes[code] += 1
            why = _leak_check(cred, shot, r, tap.lines[n_log:], n)
            if control and r is not None and 200 <= r.status_code < 400:
                why.append("a state-changing route: add this server to the campaign")
            if r is not None and r.status_code >= 500 and r.status_code not in (501, 503):
                why.append("5xx")
            if why:
                violations.append({"why": why, "status": code, **shot.labels})
    counts = {"requests": sum(codes.values()), **dict(sorted(n.items())), "codes": dict(sorted(codes.items()))}
    return counts, violations


def test_the_campaign_is_not_vacuous(tmp_path):
    """The campaign's servers have control routes, enumerated from their own definitions."""
    assert ENGINE in STARTERS  # the lab engine's server, run in process here
    engine, fence = EngineUnderTest(tmp_path / "e", "c" * 43), FenceUnderTest(tmp_path / "f", "c" * 43)
    assert ("POST", "/pause") in engine.control and ("GET", "/is_paused") in engine.reads
    assert ("POST", "/pause") in fence.control and ("POST", "/sleep") in fence.control


@pytest.mark.parametrize("name", sorted(set(STARTERS) | set(IN_CAMPAIGN)))
def test_authz_campaign(name, tmp_path, monkeypatch, log_tap) -> None:
    """Every server: the campaign when it has control routes, else the probe (module docstring)."""
    rng = random.Random(f"{SEED}-authz-{name}")
    cred = _secret(rng)
    (tmp_path / "s").mkdir()
    if name in IN_CAMPAIGN:
        server = (EngineUnderTest if name == ENGINE else FenceUnderTest)(tmp_path / "s", cred)
        counts, violations = asyncio.run(_campaign(server, cred, rng, log_tap))
        assert counts["credentialed"] > 0 and counts["state_changes"] > 0, counts  # the oracle admits some
        label = "lab engine API" if name == ENGINE else "vLLM admission fence"
        extra = {
            "control_routes": [f"{m} {p}" for m, p in server.control],
            "read_routes": [f"{m} {p}" for m, p in server.reads],
        }
    else:
        addr, paths, stop = STARTERS[name](tmp_path / "s", monkeypatch)
        try:
            counts, violations = _probe(addr, cred, rng, list(paths), log_tap)
        finally:
            stop()
        label, extra = "no state-changing route", {"get_paths": list(paths)}
    print(
        "FUZZ "
        + json.dumps(
            {
                "campaign": "authz",
                "server": name,
                "kind": label,
                "seed": SEED,
                "examples": EXAMPLES,
                **extra,
                **counts,
                "log_records": len(log_tap.lines),
                "violations": len(violations),
            }
        )
    )
    assert not violations, json.dumps(violations[:10], default=str)
