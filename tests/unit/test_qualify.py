"""dsv41.entrypoints.qualify, qualify_host and qualify_controller (what qualify.yml runs): records,
bad input refused before any step, the report's assembly (unreachable hosts, failed and skipped
steps, both links at once), summary.md, and the host probes against a real local table server
(transport, sweep) and fakes (ping, docker).
"""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

import numpy as np
import pytest

from dsv41.entrypoints import qualify as Q, qualify_controller as C, qualify_host as H
from dsv41.errors import Dsv41Error


def test_record_status_and_skipped_needs_a_reason():
    assert Q.record("links", "mtu", "h", True, 9000, 9000, subject="ofl0")["status"] == "pass"
    r = Q.record("links", "mtu", "h", False, 1500, 9000, subject="ofl0", reason="x")
    assert (r["status"], r["id"]) == ("fail", "links.mtu[ofl0]")
    assert Q.record("serving", "piecewise", "h", None, reason="lab")["status"] == "skipped"
    with pytest.raises(ValueError, match="needs a reason"):
        Q.record("serving", "piecewise", "h", None)
    with pytest.raises(ValueError, match="unknown group"):
        Q.record("nope", "x", "h", True)


# --- bad input -------------------------------------------------------------------------------------

def test_change_me_anywhere_in_the_inventory_is_one_line_naming_each_place(tmp_path):
    hosts = {"sparkhead": {"ansible_host": "10.0.0.1", "dsv41_links": [{"name": "CHANGE_ME", "address": "10.77.0.2"}]},
             "x86host": {"ansible_host": "CHANGE_ME"}}
    with pytest.raises(Q.QualifyError) as e:
        Q.preflight(hosts, tmp_path / "q" / "1")
    msg = str(e.value)
    assert msg == "inventory still has CHANGE_ME in 2 place(s): sparkhead.dsv41_links[0].name, x86host.ansible_host"
    assert "\n" not in msg and not (tmp_path / "q").exists()  # refused before the report directory exists


def test_shipped_production_inventory_is_refused(tmp_path):
    """inventories/production as shipped: every CHANGE_ME found (the class: the variables
    qualify.yml reads, from the inventory's own files)."""
    import yaml

    root = os.path.join(os.path.dirname(__file__), "..", "..", "inventories", "production")
    hv = {}
    for h in ("sparkhead", "sparkworker", "x86host"):
        hv[h] = yaml.safe_load(open(os.path.join(root, "host_vars", f"{h}.yml")))
    with pytest.raises(Q.QualifyError, match=r"CHANGE_ME in \d+ place\(s\): sparkhead.dsv41_mgmt_address"):
        Q.preflight(hv, tmp_path / "r")


def test_report_directory_that_cannot_be_written_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode: a path under a regular file instead
            target = tmp_path / "file"
            target.write_text("x")
            with pytest.raises(Q.QualifyError, match=r"^report directory .*file/id cannot be written: "):
                Q.preflight({"h": {"a": "b"}}, target / "id")
        else:
            with pytest.raises(Q.QualifyError, match="cannot be written"):
                Q.preflight({"h": {"a": "b"}}, ro / "id")
    finally:
        ro.chmod(0o700)


def test_a_directory_with_a_report_is_not_overwritten(tmp_path):
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(Q.QualifyError, match="already holds a report"):
        Q.prepare_report_dir(tmp_path)
    assert (tmp_path / "report.json").read_text() == "{}"


def test_no_hosts_is_refused(tmp_path):
    with pytest.raises(Q.QualifyError, match="no spark and offload hosts"):
        Q.preflight({}, tmp_path / "x")


def _cli(capsys, *argv):
    from dsv41.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_preflight_one_line_exit_1(tmp_path, capsys):
    rc, out, err = _cli(capsys, "qualify", "preflight", "--hosts", '{"a": {"x": "CHANGE_ME"}}', "--out", str(tmp_path / "o"))
    assert rc == 1 and err.strip() == "dsv41: error: inventory still has CHANGE_ME in 1 place(s): a.x" and out == ""
    rc, out, err = _cli(capsys, "qualify", "preflight", "--hosts", "not json", "--out", str(tmp_path / "o"))
    assert rc == 1 and err.startswith("dsv41: error: --hosts: not JSON") and len(err.strip().splitlines()) == 1
    rc, out, err = _cli(capsys, "qualify", "preflight", "--hosts", '{"a": {"x": "y"}}', "--out", str(tmp_path / "o"))
    assert rc == 0 and out.strip() == str(tmp_path / "o")


# --- assembly --------------------------------------------------------------------------------------

