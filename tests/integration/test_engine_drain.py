"""Issue 25 item 1 on the real lab engine process (TP1): the field report's sequence (a
``/pause?mode=wait`` whose deadline passes after a ``/resume`` must not abort the requests
admitted after the resume), and SIGTERM in the held states (``keep``-frozen with a request in
flight, a pending ``wait`` drain) ending within ``DSV41_ENGINE_DRAIN_TIMEOUT_S`` plus the abort
settle time, exit 0. The full state space is tests/unit/test_pause_state_machine.py."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from labutil import post as lab_post  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from engineutil import engine_env, free_port, lab_assets, serve_cmd, start, stop, wait_ready  # noqa: E402

DRAIN_S = 2.0
SETTLE_S = 5.0  # server.ABORT_SETTLE_S
LONG = {"prompt": "The dog ", "max_tokens": 600, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return lab_assets(tmp_path_factory)


@pytest.fixture()
def engine(assets, tmp_path):
    port = free_port()
    log = tmp_path / "rank0.log"
    proc = start(
        serve_cmd(assets, port=port, extra=["--kv-cache-tokens", "2048", "--max-step-tokens", "128"]),
        engine_env(DSV41_ENGINE_DRAIN_TIMEOUT_S=str(DRAIN_S)),
        log,
    )
    try:
        wait_ready(port, proc, log)
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log}
    finally:
        stop(proc, signal.SIGKILL)


def _bg(url: str, path: str, out: dict, key: str, **kw) -> threading.Thread:
    def run():
        out[key] = lab_post(url + path, timeout=120, **kw)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _until(pred, what: str, limit_s: float = 30.0) -> None:
    end = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_a_resume_cancels_the_pending_drain_and_later_requests_live(engine):
    url, out = engine["url"], {}
    t_old = _bg(url, "/v1/completions", out, "old", json=LONG)
    _until(lambda: _running(url) >= 1, "the first request never ran")
    t_pause = _bg(url, "/pause?mode=wait&timeout_s=2", out, "pause")
    time.sleep(0.3)
    assert lab_post(url + "/resume", timeout=10).json() == {"paused": False}
    t_pause.join(10)
    assert out["pause"].json() == {
        "paused": False,
        "mode": "wait",
        "drain": "resumed",
        "in_flight_at_pause": 1,
        "aborted": 0,
        "aborted_after_timeout": 0,
        "still_running": 1,
    }
    t_new = _bg(url, "/v1/completions", out, "new", json=LONG)
    time.sleep(2.5)  # past the first pause's deadline
    for t in (t_old, t_new):
        t.join(120)
    for key in ("old", "new"):  # nothing admitted before or after the resume was aborted
        choice = out[key].json()["choices"][0]
        assert choice["finish_reason"] == "length" and out[key].json()["usage"]["completion_tokens"] == 600
    # a drain that times out aborts its own scope only, counted exactly
    t_old = _bg(url, "/v1/completions", out, "old", json=LONG)
    _until(lambda: _running(url) >= 1, "the request never ran")
    r = lab_post(url + "/pause?mode=wait&timeout_s=0.2", timeout=30).json()
    assert r["drain"] == "timed_out" and r["aborted_after_timeout"] == r["aborted"] == 1 and r["still_running"] == 0
    t_old.join(30)
    assert out["old"].json()["choices"][0]["finish_reason"] == "abort"
    lab_post(url + "/resume", timeout=10)


@pytest.mark.parametrize("held", ["keep", "wait"])
def test_sigterm_in_a_held_state_ends_within_the_drain_timeout(engine, held):
    url, out, proc = engine["url"], {}, engine["proc"]
    t_req = _bg(url, "/v1/completions", out, "req", json=LONG | {"max_tokens": 2000})
    _until(lambda: _running(url) >= 1, "the request never ran")
    t_pause = _bg(url, f"/pause?mode={held}&timeout_s=600", out, "pause")
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(DRAIN_S + SETTLE_S + 10)
    took = time.monotonic() - t0
    t_req.join(10)
    t_pause.join(10)
    assert rc == 0, engine["log"].read_text()[-3000:]
    assert took <= DRAIN_S + SETTLE_S, took
    assert out["req"].json()["choices"][0]["finish_reason"] == "abort"
    if held == "wait":
        assert out["pause"].json()["drain"] == "shutdown"
    assert "shutdown drain: {'in_flight': 1, 'aborted': 1, 'still_running': 0" in engine["log"].read_text()
