"""Every HTTP server dsv41 runs, every GET endpoint of each: query strings are ignored, ``HEAD``
answers as ``GET`` without a body, an unknown path is a 404 in OpenAI's error shape, and idle
connections from one client (more than the whole connection cap) never keep ``/health``,
``/ready`` or ``/metrics`` from answering, for another client or for the same one.

The servers are enumerated from the code: :data:`STARTERS` must name every module of
``python/dsv41`` that builds an HTTP server (``BoundedHTTPServer``, ``serve_metrics``,
``uvicorn.Config``, ``start_http_server``), and each server's GET endpoints come from its own
definitions (the FastAPI routes; ``GET_PATHS`` of an ``http.server`` handler). Loopback only.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi")


from httpserverutil import CAP, LIMITS, ROOT, STARTERS, _start_engine  # noqa: E402

#: modules that build or wrap servers without being one a process starts by itself
NOT_SERVERS = {
    "dsv41/httpd.py": "the servers' building blocks, started through the modules above",
    "dsv41/overlay/plugin.py": "starts dsv41/overlay/metrics.py's endpoint in vLLM's worker",
}

_BUILDS = re.compile(r"BoundedHTTPServer\(|serve_metrics\(|uvicorn\.Config\(|start_http_server\(|HTTPServer\(")


def test_every_module_that_builds_an_http_server_is_started_here() -> None:
    found = set()
    for f in (ROOT / "python" / "dsv41").rglob("*.py"):
        code = "\n".join(ln for ln in f.read_text().splitlines() if not ln.lstrip().startswith("#"))
        if _BUILDS.search(code.replace('"""', "")):
            found.add(str(f.relative_to(ROOT / "python")))
    assert found - set(NOT_SERVERS) == set(STARTERS), "a new HTTP server must be added to STARTERS"


@pytest.fixture(params=sorted(STARTERS))
def server(request, tmp_path, monkeypatch):
    for k, v in LIMITS.items():
        monkeypatch.setenv(k, v)
    addr, paths, stop = STARTERS[request.param](tmp_path, monkeypatch)
    assert paths, f"{request.param}: no GET endpoint found"
    yield request.param, addr, paths
    stop()


def _get(addr, path, method="GET", source="127.0.0.1"):
    """One request on a fresh connection from ``source`` (a loopback address): (status, headers, body)."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10) as c:
        r = c.request(method, f"http://{addr[0]}:{addr[1]}{path}")
        return r.status_code, r.headers, r.content


def _error_shape(body: bytes) -> dict:
    doc = json.loads(body)
    assert set(doc) == {"error"} and {"message", "type", "code"} <= set(doc["error"]), doc
    return doc["error"]


def test_query_strings_and_head_on_every_get_endpoint(server) -> None:
    name, addr, paths = server
    for path in paths:
        plain = _get(addr, path)[0]
        assert plain in (200, 503), f"{name} GET {path}: {plain}"
        assert _get(addr, path + "?x=1&y=%20")[0] == plain, f"{name} GET {path}?x=1"
        code, headers, body = _get(addr, path + "?x=1", "HEAD")
        assert code == plain and body == b"", f"{name} HEAD {path}: {code} {body[:80]!r}"


def test_unknown_path_is_a_404_in_the_openai_error_shape(server) -> None:
    name, addr, paths = server
    code, _h, body = _get(addr, "/no-such-endpoint?x=1")
    if name in ("dsv41/drafter/worker.py", "dsv41/monitoring/exporter.py"):
        assert code in (200, 404)  # prometheus_client's handler serves its registry on any path
        return
    assert code == 404 and _error_shape(body)["code"] == 404, (name, code, body)


def test_idle_connections_past_the_cap_never_silence_health(server) -> None:
    name, addr, paths = server
    idle = [socket.create_connection(addr, timeout=5) for _ in range(CAP + 4)]
    try:
        time.sleep(0.7)  # past httpd.MIN_IDLE_AGE_S
        for source in ("127.0.0.2", "127.0.0.1"):  # another client, and the one holding them all
            for path in paths:
                code, _h, _b = _get(addr, path + "?x=1", source=source)
                assert code in (200, 503) and (code == 200 or path == "/ready"), (name, source, path, code)
    finally:
        for s in idle:
            s.close()


def test_engine_routing_errors_are_in_the_openai_error_shape(monkeypatch) -> None:
    for k, v in LIMITS.items():
        monkeypatch.setenv(k, v)
    addr, _paths, stop = _start_engine(None)
    try:
        code, headers, body = _get(addr, "/v1/completions")  # a POST route: 405
        assert code == 405 and _error_shape(body)["type"] == "MethodNotAllowedError" and "POST" in headers["allow"]
        code, _h, body = _get(addr, "/v1/nothing")
        assert code == 404 and _error_shape(body)["type"] == "NotFoundError"
    finally:
        stop()