def _version():
    return {"rc": 0, "stdout": json.dumps({"dsv41": "0.1.0", "python": "3.11.7"}), "changed": False}


def _cmd(records):
    return {"rc": 0, "stdout": "noise\n" + json.dumps(records), "stderr": ""}


def _links_result(ok=True):
    return {"checks": [{"check": "mtu", "ok": ok, "value": 9000 if ok else 1500, "expected": 9000, "link": "ofl0",
                        "reason": "" if ok else "ofl0: MTU 1500, expected 9000", "rdma_source": "sysfs"},
                       {"check": "rdma_port", "ok": None, "value": None, "expected": None, "link": "ofl0",
                        "reason": "ofl0: no RDMA device bound to the interface (sysfs)", "rdma_source": "sysfs"}]}


def _host(ok=True):
    return {"version": _version(), "done": True, "steps": [
        {"name": "rdma_link", "group": "links", "kind": "rdma_link", "result": _links_result(ok), "checks": ["mtu"]},
        {"name": "sweep", "group": "exactness", "kind": "command", "checks": ["bad_rows"],
         "result": _cmd([Q.record("exactness", "bad_rows", "sparkhead", True, {"bad_rows": 0}, 0, subject="rank 0 layer 1")])},
        {"name": "serving-host", "group": "serving", "kind": "command", "checks": ["required_mode"], "skip_reason": "not a Spark",
         "result": {"skipped": True, "changed": False}},
    ]}


def test_assemble_pass_with_skips_that_name_why():
    rep = Q.assemble({"sparkhead": _host()}, meta={"id": "t"})
    assert rep["result"] == "PASS" and rep["failed"] == [] and rep["versions"]["sparkhead"]["dsv41"] == "0.1.0"
    by = {c["id"]: c for c in rep["checks"]}
    assert by["links.mtu[ofl0]"]["status"] == "pass"
    assert by["links.rdma_port[ofl0]"]["status"] == "skipped"
    assert by["links.rdma_port[ofl0]"]["reason"] == "ofl0: no RDMA device bound to the interface (sysfs)"
    assert by["serving.required_mode"]["status"] == "skipped" and by["serving.required_mode"]["reason"] == "not a Spark"
    assert rep["counts"] == {"pass": 2, "fail": 0, "skipped": 2}


def test_assemble_fails_naming_each_failed_check():
    rep = Q.assemble({"sparkhead": _host(ok=False), "x86host": _host()}, meta={})
    assert rep["result"] == "FAIL" and rep["failed"] == ["links.mtu[ofl0]@sparkhead"]
    assert Q.failure_line(rep) == "qualification FAIL: links.mtu[ofl0]@sparkhead"


def test_unreachable_host_fails_with_one_line_and_no_success_claimed():
    rep = Q.assemble({"sparkhead": _host(), "sparkworker": {"version": {"unreachable": True, "msg": "ssh: connect to host\n10.0.0.2 port 22: No route"}}},
                     meta={})
    assert rep["result"] == "FAIL" and rep["failed"] == ["links.reachable@sparkworker"]
    (r,) = [c for c in rep["checks"] if c["host"] == "sparkworker"]
    assert r["reason"] == "sparkworker: unreachable: ssh: connect to host 10.0.0.2 port 22: No route"
    rep = Q.assemble({"sparkworker": None}, meta={})
    assert rep["failed"] == ["links.reachable@sparkworker"]


def test_a_host_that_stopped_midway_fails_finished():
    h = _host()
    h["done"] = False
    rep = Q.assemble({"sparkhead": h}, meta={})
    assert "links.finished@sparkhead" in rep["failed"]


def test_a_probe_that_exited_1_fails_every_check_it_owed_with_its_line():
    steps = [{"name": "transport", "group": "transport", "kind": "command", "subject": "ofl0",
              "checks": ["latency_p50", "bandwidth"],
              "result": {"rc": 1, "stdout": "", "stderr": "dsv41: error: manifest /opt/dsv41/tables/manifest.json: no such file"}},
             {"name": "peers", "group": "links", "kind": "command", "checks": ["peer_reachable"],
              "result": {"rc": 0, "stdout": "not json", "stderr": ""}}]
    rep = Q.assemble({"sparkhead": {"version": _version(), "done": True, "steps": steps}}, meta={})
    assert rep["failed"] == ["transport.latency_p50[ofl0]@sparkhead", "transport.bandwidth[ofl0]@sparkhead",
                             "links.peer_reachable@sparkhead"]
    assert rep["reasons"][0] == "transport: dsv41: error: manifest /opt/dsv41/tables/manifest.json: no such file"
    assert rep["reasons"][2] == "peers: printed no records"


