"""The host probes of qualify.yml (dsv41.entrypoints.qualify_host, qualify_serving) and the
drafter-identity check, with fakes (ping, docker, systemd) and against a real local table server
(transport over TCP and NIXL, the exactness sweep). Records and the report's assembly:
test_qualify.py.
"""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

import pytest

from dsv41.entrypoints import qualify_controller as C, qualify_host as H, qualify_serving as S

# --- probes with fakes -----------------------------------------------------------------------------


def test_peers_through_icmplib_fake():
    pytest.importorskip("icmplib")
    calls = []

    def ping(addr, **kw):
        calls.append((addr, kw["source"], kw["privileged"]))
        got = 3 if addr == "198.18.1.1" else 0
        return types.SimpleNamespace(packets_received=got, packets_sent=3, avg_rtt=0.05 if got else 0.0)

    links = [
        {"name": "ofl0", "address": "198.18.1.2", "peer_address": "198.18.1.1"},
        {"name": "fab0", "address": "198.18.3.1", "peer_address": "198.18.3.2"},
        {"name": "x"},
    ]
    recs = H.probe_peers("sparkhead", links, ping=ping)
    assert [r["status"] for r in recs] == ["pass", "fail", "skipped"]
    assert calls == [("198.18.1.1", "198.18.1.2", True), ("198.18.3.2", "198.18.3.1", True)]
    assert recs[1]["reason"] == "fab0: 198.18.3.2 did not answer 3 echo requests from 198.18.3.1"


def test_peers_ping_error_is_a_failure():
    from icmplib.exceptions import SocketPermissionError

    def ping(addr, **kw):
        raise SocketPermissionError(True)

    (r,) = H.probe_peers("h", [{"name": "ofl0", "address": "a", "peer_address": "b"}], ping=ping)
    assert r["status"] == "fail" and r["reason"].startswith("ofl0: ping b: ")


def _meminfo(tmp_path, mlocked_kb=1000):
    p = tmp_path / "meminfo"
    p.write_text(
        f"MemTotal:       24731184 kB\nMlocked:        {mlocked_kb} kB\nUnevictable:    {mlocked_kb + 10} kB\n"
    )
    return str(p)


def test_serving_host_lab_runtime_skips_what_needs_vllm(tmp_path):
    env = tmp_path / "e.env"
    env.write_text("DSV41_ENGRAM_REMOTE=tcp://198.18.1.1:7441@198.18.1.2\nDSV41_ENGRAM_REMOTE_REQUIRED=0\n")
    recs = S.probe_serving_host(
        "sparkhead",
        0,
        runtime="lab",
        env_file=str(env),
        required=False,
        pinned_max_bytes=1 << 30,
        meminfo_path=_meminfo(tmp_path),
    )
    by = {r["check"]: r for r in recs}
    assert by["required_mode"]["status"] == "pass" and by["host_memory"]["status"] == "pass"
    assert by["host_memory"]["value"] == {"mlocked": 1000 * 1024, "unevictable": 1010 * 1024}
    for k in ("image_digest", "overlay_contract", "piecewise"):
        assert by[k]["status"] == "skipped" and by[k]["reason"] == "serve_runtime lab: no vLLM container on this host"
    recs = S.probe_serving_host(
        "sparkhead",
        0,
        runtime="lab",
        env_file=str(env),
        required=True,
        pinned_max_bytes=1 << 19,
        meminfo_path=_meminfo(tmp_path),
    )
    by = {r["check"]: r for r in recs}
    assert (
        by["required_mode"]["status"] == "fail"
        and "DSV41_ENGRAM_REMOTE_REQUIRED=0, expected 1" in by["required_mode"]["reason"]
    )
    assert by["host_memory"]["status"] == "fail"


def test_serving_host_vllm_reads_docker_and_systemd(tmp_path):
    env = tmp_path / "e.env"
    env.write_text("DSV41_ENGRAM_REMOTE=tcp://198.18.1.1:7441@198.18.1.2\nDSV41_ENGRAM_REMOTE_REQUIRED=1\n")
    image = "registry/vllm-dsv41@sha256:" + "a" * 64
    answers = {
        "inspect": (0, image + "\n"),
        "exec": (0, "[]\n"),
        "cat": (0, 'ExecStart=docker run ... --compilation-config {"cudagraph_mode": "PIECEWISE"}\n'),
        "logs": (0, "INFO dsv41 overlay active: rows [0, 192001740) from tcp://...\n"),
    }

    def run(argv):
        rc, out = answers[argv[1]]
        return types.SimpleNamespace(returncode=rc, stdout=out, stderr="")

    recs = S.probe_serving_host(
        "sparkhead",
        0,
        runtime="vllm",
        env_file=str(env),
        required=True,
        pinned_max_bytes=1 << 30,
        image=image,
        meminfo_path=_meminfo(tmp_path),
        run=run,
    )
    assert {r["check"]: r["status"] for r in recs} == {
        "required_mode": "pass",
        "host_memory": "pass",
        "image_digest": "pass",
        "overlay_contract": "pass",
        "piecewise": "pass",
        "overlay_active": "pass",
    }
    answers.update(
        inspect=(0, "registry/vllm-dsv41:latest\n"),
        exec=(0, '["vllm/x.py"]\n'),
        cat=(0, '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'),
        logs=(0, ""),
    )
    recs = S.probe_serving_host(
        "sparkhead",
        0,
        runtime="vllm",
        env_file=str(env),
        required=True,
        pinned_max_bytes=1 << 30,
        image=image,
        meminfo_path=_meminfo(tmp_path),
        run=run,
    )
    st = {r["check"]: r["status"] for r in recs}
    assert [st[k] for k in ("image_digest", "overlay_contract", "piecewise", "overlay_active")] == ["fail"] * 4


