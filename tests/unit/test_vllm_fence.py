"""The vLLM admission fence (overlay/fence.py, ``--middleware dsv41.overlay.fence.AdmissionFence``)
driven through httpx's ASGI transport in front of a stand-in for vLLM's app: open pass-through,
a fenced HOLD refusing all but its token's requests (health and metrics always admitted), the HOLD
kept across a new fence instance (restart) in DSV41_ADMISSION_HOLD_FILE, /resume, the drain of
in-flight streaming requests (finished, and outliving timeout_s, counted), a malformed hold file
failing closed with one error line, and plain /pause forwarded to vLLM."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from authutil import OP_HEADERS, OPERATOR, TEST_HOSTS
from dsv41.engine.hold import HoldRecord, read_hold
from dsv41.engine.server_state import ServerState
from dsv41.overlay.fence import AdmissionFence

TOKEN = "20261201T100000-vllmfence"
REQ = {"model": "m", "prompt": "x", "max_tokens": 1}


from fakevllm import FakeVllm  # noqa: E402


def run(coro, timeout_s: float = 20.0):
    """Run one test's coroutine; a fence that lets a blocked stand-in request through fails the
    test after ``timeout_s`` seconds instead of hanging it."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def client(fence) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=fence), base_url="http://rank0", headers=OP_HEADERS)


def fence_for(tmp_path, app=None, dev_routes=True) -> tuple[AdmissionFence, FakeVllm]:
    app = app or FakeVllm()
    return AdmissionFence(
        app,
        hold_file=tmp_path / "run" / "admission-hold",
        dev_routes=dev_routes,
        credential=OPERATOR,
        allowed_hosts=TEST_HOSTS,
    ), app


def test_open_admission_passes_everything_through(tmp_path):
    async def go():
        fence, app = fence_for(tmp_path)
        async with client(fence) as c:
            r = await c.post("/v1/completions", json=REQ)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert (await c.post("/v1/chat/completions", json=REQ)).json() == {"vllm": "/v1/chat/completions"}
            assert (await c.get("/is_paused")).json() == {"vllm": "/is_paused"}  # vLLM's own answer when open
        assert app.served == ["/v1/completions", "/v1/chat/completions", "/is_paused"]
        assert fence.refused_total == 0 and fence.in_flight == 0

    run(go())


def test_a_fenced_hold_admits_only_its_token_health_and_metrics(tmp_path):
    async def go():
        fence, app = fence_for(tmp_path)
        async with client(fence) as c:
            r = await c.post(f"/pause?mode=wait&timeout_s=5&window={TOKEN}")
            assert r.status_code == 200
            assert r.json() == {
                "paused": True,
                "mode": "wait",
                "window": TOKEN,
                "drain": "drained",
                "in_flight_at_pause": 0,
                "aborted": 0,
                "aborted_after_timeout": 0,
                "outlived_drain": 0,
                "still_running": 0,
            }
            assert "/pause" not in app.served  # never forwarded: vLLM's engine keeps running
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/invocations"):
                r = await c.post(path, json=REQ)
                assert r.status_code == 503, path
                assert r.headers["retry-after"] == "10"
                err = r.json()["error"]
                assert err["type"] == "ServiceUnavailableError" and "paused" in err["message"] and err["code"] == 503
            r = await c.post("/v1/completions", json=REQ, headers={"X-DSV41-Window": "another-window"})
            assert r.status_code == 503
            r = await c.post("/v1/completions", json=REQ, headers={"X-DSV41-Window": TOKEN})
            assert r.status_code == 200 and "[DONE]" in r.text
            for path in ("/health", "/metrics", "/v1/models"):
                assert (await c.get(path)).json() == {"vllm": path}
            doc = (await c.get("/is_paused")).json()
            assert doc["is_paused"] is True and doc["paused_since"] == read_hold(fence.hold_file).since
        assert fence.refused_total == 6
        assert app.served.count("/v1/completions") == 1

    run(go())