def test_rdma_link_that_did_not_run_is_one_failure():
    recs = Q.from_links("h", {"failed": True, "msg": "the module crashed"})
    assert [(r["id"], r["status"], r["reason"]) for r in recs] == [("links.rdma_link", "fail", "h: the module crashed")]


def test_bandwidth_both_links_sum_and_overlap():
    def bw(host, link, gbps, start, end):
        return Q.record("transport", "bandwidth", host, True, {"gbps": gbps, "start": start, "end": end}, ">= 1",
                        subject=link)

    checks = [bw("sparkhead", "ofl0", 39.2, 100.0, 101.0), bw("sparkworker", "ofl0", 39.18, 100.1, 101.1)]
    (r,) = Q.bandwidth_both(checks, 70)
    assert r["status"] == "pass" and r["value"]["gbps"] == 78.38 and r["value"]["overlap"] == 0.9
    (r,) = Q.bandwidth_both(checks, 80.0)
    assert r["status"] == "fail" and "78.38 Gb/s (floor 80.0)" in r["reason"]
    apart = [bw("sparkhead", "ofl0", 39.2, 100.0, 101.0), bw("sparkworker", "ofl0", 39.2, 105.0, 106.0)]
    (r,) = Q.bandwidth_both(apart, 70)
    assert r["status"] == "fail" and "overlapping 0%" in r["reason"]
    assert Q.bandwidth_both(checks[:1], 70) == []
    # a rank that began late is named (its earlier checks ran past the common start)
    late = [bw("sparkhead", "ofl0", 39.2, 100.0, 102.0), bw("sparkworker", "ofl0", 39.2, 101.5, 103.5)]
    late[0]["value"]["late_s"], late[1]["value"]["late_s"] = 0.0, 1.5
    (r,) = Q.bandwidth_both(late, 70)
    assert r["status"] == "fail" and "sparkworker began 1.5 s after the common start" in r["reason"]
    assert "sparkhead began" not in r["reason"]


def test_summary_and_report_files(tmp_path):
    rep = Q.assemble({"sparkhead": _host(ok=False)}, meta={"id": "abc", "inventory": "inventories/sim/hosts.yml"})
    paths = Q.write_report(rep, tmp_path / "abc")
    doc = json.loads(open(paths["report"]).read())
    assert doc["result"] == "FAIL" and len(doc["checks"]) == 4
    md = open(paths["summary"]).read()
    assert md.startswith("# Qualification abc: FAIL")
    assert "- `links.mtu[ofl0]` on sparkhead: ofl0: MTU 1500, expected 9000" in md
    assert "| links.mtu[ofl0] | sparkhead | FAIL | 1500 | 9000 | bytes |" in md
    for c in doc["checks"]:
        assert set(c) >= {"id", "status", "value", "expected", "host", "time", "reason", "unit"}
        assert c["status"] != "skipped" or c["reason"]


