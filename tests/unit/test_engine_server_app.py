"""The HTTP layer against fake engines, in-process (FastAPI TestClient): error paths that a real
engine cannot be made to hit on demand must still answer in OpenAI's error shape."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from authutil import OP_HEADERS, OPERATOR, TEST_HOSTS  # noqa: E402
from dsv41.authz import OPERATOR_HEADER  # noqa: E402
from dsv41.engine.server import create_app  # noqa: E402
from engineutil import FakeEngine  # noqa: E402


def client(engine):
    return TestClient(
        create_app(engine, "m", 64, operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS),
        raise_server_exceptions=False,
        headers=OP_HEADERS,
    )


def test_unexpected_exception_is_openai_shaped_500():
    r = client(FakeEngine(boom=RuntimeError("bug"))).post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "internal error: RuntimeError: bug",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }


def test_one_failed_request_is_500_and_engine_failure_503():
    c = client(FakeEngine(reason="error"))
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and "not finite" in r.json()["error"]["message"]
    with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as s:
        body = s.read().decode()
    assert '"type": "InternalServerError"' in body and body.rstrip().endswith("data: [DONE]")
    eng = FakeEngine(reason="error")
    c = client(eng)
    eng.fatal = "rank 1 is gone"  # the engine failed after admission
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_framework_validation_errors_are_400_openai_shaped():
    r = client(FakeEngine()).post("/pause?timeout_s=abc")
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.timeout_s"


def test_oversized_body_413_and_long_prompt_refused_before_tokenizing(monkeypatch):
    import dsv41.engine.server as server

    c = client(FakeEngine())
    r = c.post(
        "/v1/completions",
        content=b'{"prompt": "' + b"x" * (server.MAX_BODY_BYTES + 1) + b'"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
    # create_app(..., max_model_len=64): 65 characters or ids can never fit
    seen = []
    monkeypatch.setattr(server.ByteTokenizer, "encode", lambda self, t, bos=False: seen.append(t) or [5])
    for prompt in ("y" * 65, [5] * 65, [[5] * 65]):
        r = client(FakeEngine()).post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and "at most 64 tokens" in r.json()["error"]["message"], r.text
    assert seen == []


# ---------------------------------------------------------------- issue 10: client mistakes are 4xx


def _post(body, path="/v1/completions"):
    import json as _json

    raw = body if isinstance(body, (str, bytes)) else _json.dumps(body)
    return client(FakeEngine()).post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "raw, param",
    [
        ('{"prompt": "x", "seed": ' + "9" * 5000 + "}", "seed"),  # beyond Python's int-parse limit: was a 500
        ('{"prompt": "x", "max_tokens": ' + "1" * 5000 + "}", "max_tokens"),
        ('{"prompt": "x", "n": -' + "1" * 5000 + "}", "n"),
        ('{"prompt": [' + "7" * 5000 + "]}", "prompt"),
        ('{"prompt": "x", "temperature": ' + "3" * 5000 + "}", "temperature"),
        ('{"prompt": "\\ud800x"}', "prompt"),  # a lone surrogate cannot be encoded: was a 500
        ('{"prompt": "x", "model": "\\udfff"}', "model"),
        ('{"prompt": "x", "stream_options": {"\\ud800": 1}}', "stream_options"),
    ],
)
def test_malformed_values_are_400_naming_the_field(raw, param):
    r = _post(raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    "field, value",
    [
        ("logprobs", 0),
        ("logprobs", 1),
        ("logprobs", True),
        ("top_logprobs", 0),
        ("echo", 0),
        ("echo", True),
        ("suffix", ""),
        ("tools", [{"type": "function"}]),
        ("logit_bias", {"5": 1}),
        ("stop", 0),
        ("stop", "x"),
        ("best_of", True),
        ("best_of", 2),
    ],
)
def test_unsupported_features_refused_even_when_falsy(field, value, chat):
    body = {field: value, "max_tokens": 1}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    r = _post(body, "/v1/chat/completions" if chat else "/v1/completions")
    assert r.status_code == 400, (field, value, r.text)
    assert r.json()["error"]["param"] == field


def test_values_that_ask_for_nothing_still_pass():
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "logprobs": False,
        "echo": False,
        "tools": [],
        "logit_bias": {},
        "stop": [],
        "top_logprobs": None,
    }  # best_of: not a chat field (400)
    assert _post(chat, "/v1/chat/completions").status_code == 200
    r = _post({"prompt": "x", "max_tokens": 1, "logprobs": False})  # completions' logprobs is an integer
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_chunked_body_over_the_limit_is_413_without_reading_it_all(monkeypatch):
    """Driven at the ASGI level (TestClient buffers bodies itself): the app must stop asking for
    body chunks once the limit is crossed, on every route that reads a body."""
    import asyncio

    import dsv41.engine.server as server

    monkeypatch.setattr(server, "MAX_BODY_BYTES", 1 << 16)
    app = create_app(FakeEngine(), "m", 64, operator_credential=OPERATOR)

    def run(path, method="POST", headers=()):
        calls, sent = [0], []

        async def receive():
            calls[0] += 1
            return {"type": "http.request", "body": b"x" * 4096, "more_body": calls[0] < 1000}

        async def send(msg):
            sent.append(msg)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"content-type", b"application/json"),
                (b"host", b"127.0.0.1"),
                (OPERATOR_HEADER.encode(), OPERATOR.encode()),
                *headers,
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        asyncio.run(app(scope, receive, send))
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start["status"], dict(start["headers"]), calls[0]

    for path in ("/v1/completions", "/v1/chat/completions", "/pause"):
        status, headers, calls = run(path)
        assert status == 413 and headers[b"connection"] == b"close", path
        assert calls <= 17, (path, calls)  # 64 KiB / 4 KiB + the chunk that crossed it, not 1000 chunks
    status, headers, calls = run("/v1/completions", headers=[(b"content-length", b"999999999")])
    assert status == 413 and calls == 0  # a declared length over the limit: not one byte read


def test_handler_bug_500_says_connection_close():
    r = client(FakeEngine(boom=RuntimeError("bug"))).post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 500 and r.headers["connection"] == "close"
    assert r.json()["error"]["type"] == "InternalServerError"