def test_the_hold_survives_a_restart_and_resume_clears_it(tmp_path):
    async def go():
        first, _ = fence_for(tmp_path)
        async with client(first) as c:
            assert (await c.post(f"/pause?mode=wait&window={TOKEN}")).status_code == 200
        since = read_hold(first.hold_file).since

        restarted, app = fence_for(tmp_path)  # a new API server process reading the same file
        async with client(restarted) as c:
            assert (await c.get("/is_paused")).json() == {"is_paused": True, "paused_since": since}
            assert (await c.post("/v1/completions", json=REQ)).status_code == 503
            assert (await c.post("/v1/completions", json=REQ, headers={"X-DSV41-Window": TOKEN})).status_code == 200
            assert (await c.post("/resume")).json() == {"vllm": "/resume"}  # forwarded: resumes a plain pause too
            assert not restarted.hold_file.exists()
            assert (await c.post("/v1/completions", json=REQ)).status_code == 200
        # the first instance reads the file on each request: it is open too
        async with client(first) as c:
            assert (await c.post("/v1/completions", json=REQ)).status_code == 200

    run(go())


def test_the_lab_engine_reads_the_fences_record_and_vice_versa(tmp_path):
    f = tmp_path / "admission-hold"
    fence = AdmissionFence(FakeVllm(), hold_file=f, dev_routes=False, credential=OPERATOR, allowed_hosts=TEST_HOSTS)

    async def pause():
        async with client(fence) as c:
            assert (await c.post(f"/pause?mode=wait&window={TOKEN}")).status_code == 200

    run(pause())
    st = ServerState(f)
    assert st.paused and st.window_token == TOKEN
    st.hold("other-token")
    assert fence.hold() == HoldRecord(read_hold(f).since, "other-token")


def test_without_dev_routes_the_fence_answers_is_paused_and_resume_itself(tmp_path):
    async def go():
        fence, app = fence_for(tmp_path, dev_routes=False)
        async with client(fence) as c:
            assert (await c.get("/is_paused")).json() == {"is_paused": False, "paused_since": None}
            await c.post(f"/pause?mode=wait&window={TOKEN}")
            assert (await c.get("/is_paused")).json()["is_paused"] is True
            assert (await c.post("/resume")).json() == {"paused": False}
            assert (await c.get("/is_paused")).json()["is_paused"] is False
        assert app.served == []

    run(go())


def test_drain_waits_for_an_in_flight_stream(tmp_path):
    async def go():
        fence, app = fence_for(tmp_path)
        app.block = True
        async with client(fence) as c:
            stream = asyncio.create_task(c.post("/v1/completions", json=REQ))
            await app.started.wait()
            assert fence.in_flight == 1
            pause = asyncio.create_task(c.post(f"/pause?mode=wait&timeout_s=30&window={TOKEN}"))
            await asyncio.sleep(0.2)
            assert not pause.done()  # still draining
            assert fence.hold_file.exists()  # but new requests are refused already
            assert (await c.post("/v1/completions", json=REQ)).status_code == 503
            app.release.set()
            r = await pause
            assert (await stream).status_code == 200
        assert r.json()["in_flight_at_pause"] == 1 and r.json()["outlived_drain"] == 0
        assert fence.drain_outlived_total == 0 and fence.in_flight == 0

    run(go())


def test_a_drain_that_times_out_is_counted_and_the_hold_stays(tmp_path, caplog):
    async def go():
        fence, app = fence_for(tmp_path)
        app.block = True
        async with client(fence) as c:
            stream = asyncio.create_task(c.post("/v1/completions", json=REQ))
            await app.started.wait()
            with caplog.at_level(logging.WARNING, logger="dsv41.overlay.fence"):
                r = await c.post(f"/pause?mode=wait&timeout_s=0.2&window={TOKEN}")
            assert r.status_code == 200
            assert r.json()["paused"] is True and r.json()["outlived_drain"] == 1
            assert fence.in_flight == 1  # the fence cannot abort inside vLLM: it runs on
            app.release.set()
            assert (await stream).status_code == 200
            assert (await c.post("/v1/completions", json=REQ)).status_code == 503
        assert fence.drain_outlived_total == 1
        assert "1 in-flight requests outlived the 0.2 s drain" in caplog.text

    run(go())