def test_write_report_into_an_unwritable_place_is_one_line(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(Q.QualifyError, match="cannot be written"):
        Q.write_report(Q.assemble({}, meta={}), f / "x")


# --- probes with fakes -----------------------------------------------------------------------------

def test_peers_through_icmplib_fake():
    pytest.importorskip("icmplib")
    calls = []

    def ping(addr, **kw):
        calls.append((addr, kw["source"], kw["privileged"]))
        got = 3 if addr == "198.18.1.1" else 0
        return types.SimpleNamespace(packets_received=got, packets_sent=3, avg_rtt=0.05 if got else 0.0)

    links = [{"name": "ofl0", "address": "198.18.1.2", "peer_address": "198.18.1.1"},
             {"name": "fab0", "address": "198.18.3.1", "peer_address": "198.18.3.2"},
             {"name": "x"}]
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
    p.write_text(f"MemTotal:       24731184 kB\nMlocked:        {mlocked_kb} kB\nUnevictable:    {mlocked_kb + 10} kB\n")
    return str(p)


def test_serving_host_lab_runtime_skips_what_needs_vllm(tmp_path):
    env = tmp_path / "e.env"
    env.write_text("DSV41_ENGRAM_REMOTE=tcp://198.18.1.1:7441@198.18.1.2\nDSV41_ENGRAM_REMOTE_REQUIRED=0\n")
    recs = H.probe_serving_host("sparkhead", 0, runtime="lab", env_file=str(env), required=False,
                                pinned_max_bytes=1 << 30, meminfo_path=_meminfo(tmp_path))
    by = {r["check"]: r for r in recs}
    assert by["required_mode"]["status"] == "pass" and by["host_memory"]["status"] == "pass"
    assert by["host_memory"]["value"] == {"mlocked": 1000 * 1024, "unevictable": 1010 * 1024}
    for k in ("image_digest", "overlay_contract", "piecewise"):
        assert by[k]["status"] == "skipped" and by[k]["reason"] == "serve_runtime lab: no vLLM container on this host"
    recs = H.probe_serving_host("sparkhead", 0, runtime="lab", env_file=str(env), required=True,
                                pinned_max_bytes=1 << 19, meminfo_path=_meminfo(tmp_path))
    by = {r["check"]: r for r in recs}
    assert by["required_mode"]["status"] == "fail" and "DSV41_ENGRAM_REMOTE_REQUIRED=0, expected 1" in by["required_mode"]["reason"]
    assert by["host_memory"]["status"] == "fail"


def test_serving_host_vllm_reads_docker_and_systemd(tmp_path):
    env = tmp_path / "e.env"
    env.write_text("DSV41_ENGRAM_REMOTE=tcp://198.18.1.1:7441@198.18.1.2\nDSV41_ENGRAM_REMOTE_REQUIRED=1\n")
    image = "registry/vllm-dsv41@sha256:" + "a" * 64
    answers = {
        "inspect": (0, image + "\n"), "exec": (0, "[]\n"),
        "cat": (0, 'ExecStart=docker run ... --compilation-config {"cudagraph_mode": "PIECEWISE"}\n'),
        "logs": (0, "INFO dsv41 overlay active: rows [0, 192001740) from tcp://...\n"),
    }

    def run(argv):
        rc, out = answers[argv[1]]
        return types.SimpleNamespace(returncode=rc, stdout=out, stderr="")

    recs = H.probe_serving_host("sparkhead", 0, runtime="vllm", env_file=str(env), required=True, pinned_max_bytes=1 << 30,
                                image=image, meminfo_path=_meminfo(tmp_path), run=run)
    assert {r["check"]: r["status"] for r in recs} == {"required_mode": "pass", "host_memory": "pass", "image_digest": "pass",
                                                       "overlay_contract": "pass", "piecewise": "pass", "overlay_active": "pass"}
    answers.update(inspect=(0, "registry/vllm-dsv41:latest\n"), exec=(0, '["vllm/x.py"]\n'),
                   cat=(0, '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'), logs=(0, ""))
    recs = H.probe_serving_host("sparkhead", 0, runtime="vllm", env_file=str(env), required=True, pinned_max_bytes=1 << 30,
                                image=image, meminfo_path=_meminfo(tmp_path), run=run)
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
    recs = H.probe_transport("sparkhead", "ofl0", url, str(d / "manifest.json"), 0, 2, backend="tcp", p50_max_us=1e6,
                             p99_max_us=1e6, gbps_min=0.001, iters=50, bw_bytes=1 << 20, bw_repeats=2,
                             bw_min_s=0.3, start_at=time.time() - 1.0)
    by = {r["check"]: r for r in recs}
    assert set(by) == {"backend", "latency_p50", "latency_p99", "bandwidth", "late_reply_dropped", "refused_identity"}
    bwv = by["bandwidth"]["value"]
    # the transfers last at least bw_min_s (more than bw_repeats of them), begun late on purpose;
    # start and end are wall-clock stamps rounded to 1 ms each (CI saw 0.300 - 1e-12): 2 ms of slack
    assert bwv["end"] - bwv["start"] >= 0.3 - 0.002 and bwv["repeats"] > 2 and bwv["late_s"] >= 1.0
    assert all(r["status"] == "pass" for r in recs), [r for r in recs if r["status"] != "pass"]
    assert by["refused_identity"]["value"] == "refused: wrong_identity"
    assert by["late_reply_dropped"]["value"] == {"timed_out": True, "connection_closed": True, "bad_rows_after": 0,
                                                 "rows_after": 4096}
    assert by["bandwidth"]["value"]["bytes"] > (1 << 20) - 300 and by["latency_p99"]["unit"] == "us"


def test_transport_probe_floors_and_backend_fail(served):
    d, url, _ = served
    recs = H.probe_transport("sparkhead", "ofl0", url, str(d / "manifest.json"), 1, 2, backend="nixl", p50_max_us=0.001,
                             p99_max_us=0.001, gbps_min=1e6, iters=20, bw_bytes=1 << 18, bw_repeats=1, bw_min_s=0)
    st = {r["check"]: r["status"] for r in recs}
    assert st == {"backend": "fail", "latency_p50": "fail", "latency_p99": "fail", "bandwidth": "fail",
                  "late_reply_dropped": "pass", "refused_identity": "pass"}


def test_transport_probe_server_down_fails_every_check(served):
    d, _, _ = served
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    recs = H.probe_transport("sparkhead", "ofl0", f"tcp://127.0.0.1:{port}", str(d / "manifest.json"), 0, 2, backend="tcp",
                             p50_max_us=1e6, p99_max_us=1e6, gbps_min=0.0, iters=10, bw_bytes=1 << 16)
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


def test_cli_probes_print_records_and_skip_without_remote(tmp_path, capsys):
    env = tmp_path / "e.env"
    env.write_text("# remote Engram off\n")
    rc, out, err = _cli(capsys, "qualify", "transport", "--host", "h", "--link", "ofl0", "--rank", "0", "--backend", "tcp",
                        "--p50-max-us", "1", "--p99-max-us", "1", "--gbps-min", "1", "--env-file", str(env))
    assert rc == 0, err
    recs = json.loads(out.strip().splitlines()[-1])
    assert {x["status"] for x in recs} == {"skipped"} and len(recs) == 6
    assert recs[0]["reason"].startswith("remote Engram is off on rank 0")
    rc, out, err = _cli(capsys, "qualify", "transport", "--host", "h", "--link", "l", "--rank", "0", "--backend", "rdma",
                        "--p50-max-us", "1", "--p99-max-us", "1", "--gbps-min", "1")
    assert rc == 1 and err.strip() == "dsv41: error: --backend must be nixl or tcp, not 'rdma'"
    rc, out, err = _cli(capsys, "qualify", "serving-host", "--host", "h", "--rank", "0", "--runtime", "docker",
                        "--required", "--pinned-max-bytes", "1")
    assert rc == 1 and err.strip() == "dsv41: error: --runtime must be lab or vllm, not 'docker'"
    rc, out, err = _cli(capsys, "qualify", "peers", "--host", "h", "--links", "[1]")
    assert rc == 1 and err.startswith("dsv41: error: --links: expected a JSON list")


def test_vllm_tiny_is_skipped_without_vllm(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    r = H.run_vllm_tiny("tools/qualify_vllm_tiny.sh", "/nope.json")
    assert r["status"] == "skipped" and r["reason"] == "no vllm on PATH on this host"


def test_every_probe_error_is_a_dsv41_error():
    assert issubclass(Q.QualifyError, Dsv41Error)
    assert np is not None


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
        recs = H.probe_transport("sparkhead", "ofl0", f"nixl://127.0.0.1:{ep.port}", str(d / "manifest.json"), 0, 2,
                                 backend="nixl", p50_max_us=1e6, p99_max_us=1e6, gbps_min=0.001, iters=30,
                                 bw_bytes=1 << 20, bw_repeats=2, bw_min_s=0)
    finally:
        srv.stop(2)
        ex.close()
    by = {r["check"]: r for r in recs}
    assert all(r["status"] == "pass" for r in recs), [(r["check"], r["reason"]) for r in recs if r["status"] != "pass"]
    assert by["late_reply_dropped"]["value"]["slot_quarantined"] is True and by["backend"]["value"] == "nixl"


def test_controller_probes_with_rank0_unreachable_fail_every_check_they_owe(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    api = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    refs = tmp_path / "refs.json"
    recs = C.probe_serving(api, str(refs), host="localhost", ranks=["0", "1"], interval_s=0.1)
    assert [(r["id"], r["status"]) for r in recs] == [("serving.counters[rank 0]", "fail"), ("serving.counters[rank 1]", "fail"),
                                                      ("serving.greedy_refs", "fail")]
    assert all(r["reason"].startswith(api) for r in recs)
    recs = C.probe_reconnect(api, host="localhost", ranks=["0", "1"], wait_s=0.1)
    assert [(r["id"], r["status"]) for r in recs] == [("transport.reconnect[rank 0]", "fail"), ("transport.reconnect[rank 1]", "fail")]
    (r,) = C.probe_fail_closed(api, str(refs), host="localhost")
    assert r["id"] == "drafter.fail_closed" and r["status"] == "fail"


def test_sweep_probe_with_an_unreadable_manifest_is_one_failure(tmp_path):
    bad = tmp_path / "manifest.json"
    bad.write_text("{not json")
    (r,) = H.probe_sweep("sparkworker", "tcp://127.0.0.1:1", str(bad), 1, 2, lookups=10)
    assert r["id"] == "exactness.bad_rows[rank 1]" and r["status"] == "fail" and r["reason"].startswith(f"rank 1: manifest {bad}: ")
