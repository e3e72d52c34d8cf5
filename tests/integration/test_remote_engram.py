"""Remote Engram end to end: ``dsv41 engram serve`` as its own process (TCP + NIXL over UCX TCP),
read-rows and sweeps through the CLI, refusals, concurrency, server killed mid-sweep and
restarted, SIGTERM drain."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dsv41.cli import main
from dsv41.engram.client import RemoteRowSource
from dsv41.engram.manifest import load_manifest
from dsv41.engram.reader import LocalRowReader
from dsv41.engram.synthetic import write_synthetic_tables
from dsv41.transport import Refused, open_client, protocol as P

ENV = {**os.environ, "UCX_TLS": "tcp", "OMP_NUM_THREADS": "1"}
os.environ.setdefault("UCX_TLS", "tcp")


def small_cfg(vocab):
    cfg = json.load(open(Path(__file__).resolve().parents[2] / "python/dsv41/data/lab_model.json"))
    cfg["engram_vocab_size"] = vocab
    return cfg


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    """``python -m dsv41.engram.remote_cli serve`` in its own process group."""

    def __init__(self, manifest: Path, listens: list[str], tmp: Path, metrics=True):
        self.ready = tmp / f"ready-{time.monotonic_ns()}.json"
        cmd = [
            sys.executable,
            "-m",
            "dsv41.engram.remote_cli",
            "serve",
            "--manifest",
            str(manifest),
            "--ready-file",
            str(self.ready),
        ]
        for u in listens:
            cmd += ["--listen", u]
        if metrics:
            cmd += ["--metrics", "127.0.0.1:0"]
        self.log = open(tmp / f"serve-{time.monotonic_ns()}.log", "w+")
        self.proc = subprocess.Popen(cmd, env=ENV, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"server did not start: {self.log.read()}")
            time.sleep(0.05)
        self.info = json.loads(self.ready.read_text())
        self.urls = self.info["listen"]

    def stop(self, sig=signal.SIGTERM, timeout=20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()


@pytest.fixture(scope="module")
def tabs(tmp_path_factory):
    d = tmp_path_factory.mktemp("remote")
    write_synthetic_tables(small_cfg(1000), d / "a", seed=1)
    write_synthetic_tables(small_cfg(1000), d / "b", seed=2)  # same shape, other identity
    return d


@pytest.fixture(scope="module")
def server(tabs):
    s = Server(tabs / "a" / "manifest.json", ["tcp://127.0.0.1:0", "nixl://127.0.0.1:0"], tabs)
    yield s
    assert s.stop() == 0


def run_cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_read_rows_byte_identical(server, tabs, capsys):
    man = str(tabs / "a" / "manifest.json")
    m = load_manifest(man)
    rows = f"0,1,77,4095,4096,{m.table(1).rows - 1},{m.table(1).rows // 2}"
    outs = {}
    for src in ["local"] + server.urls:
        rc, out, err = run_cli(
            capsys, "engram", "read-rows", "--manifest", man, "--layer", "1", "--rows", rows, "--source", src
        )
        assert rc == 0, err
        outs[src] = out
    assert len(set(outs.values())) == 1 and len(outs["local"].split()) == 7


def test_sweeps_both_ranks_both_backends(server, tabs, capsys):
    man = str(tabs / "a" / "manifest.json")
    for url in server.urls:
        for rank in (0, 1):
            rc, out, err = run_cli(
                capsys,
                "engram",
                "sweep",
                "--manifest",
                man,
                "--remote",
                url,
                "--tp",
                "2",
                "--rank",
                str(rank),
                "--lookups",
                "12000",
                "--seed",
                str(rank),
            )
            assert rc == 0, err
            rep = json.loads(out)
            assert rep["lookups"] == 12000 and rep["bad_rows"] == 0
            assert rep["fallbacks"] == 0 and rep["refusals"] == 0 and rep["remote_rows"] == 12000
            assert rep["columns"] == ([0, 12] if rank == 0 else [12, 24])


def test_wrong_identity_and_out_of_range_refused(server, tabs, capsys):
    other = str(tabs / "b" / "manifest.json")
    for url in server.urls:
        rc, out, err = run_cli(
            capsys, "engram", "read-rows", "--manifest", other, "--layer", "1", "--rows", "1", "--source", url
        )
        assert rc == 1 and ("wrong_identity" in err or "does not serve" in err)
        assert err.startswith("dsv41: error:") and err.count("\n") == 1
    m = load_manifest(tabs / "a" / "manifest.json")
    ident = P.identity_bytes(m.table(2).identity)
    for url in server.urls:
        c = open_client(url, [ident])
        out = np.zeros((1, 264), np.uint8)
        with pytest.raises(Refused) as ei:
            c.lookup_into(ident, np.array([m.table(2).rows], np.uint64), [out], 2.0)
        assert ei.value.reason == "out_of_range" and not out.any()
        c.close()
    rc, out, err = run_cli(
        capsys,
        "engram",
        "read-rows",
        "--manifest",
        str(tabs / "a" / "manifest.json"),
        "--layer",
        "2",
        "--rows",
        str(m.table(2).rows),
        "--source",
        server.urls[0],
    )
    assert rc == 1 and "outside" in err


def test_two_ranks_and_extra_clients_concurrently(server, tabs):
    m = load_manifest(tabs / "a" / "manifest.json")
    ref = LocalRowReader(m, tabs / "a", threads=2)
    tcp, nixl = server.urls
    errors: list[str] = []
    counts = []

    def rank_worker(rank, url):
        src = RemoteRowSource([url, url], m, rank, 2, timeout_ms=2000)
        rng = np.random.default_rng(rank)
        try:
            for i in range(40):
                L = (1, 2)[i % 2]
                rows = rng.integers(0, m.table(L).rows, 24 if i % 5 else 3000)
                if not np.array_equal(src.lookup(L, rows), ref.read(L, rows)):
                    errors.append(f"rank {rank} lookup {i} differs")
            counts.append(src.counters())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))
        finally:
            src.close()

    def extra_client(k):
        ident = P.identity_bytes(m.table(1).identity)
        c = open_client(tcp, [ident])
        rng = np.random.default_rng(100 + k)
        try:
            for _ in range(60):
                rows = rng.integers(0, m.table(1).rows, 96)
                out = np.empty((96, 264), np.uint8)
                c.lookup_into(ident, rows.astype(np.uint64), [out], 2.0)
                if not np.array_equal(out, ref.read(1, rows)):
                    errors.append(f"extra client {k} differs")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
        finally:
            c.close()

    threads = [
        threading.Thread(target=rank_worker, args=(0, tcp)),
        threading.Thread(target=rank_worker, args=(1, nixl)),
    ]
    threads += [threading.Thread(target=extra_client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ref.close()
    assert not errors, errors[:3]
    assert len(counts) == 2 and all(c["fallbacks"] == 0 and c["lookups"] == 40 for c in counts)


def test_metrics_endpoint(server):
    import urllib.request

    base = f"http://{server.info['metrics']}"
    assert urllib.request.urlopen(base + "/ready", timeout=5).status == 200
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    for name in (
        "dsv41_engram_rows_served_total",
        "dsv41_engram_requests_total",
        "dsv41_engram_load_bytes",
        "dsv41_engram_request_seconds_bucket",
        "dsv41_engram_refusals_total",
        "dsv41_engram_ready 1.0",
    ):
        assert name in text


@pytest.mark.parametrize("scheme", ["tcp", "nixl"])
def test_server_killed_mid_sweep_then_restarted(tabs, scheme):
    man = tabs / "a" / "manifest.json"
    m = load_manifest(man)
    port = free_port()
    url = f"{scheme}://127.0.0.1:{port}"
    srv = Server(man, [url], tabs, metrics=False)
    ref = LocalRowReader(m, tabs / "a", threads=2)
    timeout_ms = 100
    src = RemoteRowSource(url, m, 0, 1, timeout_ms=timeout_ms, local=LocalRowReader(m, tabs / "a", threads=2))
    rng = np.random.default_rng(7)
    bad = 0
    worst_outage = 0.0

    def step():
        nonlocal bad
        L = int(rng.integers(1, 3))
        rows = rng.integers(0, m.table(L).rows, 24)
        t0 = time.monotonic()
        got = src.lookup(L, rows)
        dt = time.monotonic() - t0
        bad += int(np.count_nonzero((got != ref.read(L, rows)).any(axis=1)))
        return dt

    # a loaded 2-core host can miss the first handshake's deadline; the source then reconnects
    # in the background - wait for that, the fault under test comes later
    assert src.wait_connected(30), src.last_error
    for _ in range(30):
        step()
    assert src.counters()["fallbacks"] == 0, src.last_error
    srv.stop(signal.SIGKILL)
    for _ in range(30):
        worst_outage = max(worst_outage, step())
    c = src.counters()
    assert c["fallbacks"] >= 1 and c["transport_errors"] >= 1
    # added latency bounded by the timeout (+ the local read and a loaded CI host's slack)
    assert worst_outage < timeout_ms / 1000 + 0.5
    srv2 = Server(man, [url], tabs, metrics=False)
    assert src.wait_connected(30)
    before = src.counters()["remote_rows"]
    for _ in range(20):
        step()
    c = src.counters()
    assert c["reconnects"] >= 1 and c["remote_rows"] == before + 20 * 24
    assert bad == 0
    src.close()
    ref.close()
    assert srv2.stop() == 0


@pytest.mark.parametrize("scheme", ["tcp", "nixl"])
def test_frozen_server_costs_the_deadline_then_reconnects(tabs, scheme):
    """The server process frozen (SIGSTOP) with the request timeout far past the lookup deadline:
    single and two-layer lookups come back exact from the local reader at the deadline (counted),
    background reconnect attempts fail while it is frozen; after SIGCONT the source reconnects and
    reads remotely again, 0 bad rows throughout."""
    man = tabs / "a" / "manifest.json"
    m = load_manifest(man)
    url = f"{scheme}://127.0.0.1:{free_port()}"
    srv = Server(man, [url], tabs, metrics=False)
    ref = LocalRowReader(m, tabs / "a", threads=2)
    src = RemoteRowSource(
        url, m, 0, 1, timeout_ms=5000, local=LocalRowReader(m, tabs / "a", threads=2), deadline_ms=150
    )
    assert src.wait_connected(30), src.last_error
    rng = np.random.default_rng(11)
    bad = 0

    def step():
        nonlocal bad
        ids = [rng.integers(0, m.table(L).rows, 24) for L in (1, 2)]
        outs = [np.zeros((24, 264), np.uint8) for _ in range(2)]
        t0 = time.monotonic()
        src.lookup_layers([1, 2], ids, outs)
        got = src.lookup(1, ids[0])
        dt = time.monotonic() - t0
        bad += sum(
            int(np.count_nonzero((o != ref.read(L, r)).any(axis=1))) for L, r, o in zip((1, 2), ids, outs, strict=False)
        )
        bad += int(np.count_nonzero((got != ref.read(1, ids[0])).any(axis=1)))
        return dt

    for _ in range(10):
        step()
    assert src.counters()["fallbacks"] == 0, src.last_error
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        worst = max(step() for _ in range(10))
        c = src.counters()
        assert c["deadline_exceeded"] >= 1 and c["fallbacks"] >= c["deadline_exceeded"]
        assert worst < 2 * (0.15 + 0.5)  # two calls, each: deadline + local read + a loaded host's slack
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    if scheme == "nixl" and not src.wait_connected(10):
        # Known limit (docs/remote-engram.md, NIXL path): the client gave up on its READs while
        # the server was frozen; when the server resumes, UCX may find the client's endpoint gone
        # and abort the server process ("Endpoint timeout"). Anything else fails the test; the
        # client must then come back to a restarted server (a supervisor's job in production).
        assert srv.proc.wait(20) != 0 and "Endpoint timeout" in srv.output(), srv.output()[-2000:]
        srv = Server(man, [url], tabs, metrics=False)
    assert src.wait_connected(30), src.last_error
    before = src.counters()
    for _ in range(10):
        step()
    c = src.counters()
    assert c["remote_rows"] == before["remote_rows"] + 10 * 3 * 24 and c["reconnects"] >= 1
    assert bad == 0
    src.close()
    ref.close()
    assert srv.stop() == 0


def test_sigterm_drains_and_exits_zero(tabs):
    man = tabs / "a" / "manifest.json"
    m = load_manifest(man)
    srv = Server(man, ["tcp://127.0.0.1:0"], tabs)
    ident = P.identity_bytes(m.table(1).identity)
    c = open_client(srv.urls[0], [ident])
    out = np.empty((10, 264), np.uint8)
    c.lookup_into(ident, np.arange(10, dtype=np.uint64), [out], 2.0)
    # a large lookup in flight while SIGTERM arrives: exact rows either way (served or fallback)
    ref = LocalRowReader(m, tabs / "a", threads=2)
    src = RemoteRowSource(srv.urls[0], m, 0, 1, timeout_ms=2000, local=LocalRowReader(m, tabs / "a", threads=2))
    rows = np.random.default_rng(3).integers(0, m.table(1).rows, 400000)
    result = {}
    t = threading.Thread(target=lambda: result.update(rows=src.lookup(1, rows)))
    t.start()
    time.sleep(0.02)
    assert srv.stop(signal.SIGTERM) == 0
    t.join(60)
    assert np.array_equal(result["rows"], ref.read(1, rows))
    assert not srv.ready.exists()
    log = srv.output()
    assert '"event": "stopped"' in log and "Traceback" not in log
    c.close()
    src.close()
    ref.close()


def test_serve_bad_input_one_line(tabs, tmp_path, capsys):
    cases = [
        (["--manifest", str(tmp_path / "nope.json"), "--listen", "tcp://127.0.0.1:0"], "does not exist"),
        (["--manifest", str(tabs / "a" / "manifest.json"), "--listen", "udp://127.0.0.1:0"], "scheme"),
        (["--manifest", str(tabs / "a" / "manifest.json")], "at least one --listen"),
        (
            ["--manifest", str(tabs / "a" / "manifest.json"), "--data", str(tmp_path), "--listen", "tcp://127.0.0.1:0"],
            "does not exist",
        ),
        (["--manifest", str(tabs / "a" / "manifest.json"), "--listen", "tcp://192.0.2.1:0"], "cannot listen"),
    ]
    for args, msg in cases:
        rc, out, err = run_cli(capsys, "engram", "serve", *args)
        assert rc == 1, err
        assert msg in err and "Traceback" not in err and err.count("\n") == 1
    # the standalone entry point used by the tests above follows the same convention
    p = subprocess.run(
        [sys.executable, "-m", "dsv41.engram.remote_cli", "serve", *cases[0][0]],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "does not exist" in p.stderr and p.stderr.count("\n") == 1


def test_sweep_against_absent_server(tabs, capsys):
    man = str(tabs / "a" / "manifest.json")
    url = f"tcp://127.0.0.1:{free_port()}"
    rc, out, err = run_cli(
        capsys,
        "engram",
        "sweep",
        "--manifest",
        man,
        "--remote",
        url,
        "--rank",
        "0",
        "--lookups",
        "500",
        "--timeout-ms",
        "50",
    )
    assert rc == 1 and "compared no remote rows" in err
    rep = json.loads(out)
    assert rep["bad_rows"] == 0 and rep["fallbacks"] >= 1 and rep["remote_rows"] == 0
    rc, out, err = run_cli(
        capsys, "engram", "sweep", "--manifest", man, "--remote", url, "--rank", "1", "--lookups", "500", "--required"
    )
    assert rc == 1 and "required" in err and err.count("\n") == 1


def test_cli_registration(capsys):
    rc, out, err = run_cli(capsys, "engram", "--help")
    assert rc == 0 and "serve" in out and "sweep" in out
    rc, out, err = run_cli(capsys, "engram", "sweep", "--manifest", "x.json", "--remote", "ftp://h:1", "--rank", "0")
    assert rc == 1 and "scheme" in err