def test_drafter_identity():
    ids = {"drafter": "d", "markov": "m", "target": "t"}
    (r,) = C.probe_drafter_identity({"connections": 1, "identities": ids}, ids, host="localhost")
    assert r["status"] == "pass"
    (r,) = C.probe_drafter_identity({"identities": {**ids, "target": "x"}}, ids, host="localhost")
    assert r["status"] == "fail" and r["reason"].endswith(": target")
    (r,) = C.probe_drafter_identity(None, ids, host="localhost")
    assert r["status"] == "fail"


def test_rank_url_and_env_file(tmp_path):
    p = tmp_path / "x.env"
    p.write_text("# c\nDSV41_ENGRAM_REMOTE=tcp://a:1@b, tcp://c:1@d\n\nX=1\n")
    env = H.read_env_file(p)
    assert H.rank_url(env, 0) == "tcp://a:1@b" and H.rank_url(env, 1) == "tcp://c:1@d"
    assert H.rank_url({}, 0) is None and H.read_env_file(tmp_path / "none") == {}


# --- transport and exactness against a real table server ------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.server import load_tables
    from dsv41.engram.synthetic import write_synthetic_tables
    from dsv41.transport import parse_url
    from dsv41.transport.server import RowServer

    d = tmp_path_factory.mktemp("q")
    cfg = json.loads((Path(__file__).resolve().parents[2] / "python/dsv41/data/lab_model.json").read_text())
    cfg["engram_vocab_size"] = 300
    write_synthetic_tables(cfg, d, seed=9)
    m = load_manifest(d / "manifest.json")
    tables, _ = load_tables(m, d)
    srv = RowServer(tables, [parse_url("tcp://127.0.0.1:0")])
    ep = srv.start()[0]
    yield d, f"tcp://127.0.0.1:{ep.port}", srv
    srv.stop()


def test_transport_probe_on_a_real_server(served):
    d, url, _ = served
    recs = H.probe_transport(
        "sparkhead",
        "ofl0",
        url,
        str(d / "manifest.json"),
        0,
        2,
        backend="tcp",
        p50_max_us=1e6,
        p99_max_us=1e6,
        gbps_min=0.001,
        iters=50,
        bw_bytes=1 << 20,
        bw_repeats=2,
        bw_min_s=0.3,
        start_at=time.time() - 1.0,
    )
    by = {r["check"]: r for r in recs}
    assert set(by) == {"backend", "latency_p50", "latency_p99", "bandwidth", "late_reply_dropped", "refused_identity"}
    bwv = by["bandwidth"]["value"]
    # the transfers last at least bw_min_s (more than bw_repeats of them), begun late on purpose;
    # start and end are wall-clock stamps rounded to 1 ms each (CI saw 0.300 - 1e-12): 2 ms of slack
    assert bwv["end"] - bwv["start"] >= 0.3 - 0.002 and bwv["repeats"] > 2 and bwv["late_s"] >= 1.0
    assert all(r["status"] == "pass" for r in recs), [r for r in recs if r["status"] != "pass"]
    assert by["refused_identity"]["value"] == "refused: wrong_identity"
    assert by["late_reply_dropped"]["value"] == {
        "timed_out": True,
        "connection_closed": True,
        "bad_rows_after": 0,
        "rows_after": 4096,
    }
    assert by["bandwidth"]["value"]["bytes"] > (1 << 20) - 300 and by["latency_p99"]["unit"] == "us"