@pytest.mark.parametrize("text", ["", "{", "[]", '{"window": "a b", "since": 1}', '{"window": "t"}'])
def test_a_malformed_hold_file_keeps_admission_closed_with_one_error_line(tmp_path, caplog, text):
    async def go():
        fence, app = fence_for(tmp_path)
        fence.hold_file.parent.mkdir(parents=True)
        fence.hold_file.write_text(text)
        with caplog.at_level(logging.INFO, logger="dsv41.overlay.fence"):
            async with client(fence) as c:
                for _ in range(3):
                    assert (await c.post("/v1/completions", json=REQ)).status_code == 503
                r = await c.post("/v1/completions", json=REQ, headers={"X-DSV41-Window": "t"})
                assert r.status_code == 503  # no token is admitted: nobody's record
                assert (await c.get("/health")).status_code == 200
                assert (await c.get("/is_paused")).json() == {"is_paused": True, "paused_since": None}
                errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
                assert len(errors) == 1 and errors[0].exc_info is None
                assert str(fence.hold_file) in errors[0].getMessage()
                assert "admission stays HELD" in errors[0].getMessage()
                assert "\n" not in errors[0].getMessage()
                await c.post("/resume")
                assert (await c.post("/v1/completions", json=REQ)).status_code == 200
        assert app.served.count("/v1/completions") == 1

    run(go())


def test_plain_pause_is_forwarded_and_replaces_the_fenced_record(tmp_path):
    async def go():
        fence, app = fence_for(tmp_path)
        async with client(fence) as c:
            await c.post(f"/pause?mode=wait&window={TOKEN}")
            assert (await c.post("/pause?mode=wait")).json() == {"vllm": "/pause"}
        assert not fence.hold_file.exists() and "/pause" in app.served

    run(go())


@pytest.mark.parametrize(
    "query, param",
    [
        ("mode=abort&window=t", "mode"),
        ("window=t", "mode"),
        ("mode=wait&window=a%20b", "window"),
        ("mode=wait&window=", "window"),
        ("mode=wait&timeout_s=0&window=t", "timeout_s"),
        ("mode=wait&timeout_s=nan&window=t", "timeout_s"),
        ("mode=wait&timeout_s=abc&window=t", "timeout_s"),
    ],
)
def test_bad_fenced_pause_is_400_and_holds_nothing(tmp_path, query, param):
    async def go():
        fence, app = fence_for(tmp_path)
        async with client(fence) as c:
            r = await c.post(f"/pause?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert not fence.hold_file.exists() and app.served == []

    run(go())


def test_an_unwritable_hold_file_is_a_500_saying_nothing_is_held(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")

    async def go():
        fence = AdmissionFence(
            FakeVllm(),
            hold_file=blocker / "admission-hold",
            dev_routes=True,
            credential=OPERATOR,
            allowed_hosts=TEST_HOSTS,
        )
        async with client(fence) as c:
            r = await c.post(f"/pause?mode=wait&window={TOKEN}")
            assert r.status_code == 500 and r.json()["error"]["message"].startswith("admission is NOT held")
            assert (await c.post("/v1/completions", json=REQ)).status_code == 200

    run(go())


def test_the_hold_file_comes_from_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "admission-hold"
    monkeypatch.setenv("DSV41_ADMISSION_HOLD_FILE", str(f))
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    fence = AdmissionFence(FakeVllm(), credential=OPERATOR, allowed_hosts=TEST_HOSTS)
    assert fence.hold_file == f and fence.dev_routes is True
    monkeypatch.setenv("DSV41_ADMISSION_HOLD_FILE", "")
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    bare = AdmissionFence(FakeVllm(), credential=OPERATOR, allowed_hosts=TEST_HOSTS)
    assert bare.hold_file is None and bare.dev_routes is False and not bare.held()
