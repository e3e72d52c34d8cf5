"""Who may change a serving endpoint (dsv41.authz): every state-changing route of every server
that takes admission commands (the lab engine's app, enumerated from its routes; the vLLM fence,
from its control routes and vLLM's dev routes) refuses anonymous, wrong-credential and
browser-shaped (foreign Origin/Host, Sec-Fetch-Site, text/plain or form bodies) requests; the
OpenAI API takes vLLM's Bearer API key; tokens never reach a log; every project client can send
the credentials."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from authutil import OP_HEADERS, OPERATOR, TEST_HOSTS, engine_control_routes, fence_control_paths  # noqa: E402
from dsv41 import authz  # noqa: E402
from dsv41.engine.server import create_app  # noqa: E402
from dsv41.overlay.fence import AdmissionFence  # noqa: E402
from engineutil import FakeEngine  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: Each hostile shape: (extra headers, body, content type, wanted status).
HOSTILE = {
    "anonymous": ({}, None, None, 401),
    "wrong credential": ({authz.OPERATOR_HEADER: "x" * 40}, None, None, 401),
    "two credentials": ({}, None, None, 401),
    "foreign Origin": ({**OP_HEADERS, "origin": "http://evil.example"}, None, None, 403),
    "null Origin": ({**OP_HEADERS, "origin": "null"}, None, None, 403),
    "cross-site fetch": ({**OP_HEADERS, "sec-fetch-site": "cross-site"}, None, None, 403),
    "text/plain body": (OP_HEADERS, b'{"mode": "wait"}', "text/plain", 403),
    "form body": (OP_HEADERS, b"mode=wait", "application/x-www-form-urlencoded", 403),
    "untyped body": (OP_HEADERS, b'{"mode": "wait"}', "", 403),
}


def _send(c, method, path, shape, host=None):
    headers, body, ctype, _ = HOSTILE[shape]
    h = dict(headers)
    if ctype is not None:
        h["content-type"] = ctype
    if host:
        h["host"] = host
    if shape == "two credentials":
        return c.request(
            method, path, headers=[(authz.OPERATOR_HEADER, OPERATOR), (authz.OPERATOR_HEADER, "y" * 40)], content=body
        )
    return c.request(method, path, headers=h, content=body)


def test_the_engine_has_control_routes_and_is_not_vacuous():
    routes = engine_control_routes(create_app(FakeEngine(), "m", 64))
    assert ("POST", "/pause") in routes and ("POST", "/resume") in routes


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_every_engine_control_route_refuses_every_hostile_shape(shape):
    eng = FakeEngine()
    app = create_app(eng, "m", 64, operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS)
    c = TestClient(app, raise_server_exceptions=False)
    for method, path in engine_control_routes(app):
        r = _send(c, method, path, shape)
        assert r.status_code == HOSTILE[shape][3], (method, path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert c.get("/is_paused").json()["is_paused"] is False  # nothing was held


def test_foreign_host_and_a_server_without_credential_refuse():
    app = create_app(FakeEngine(), "m", 64, operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS)
    c = TestClient(app, raise_server_exceptions=False, headers=OP_HEADERS)
    for method, path in engine_control_routes(app):
        assert c.request(method, path, headers={"host": "attacker.example"}).status_code == 403  # DNS rebinding
        assert c.request(method, path, headers={"host": "127.0.0.1:8000"}).status_code not in (401, 403)
    closed = TestClient(create_app(FakeEngine(), "m", 64), raise_server_exceptions=False, headers=OP_HEADERS)
    for method, path in engine_control_routes(app):
        assert closed.request(method, path).status_code == 403
    assert closed.get("/health").status_code == 200 and closed.get("/is_paused").status_code == 200


def test_the_credential_admits_and_reads_stay_open():
    app = create_app(FakeEngine(), "m", 64, operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS)
    c = TestClient(app, raise_server_exceptions=False)
    assert c.post("/pause?mode=keep", headers={**OP_HEADERS, "origin": "http://testserver"}).status_code == 200
    assert c.get("/is_paused").json()["is_paused"] is True
    assert c.post("/resume", headers=OP_HEADERS, json={}).status_code == 200
    for path in ("/health", "/v1/models", "/is_paused"):
        assert c.get(path).status_code == 200, path


def _fence(tmp_path):
    from fakevllm import FakeVllm

    vllm = FakeVllm()
    return AdmissionFence(
        vllm, hold_file=tmp_path / "hold", dev_routes=True, credential=OPERATOR, allowed_hosts=TEST_HOSTS
    ), vllm


def _send_async(c, method, path, shape):
    headers, body, ctype, _ = HOSTILE[shape]
    h = dict(headers)
    if ctype is not None:
        h["content-type"] = ctype
    if shape == "two credentials":
        h = [(authz.OPERATOR_HEADER, OPERATOR), (authz.OPERATOR_HEADER, "y" * 40)]
    return c.request(method, path, headers=h, content=body)


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_every_fence_control_route_refuses_and_forwards_nothing(tmp_path, shape):
    fence, vllm = _fence(tmp_path)
    paths = fence_control_paths()
    assert {"/pause", "/resume"} <= set(paths)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fence), base_url="http://rank0") as c:
            for p in paths:
                for q in ("", "?mode=wait&window=tok"):
                    r = await _send_async(c, "POST", p + q, shape)
                    assert r.status_code == HOSTILE[shape][3], (p + q, r.text)
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            r = await c.post("/pause?mode=wait&window=tok", headers={"host": "attacker.example", **OP_HEADERS})
            assert r.status_code == 403

    asyncio.run(go())
    assert vllm.served == [] and not (tmp_path / "hold").exists()
    assert fence.refused_total == len(paths) * 2 + 1


def test_the_fence_admits_the_operator_and_without_credential_refuses_all(tmp_path, monkeypatch):
    fence, vllm = _fence(tmp_path)

    async def go(f):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=f), base_url="http://rank0", headers=OP_HEADERS
        ) as c:
            return [(await c.post("/pause?mode=wait&window=tok")).status_code, (await c.post("/resume")).status_code]

    assert asyncio.run(go(fence)) == [200, 200]
    monkeypatch.delenv("DSV41_OPERATOR_CREDENTIAL_FILE", raising=False)
    bare = AdmissionFence(vllm, hold_file=tmp_path / "hold2", dev_routes=True, allowed_hosts=TEST_HOSTS)
    assert bare.credential is None and asyncio.run(go(bare)) == [403, 403]


def test_api_key_in_vllms_convention():
    c = TestClient(
        create_app(FakeEngine(), "m", 64, operator_credential=OPERATOR, api_key="k" * 32, allowed_hosts=TEST_HOSTS),
        raise_server_exceptions=False,
    )
    body = {"prompt": "x", "max_tokens": 1}
    assert c.post("/v1/completions", json=body).status_code == 401
    assert c.get("/v1/models").status_code == 401
    assert c.post("/v1/completions", json=body, headers={"authorization": "Bearer " + "j" * 32}).status_code == 401
    assert c.get("/v1/models", headers={"authorization": "Bearer " + "k" * 32}).status_code == 200
    assert c.get("/health").status_code == 200  # only /v1 routes, as vLLM
    assert c.options("/v1/models").status_code != 401


def test_tokens_are_never_logged(tmp_path, caplog):
    from dsv41.engine.hold import HoldRecord, write_hold
    from dsv41.engine.server_state import ServerState

    secret = authz.new_secret()
    write_hold(tmp_path / "hold", HoldRecord(1.0, secret))
    caplog.set_level(logging.DEBUG)
    assert ServerState(tmp_path / "hold").window_token == secret  # the engine restarts held
    fence, _ = _fence(tmp_path)  # the fence restarts held (same file name)

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=fence), base_url="http://rank0", headers=OP_HEADERS
        ) as c:
            assert (await c.post(f"/pause?mode=wait&window={secret}")).status_code == 200

    asyncio.run(go())
    # (the test's own httpx client logs its URLs; harness.http keeps httpx's logger at WARNING)
    assert caplog.records and not any(secret in r.getMessage() for r in caplog.records if r.name != "httpx")
    from dsv41.harness import http  # noqa: F401

    assert logging.getLogger("httpx").getEffectiveLevel() >= logging.WARNING


def test_secret_files_and_client_headers(tmp_path, monkeypatch):
    from dsv41.harness import http

    f = tmp_path / "cred"
    authz.write_secret(f, OPERATOR)
    assert oct(f.stat().st_mode & 0o777) == "0o600" and authz.load_secret(f) == OPERATOR
    monkeypatch.setenv("DSV41_OPERATOR_CREDENTIAL_FILE", str(f))
    monkeypatch.delenv("DSV41_API_KEY_FILE", raising=False)
    assert http.auth_headers(True) == {"X-DSV41-Operator": OPERATOR} and http.auth_headers(False) == {}
    k = tmp_path / "key"
    authz.write_secret(k, "k" * 32)
    monkeypatch.setenv("DSV41_API_KEY_FILE", str(k))
    assert http.auth_headers(False) == {"Authorization": "Bearer " + "k" * 32}
    os.chmod(f, 0o644)
    with pytest.raises(http.HttpError) as err:
        http.auth_headers(True, what="HOLD")
    assert "mode 0644" in str(err.value) and OPERATOR not in str(err.value) and "\n" not in str(err.value)
    assert len({authz.new_secret() for _ in range(100)}) == 100 and len(authz.new_secret()) >= 43


def test_every_project_client_sends_the_credentials():
    """Every httpx client the package builds carries auth_headers (or goes through
    harness.http.request, which does): found by scanning the sources, not listed by hand."""
    missing = []
    for path in sorted((REPO / "python" / "dsv41").rglob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"httpx\.(Client|AsyncClient)\(", text):
            call = text[max(0, m.start() - 600) : m.start() + 400]
            if "auth_headers" not in call and "transport=" not in call:
                missing.append(f"{path.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}")
    assert missing == []


def test_the_admission_client_sends_the_operator_credential(tmp_path, monkeypatch):
    """harness.admission against the real app (httpx's ASGI transport under the harness client):
    a HOLD with the credential file set is accepted; without it the engine refuses it (401)."""
    from dsv41.harness import admission

    app = create_app(FakeEngine(), "m", 64, operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS)
    tc = TestClient(app, raise_server_exceptions=False)

    def handler(request: httpx.Request) -> httpx.Response:
        r = tc.request(request.method, str(request.url), headers=dict(request.headers), content=request.content)
        return httpx.Response(r.status_code, headers=dict(r.headers), content=r.content)

    real = httpx.Client
    # the harness's own client code, its requests answered by the app in process
    monkeypatch.setattr(httpx, "Client", lambda *a, **kw: real(*a, transport=httpx.MockTransport(handler), **kw))
    f = tmp_path / "cred"
    authz.write_secret(f, OPERATOR)
    monkeypatch.delenv("DSV41_API_KEY_FILE", raising=False)
    monkeypatch.delenv("DSV41_OPERATOR_CREDENTIAL_FILE", raising=False)
    with pytest.raises(admission.AdmissionError) as err:
        admission.set_state("http://testserver", admission.HELD, settle_s=1)
    assert "401" in str(err.value)
    monkeypatch.setenv("DSV41_OPERATOR_CREDENTIAL_FILE", str(f))
    assert admission.set_state("http://testserver", admission.HELD, settle_s=2) == admission.OPEN
    assert admission.set_state("http://testserver", admission.OPEN, settle_s=2) == admission.HELD


def test_the_fence_redacts_the_token_from_the_access_logs_view(tmp_path):
    """uvicorn's access log (vLLM's, on by default) prints the scope's query string after the
    app answered: the fence leaves the token out of it."""
    fence, _ = _fence(tmp_path)
    secret = authz.new_secret()
    seen = []

    async def app(scope, receive, send):
        await fence(scope, receive, send)
        seen.append(scope["query_string"])

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://rank0", headers=OP_HEADERS
        ) as c:
            assert (await c.post(f"/pause?mode=wait&window={secret}")).status_code == 200

    asyncio.run(go())
    assert seen and secret.encode() not in seen[0] and b"window=REDACTED" in seen[0]


@pytest.mark.parametrize(
    "path", ["/v1/../pause", "/v1/%2e%2e/pause", "/v1/%2E%2E/resume", "/v1/./models/../../sleep", "/v1/.", "/v1/.."]
)
def test_a_dot_segment_is_never_inference(path):
    """The fence forwards inference without the credential: a path something behind it could
    collapse onto a control route (``/v1/../pause``) is control, so it needs the credential."""
    assert not authz.is_inference(path)
    assert authz.is_control("POST", path)
    assert authz.is_inference("/v1/completions") and authz.is_inference("/v1/models")