def test_transport_probe_floors_and_backend_fail(served):
    d, url, _ = served
    recs = H.probe_transport(
        "sparkhead",
        "ofl0",
        url,
        str(d / "manifest.json"),
        1,
        2,
        backend="nixl",
        p50_max_us=0.001,
        p99_max_us=0.001,
        gbps_min=1e6,
        iters=20,
        bw_bytes=1 << 18,
        bw_repeats=1,
        bw_min_s=0,
    )
    st = {r["check"]: r["status"] for r in recs}
    assert st == {
        "backend": "fail",
        "latency_p50": "fail",
        "latency_p99": "fail",
        "bandwidth": "fail",
        "late_reply_dropped": "pass",
        "refused_identity": "pass",
    }


def test_transport_probe_server_down_fails_every_check(served):
    d, _, _ = served
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    recs = H.probe_transport(
        "sparkhead",
        "ofl0",
        f"tcp://127.0.0.1:{port}",
        str(d / "manifest.json"),
        0,
        2,
        backend="tcp",
        p50_max_us=1e6,
        p99_max_us=1e6,
        gbps_min=0.0,
        iters=10,
        bw_bytes=1 << 16,
    )
    st = {r["check"]: r["status"] for r in recs}
    assert st["backend"] == "pass" and [v for k, v in st.items() if k != "backend"] == ["fail"] * 5


def test_sweep_probe_per_layer(served):
    d, url, _ = served
    recs = H.probe_sweep("sparkhead", url, str(d / "manifest.json"), 0, 2, lookups=60000)
    from dsv41.engram.manifest import load_manifest

    layers = [t.layer_id for t in load_manifest(d / "manifest.json").tables]
    assert [r["subject"] for r in recs] == [f"rank 0 layer {L}" for L in layers] and len(layers) == 2
    assert all(r["status"] == "pass" and r["value"]["bad_rows"] == 0 and r["value"]["lookups"] > 0 for r in recs), recs
    assert sum(r["value"]["lookups"] for r in recs) == 60000


def test_sweep_probe_against_a_server_with_other_rows_fails_with_bad_rows(served, tmp_path):
    """A wrong manifest on one rank: local shards that are not the served tables."""
    from dsv41.engram.synthetic import write_synthetic_tables

    d, url, _ = served
    cfg = json.loads((Path(__file__).resolve().parents[2] / "python/dsv41/data/lab_model.json").read_text())
    cfg["engram_vocab_size"] = 300
    write_synthetic_tables(cfg, tmp_path, seed=10)  # same layout, other rows: other identities
    recs = H.probe_sweep("sparkhead", url, str(tmp_path / "manifest.json"), 0, 2, lookups=500)
    assert all(r["status"] == "fail" for r in recs)
    assert "does not serve table" in recs[0]["reason"] and recs[0]["reason"].startswith("rank 0: sweep over tcp://")


def test_vllm_tiny_is_skipped_without_vllm(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    r = S.run_vllm_tiny("tools/qualify_vllm_tiny.sh", "/nope.json")
    assert r["status"] == "skipped" and r["reason"] == "no vllm on PATH on this host"


def test_transport_probe_over_nixl(served):
    """The production backend where RDMA exists (here UCX over TCP on loopback): the same checks,
    the late READ guarded by a quarantined staging slot on the same client."""
    pytest.importorskip("nixl_cu12")
    os.environ.setdefault("UCX_TLS", "tcp")
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.server import load_tables
    from dsv41.transport import parse_url
    from dsv41.transport.nixl_backend import NixlExporter
    from dsv41.transport.server import RowServer

    d, _, _ = served
    tables, _ = load_tables(load_manifest(d / "manifest.json"), d)
    ex = NixlExporter(tables)
    srv = RowServer(tables, [parse_url("nixl://127.0.0.1:0")], nixl_provider=ex)
    ep = srv.start()[0]
    try:
        recs = H.probe_transport(
            "sparkhead",
            "ofl0",
            f"nixl://127.0.0.1:{ep.port}",
            str(d / "manifest.json"),
            0,
            2,
            backend="nixl",
            p50_max_us=1e6,
            p99_max_us=1e6,
            gbps_min=0.001,
            iters=30,
            bw_bytes=1 << 20,
            bw_repeats=2,
            bw_min_s=0,
        )
    finally:
        srv.stop(2)
        ex.close()
    by = {r["check"]: r for r in recs}
    assert all(r["status"] == "pass" for r in recs), [(r["check"], r["reason"]) for r in recs if r["status"] != "pass"]
    assert by["late_reply_dropped"]["value"]["slot_quarantined"] is True and by["backend"]["value"] == "nixl"


def test_sweep_probe_with_an_unreadable_manifest_is_one_failure(tmp_path):
    bad = tmp_path / "manifest.json"
    bad.write_text("{not json")
    (r,) = H.probe_sweep("sparkworker", "tcp://127.0.0.1:1", str(bad), 1, 2, lookups=10)
    assert (
        r["id"] == "exactness.bad_rows[rank 1]"
        and r["status"] == "fail"
        and r["reason"].startswith(f"rank 1: manifest {bad}: ")
    )
