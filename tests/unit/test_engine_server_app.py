"""The HTTP layer against fake engines, in-process (FastAPI TestClient): error paths that a real
engine cannot be made to hit on demand must still answer in OpenAI's error shape."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from dsv41.engine.server import create_app  # noqa: E402


class FakeEngine:
    """``submit`` either raises ``boom`` or finishes at once with ``reason`` (engine-thread-like
    sink call); ``fatal`` as the real engine's."""

    def __init__(self, boom: Exception | None = None, reason: str = "length", fatal: str | None = None):
        self.boom, self.reason, self.fatal, self.aborted = boom, reason, fatal, []

    def submit(self, ids, params, sink):
        if self.boom is not None:
            raise self.boom
        sink({"type": "tokens", "ids": [5], "prompt_tokens": len(ids), "completion_tokens": 1})
        ev = {"type": "finish", "reason": self.reason, "prompt_tokens": len(ids), "completion_tokens": 1}
        if self.reason == "error":
            ev["error"] = "request failed: Dsv41Error: sampling distribution is not finite"
        sink(ev)

        class R:
            request_id = "req-x"
        return R()

    def abort(self, rid=None):
        self.aborted.append(rid)

    def idle(self):
        return True


def client(engine):
    return TestClient(create_app(engine, "m", 64), raise_server_exceptions=False)


def test_unexpected_exception_is_openai_shaped_500():
    r = client(FakeEngine(boom=RuntimeError("bug"))).post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal error: RuntimeError: bug", "type": "InternalServerError",
                                 "param": None, "code": 500}


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
    r = c.post("/v1/completions", content=b'{"prompt": "' + b"x" * (server.MAX_BODY_BYTES + 1) + b'"}',
               headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
    # create_app(..., max_model_len=64): 65 characters or ids can never fit
    seen = []
    monkeypatch.setattr(server.ByteTokenizer, "encode", lambda self, t, bos=False: seen.append(t) or [5])
    for prompt in ("y" * 65, [5] * 65, [[5] * 65]):
        r = client(FakeEngine()).post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and "at most 64 tokens" in r.json()["error"]["message"], r.text
    assert seen == []
