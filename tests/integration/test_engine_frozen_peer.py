"""Issue 25 item 2: a TP peer frozen (SIGSTOP) at every point of a rank's life, on live engine
processes on loopback.

The points (docs/engine.md, "Liveness and deadlines"):

- ``rendezvous``: the peer froze before the group formed. Rank 0 serves no HTTP before it has
  joined (requests are refused at once, ``/health`` is never 200) and exits 1 with one line
  within ``--rendezvous-timeout``; rank 1 likewise, or, when rank 0 froze holding the rendezvous
  store, the join watchdog's bound (rendezvous + peer timeout + ``JOIN_GRACE_S``).
- ``joined``: rank 1 froze right after the group formed, before rank 0 serves HTTP (the old
  "first command" that waited for the rendezvous timeout).
- ``healthy-idle``: frozen right after rank 0's ``/health`` first answered 200, before any request.
- ``between-requests``: frozen after a request has completed, before the next.
- ``mid-request``: frozen while a (non-streaming) request runs. (Streams: test_engine_hardening.)

For each: rank 0's ``/health`` turns 503 with the reason within ``DSV41_TP_PEER_TIMEOUT_S`` plus
slack, the request in flight or sent next fails with that reason (never a hang), and the rank
whose peer froze exits 1 with one ``dsv41: error:`` line and no traceback.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from dsv41.engine.tp import JOIN_GRACE_S  # noqa: E402
from engineutil import engine_env, free_ports, lab_assets, serve_cmd, start, stop  # noqa: E402

PEER_TIMEOUT_S = 2.0  # the smallest DSV41_TP_PEER_TIMEOUT_S envs.py accepts
SLACK_S = 4.0  # process scheduling on a loaded 2-core CI box, the 1 s linger, /health polling
RENDEZVOUS_S = 6.0
PEER_LINE = f"the TP peer did not answer within {PEER_TIMEOUT_S:g} s"
POINTS = ["rendezvous", "joined", "healthy-idle", "between-requests", "mid-request"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return lab_assets(tmp_path_factory)


def _env():
    return engine_env(DSV41_TP_PEER_TIMEOUT_S=str(PEER_TIMEOUT_S))


def _cmd(assets, rank, port, master):
    return serve_cmd(
        assets, rank=rank, tp=2, port=port, master=master, extra=["--rendezvous-timeout", str(RENDEZVOUS_S)]
    )


def _health(url):
    """(status code, body) of /health, or (None, exc) when nothing answers."""
    try:
        r = httpx.get(url + "/health", timeout=1)
        return r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
    except httpx.HTTPError as exc:
        return None, exc


def _wait_log(path: Path, text: str, proc, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited rc={proc.returncode}: {path.read_text()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


def _wait_200(url, proc, log: Path, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"rank 0 exited rc={proc.returncode}: {log.read_text()[-2000:]}")
        if _health(url)[0] == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"rank 0 not healthy in {timeout} s: {log.read_text()[-2000:]}")


def _post(url, out: dict, max_tokens: int = 4) -> None:
    t0 = time.monotonic()
    try:
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={"prompt": "The dog ", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
        )
        out["status"], out["body"] = r.status_code, r.json()
    except httpx.HTTPError as exc:
        out["status"], out["body"] = None, exc
    out["took"] = time.monotonic() - t0


def _watch_rank0(url, proc, t0: float, bound: float) -> tuple[float, dict]:
    """Poll /health from ``t0`` until it answers 503 (returns (seconds after t0, body)); fails
    if it still answers 200 past ``bound``, or rank 0 exits without a 503 ever being seen while
    /health was answering 200 (a rank that exits is non-200 too: then (exit time, {}))."""
    while True:
        code, body = _health(url)
        now = time.monotonic() - t0
        if code == 503:
            return now, body
        if code is None and proc.poll() is not None:
            return now, {}
        assert now <= bound, f"/health still {code} {body} {now:.1f} s after the freeze"
        time.sleep(0.05)


def _assert_exit_line(proc, log: Path, line: str, within: float) -> None:
    try:
        rc = proc.wait(within)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: report the log
        raise AssertionError(f"still running {within} s later: {log.read_text()[-2000:]}") from None
    text = log.read_text(errors="replace")
    assert rc == 1, text[-2000:]
    assert f"dsv41: error: {line}" in text or ("dsv41: error: " in text and line in text), text[-2000:]
    assert "Traceback" not in text, text[-3000:]


def _cleanup(*procs):
    for p in procs:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGCONT)
    for p in procs:
        if p is not None:
            stop(p, signal.SIGKILL)


@pytest.mark.parametrize("frozen", ["r1", pytest.param("r0", marks=pytest.mark.lab_long)])
def test_frozen_at_rendezvous(assets, tmp_path, frozen):
    """The peer froze before the group formed: no rank ever serves, each exits 1 within the
    rendezvous timeout with one line."""
    port, mport = free_ports(2)
    master, url = f"127.0.0.1:{mport}", f"http://127.0.0.1:{port}"
    r0 = r1 = None
    try:
        if frozen == "r1":
            r1 = start(_cmd(assets, 1, 0, master), _env(), tmp_path / "rank1.log")
            _wait_log(tmp_path / "rank1.log", "joining the TP2 group", r1)
            r1.send_signal(signal.SIGSTOP)
            r0 = start(_cmd(assets, 0, port, master), _env(), tmp_path / "rank0.log")
            _wait_log(tmp_path / "rank0.log", "joining the TP2 group", r0)
            t0 = time.monotonic()
            while r0.poll() is None and time.monotonic() - t0 < RENDEZVOUS_S + SLACK_S + 5:
                assert _health(url)[0] is None, "rank 0 serves HTTP before the group formed"
                out: dict = {}
                _post(url, out)
                assert out["status"] is None and out["took"] < 2, out  # refused at once, no hang
                time.sleep(0.2)
            _assert_exit_line(r0, tmp_path / "rank0.log", "rank 0: cannot join the TP group", 1)
            assert time.monotonic() - t0 <= RENDEZVOUS_S + PEER_TIMEOUT_S + JOIN_GRACE_S + SLACK_S
        else:
            r0 = start(_cmd(assets, 0, port, master), _env(), tmp_path / "rank0.log")
            _wait_log(tmp_path / "rank0.log", "joining the TP2 group", r0)
            r0.send_signal(signal.SIGSTOP)
            r1 = start(_cmd(assets, 1, 0, master), _env(), tmp_path / "rank1.log")
            _wait_log(tmp_path / "rank1.log", "joining the TP2 group", r1)
            t0 = time.monotonic()
            # rank 0 froze holding the rendezvous store: the join watchdog ends rank 1
            _assert_exit_line(
                r1,
                tmp_path / "rank1.log",
                "rank 1: cannot join the TP group",
                RENDEZVOUS_S + PEER_TIMEOUT_S + JOIN_GRACE_S + SLACK_S,
            )
            assert _health(url)[0] is None
    finally:
        _cleanup(r0, r1)


# make test runs the reported point (healthy-idle) for both ranks and the new "joined" point;
# the rest of the matrix (each ~20-40 s of pair start-up on a shared 2-core box) runs in make
# lab-long. Rank 0 frozen between or during requests is the same wait for rank 1 as
# healthy-idle (its next command); a rank 0 frozen mid-stream: test_engine_hardening.
LONG = pytest.mark.lab_long
AFTER_JOIN = [
    ("r1", "joined"),
    ("r1", "healthy-idle"),
    ("r0", "healthy-idle"),
    pytest.param("r1", "between-requests", marks=LONG),
    pytest.param("r1", "mid-request", marks=LONG),
    pytest.param("r0", "joined", marks=LONG),
]


@pytest.mark.parametrize("frozen,point", AFTER_JOIN)
def test_frozen_after_the_group_formed(assets, tmp_path, point, frozen):
    """From the moment the group formed, a frozen peer is noticed within the peer timeout."""
    port, mport = free_ports(2)
    master, url = f"127.0.0.1:{mport}", f"http://127.0.0.1:{port}"
    log0, log1 = tmp_path / "rank0.log", tmp_path / "rank1.log"
    r1 = start(_cmd(assets, 1, 0, master), _env(), log1)
    r0 = None
    inflight: dict = {}
    th = None
    try:
        time.sleep(0.5)
        r0 = start(_cmd(assets, 0, port, master), _env(), log0)
        if point == "joined":
            _wait_log(log1, "rank 1 ready", r1)  # rank 1 has joined; rank 0 is still starting HTTP
        else:
            _wait_200(url, r0, log0)
        if point == "between-requests":
            first: dict = {}
            _post(url, first)
            assert first["status"] == 200, first
        if point == "mid-request":
            th = threading.Thread(target=_post, args=(url, inflight, 4000), daemon=True)
            th.start()
            time.sleep(0.5)
            assert th.is_alive(), inflight
        victim = r1 if frozen == "r1" else r0
        victim.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        bound = PEER_TIMEOUT_S + SLACK_S
        if frozen == "r0":
            _assert_exit_line(r1, log1, f"rank 1: {PEER_LINE}", bound)
            assert time.monotonic() - t0 <= bound
            return
        if point != "mid-request" and point != "joined":
            th = threading.Thread(target=_post, args=(url, inflight), daemon=True)
            th.start()
        took, body = _watch_rank0(url, r0, t0, bound)
        if body:
            assert body["status"] == "failed" and PEER_LINE in body["error"], body
        assert took <= bound, took
        if th is not None:
            th.join(bound)
            assert not th.is_alive(), "the request hangs"
            if inflight["status"] is not None:  # None: rank 0 had already closed its port
                assert inflight["status"] == 503, inflight
                assert PEER_LINE in inflight["body"]["error"]["message"], inflight
        _assert_exit_line(r0, log0, f"rank 0: {PEER_LINE}", SLACK_S)
        r1.send_signal(signal.SIGCONT)  # it follows: its peer is gone
        assert r1.wait(30) == 1
    finally:
        _cleanup(r0, r1)
        if th is not None:
            th.join(10)
