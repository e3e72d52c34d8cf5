"""dsv41.entrypoints.qualify, qualify_host and qualify_controller (what qualify.yml runs): records,
bad input refused before any step, the report's assembly (unreachable hosts, failed and skipped
steps, both links at once), summary.md, the probes' command line and the controller probes with
rank 0 unreachable. The host probes (fakes and a real table server): test_qualify_probes.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dsv41.entrypoints import qualify as Q, qualify_controller as C
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
    hosts = {
        "sparkhead": {"ansible_host": "10.0.0.1", "dsv41_links": [{"name": "CHANGE_ME", "address": "10.77.0.2"}]},
        "x86host": {"ansible_host": "CHANGE_ME"},
    }
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
    rc, out, err = _cli(
        capsys, "qualify", "preflight", "--hosts", '{"a": {"x": "CHANGE_ME"}}', "--out", str(tmp_path / "o")
    )
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
    return {
        "checks": [
            {
                "check": "mtu",
                "ok": ok,
                "value": 9000 if ok else 1500,
                "expected": 9000,
                "link": "ofl0",
                "reason": "" if ok else "ofl0: MTU 1500, expected 9000",
                "rdma_source": "sysfs",
            },
            {
                "check": "rdma_port",
                "ok": None,
                "value": None,
                "expected": None,
                "link": "ofl0",
                "reason": "ofl0: no RDMA device bound to the interface (sysfs)",
                "rdma_source": "sysfs",
            },
        ]
    }


def _host(ok=True):
    return {
        "version": _version(),
        "done": True,
        "steps": [
            {
                "name": "rdma_link",
                "group": "links",
                "kind": "rdma_link",
                "result": _links_result(ok),
                "checks": ["mtu"],
            },
            {
                "name": "sweep",
                "group": "exactness",
                "kind": "command",
                "checks": ["bad_rows"],
                "result": _cmd(
                    [Q.record("exactness", "bad_rows", "sparkhead", True, {"bad_rows": 0}, 0, subject="rank 0 layer 1")]
                ),
            },
            {
                "name": "serving-host",
                "group": "serving",
                "kind": "command",
                "checks": ["required_mode"],
                "skip_reason": "not a Spark",
                "result": {"skipped": True, "changed": False},
            },
        ],
    }


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
    rep = Q.assemble(
        {
            "sparkhead": _host(),
            "sparkworker": {
                "version": {"unreachable": True, "msg": "ssh: connect to host\n10.0.0.2 port 22: No route"}
            },
        },
        meta={},
    )
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
    steps = [
        {
            "name": "transport",
            "group": "transport",
            "kind": "command",
            "subject": "ofl0",
            "checks": ["latency_p50", "bandwidth"],
            "result": {
                "rc": 1,
                "stdout": "",
                "stderr": "dsv41: error: manifest /opt/dsv41/tables/manifest.json: no such file",
            },
        },
        {
            "name": "peers",
            "group": "links",
            "kind": "command",
            "checks": ["peer_reachable"],
            "result": {"rc": 0, "stdout": "not json", "stderr": ""},
        },
    ]
    rep = Q.assemble({"sparkhead": {"version": _version(), "done": True, "steps": steps}}, meta={})
    assert rep["failed"] == [
        "transport.latency_p50[ofl0]@sparkhead",
        "transport.bandwidth[ofl0]@sparkhead",
        "links.peer_reachable@sparkhead",
    ]
    assert rep["reasons"][0] == "transport: dsv41: error: manifest /opt/dsv41/tables/manifest.json: no such file"
    assert rep["reasons"][2] == "peers: printed no records"


def test_rdma_link_that_did_not_run_is_one_failure():
    recs = Q.from_links("h", {"failed": True, "msg": "the module crashed"})
    assert [(r["id"], r["status"], r["reason"]) for r in recs] == [("links.rdma_link", "fail", "h: the module crashed")]


def test_bandwidth_both_links_sum_and_overlap():
    def bw(host, link, gbps, start, end):
        return Q.record(
            "transport", "bandwidth", host, True, {"gbps": gbps, "start": start, "end": end}, ">= 1", subject=link
        )

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


# --- probes: the command line and the controller side (the host probes: test_qualify_probes.py) ---


def test_cli_probes_print_records_and_skip_without_remote(tmp_path, capsys):
    env = tmp_path / "e.env"
    env.write_text("# remote Engram off\n")
    rc, out, err = _cli(
        capsys,
        "qualify",
        "transport",
        "--host",
        "h",
        "--link",
        "ofl0",
        "--rank",
        "0",
        "--backend",
        "tcp",
        "--p50-max-us",
        "1",
        "--p99-max-us",
        "1",
        "--gbps-min",
        "1",
        "--env-file",
        str(env),
    )
    assert rc == 0, err
    recs = json.loads(out.strip().splitlines()[-1])
    assert {x["status"] for x in recs} == {"skipped"} and len(recs) == 6
    assert recs[0]["reason"].startswith("remote Engram is off on rank 0")
    rc, out, err = _cli(
        capsys,
        "qualify",
        "transport",
        "--host",
        "h",
        "--link",
        "l",
        "--rank",
        "0",
        "--backend",
        "rdma",
        "--p50-max-us",
        "1",
        "--p99-max-us",
        "1",
        "--gbps-min",
        "1",
    )
    assert rc == 1 and err.strip() == "dsv41: error: --backend must be nixl or tcp, not 'rdma'"
    rc, out, err = _cli(
        capsys,
        "qualify",
        "serving-host",
        "--host",
        "h",
        "--rank",
        "0",
        "--runtime",
        "docker",
        "--required",
        "--pinned-max-bytes",
        "1",
    )
    assert rc == 1 and err.strip() == "dsv41: error: --runtime must be lab or vllm, not 'docker'"
    rc, out, err = _cli(capsys, "qualify", "peers", "--host", "h", "--links", "[1]")
    assert rc == 1 and err.startswith("dsv41: error: --links: expected a JSON list")


def test_every_probe_error_is_a_dsv41_error():
    assert issubclass(Q.QualifyError, Dsv41Error)
    assert np is not None


def test_controller_probes_with_rank0_unreachable_fail_every_check_they_owe(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    api = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    refs = tmp_path / "refs.json"
    recs = C.probe_serving(api, str(refs), host="localhost", ranks=["0", "1"], interval_s=0.1)
    assert [(r["id"], r["status"]) for r in recs] == [
        ("serving.counters[rank 0]", "fail"),
        ("serving.counters[rank 1]", "fail"),
        ("serving.greedy_refs", "fail"),
    ]
    assert all(r["reason"].startswith(api) for r in recs)
    recs = C.probe_reconnect(api, host="localhost", ranks=["0", "1"], wait_s=0.1)
    assert [(r["id"], r["status"]) for r in recs] == [
        ("transport.reconnect[rank 0]", "fail"),
        ("transport.reconnect[rank 1]", "fail"),
    ]
    (r,) = C.probe_fail_closed(api, str(refs), host="localhost")
    assert r["id"] == "drafter.fail_closed" and r["status"] == "fail"


def test_serving_skips_a_rank_whose_overlay_is_off_under_vllm(monkeypatch, tmp_path):
    """vLLM's stock stage: no rank runs the overlay (rank_metrics.urls gives no entry), so no rank
    has dsv41 counters; each rank's counters check is skipped naming why, never failed, while the
    greedy references are still checked. The lab runtime (every rank has an entry) is unchanged."""
    from dsv41.harness import rank_metrics as RM, refs as R

    facts = {"runtime": "vllm", "api_url": "http://127.0.0.1:9", "ranks": {"0": "127.0.0.1", "1": "127.0.0.2"}}
    urls = RM.urls({**facts, "overlay_port": 9471, "overlay_ranks": []})
    assert urls == {}
    monkeypatch.setattr(C, "_engine", lambda api, rm=None: {"engram": {}, "overlay": {}})
    monkeypatch.setattr(C, "_completions", lambda api, n: (n, []))

    class Six:
        identical = total = 6

        def summary(self):
            return "6/6"

    monkeypatch.setattr(R, "load_refs", lambda path: [])
    monkeypatch.setattr(R, "verify", lambda api, refs: Six())
    recs = C.probe_serving(
        "http://127.0.0.1:9",
        str(tmp_path / "r.json"),
        host="localhost",
        ranks=["0", "1"],
        interval_s=0.01,
        rank_metrics=urls,
    )
    assert [(r["id"], r["status"]) for r in recs] == [
        ("serving.counters[rank 0]", "skipped"),
        ("serving.counters[rank 1]", "skipped"),
        ("serving.greedy_refs", "pass"),
    ]
    assert "runs vLLM's own code" in recs[0]["reason"]
    lab = RM.urls({**facts, "runtime": "lab", "overlay_port": 9471})
    recs = C.probe_serving(
        "http://127.0.0.1:9",
        str(tmp_path / "r.json"),
        host="localhost",
        ranks=["0", "1"],
        interval_s=0.01,
        rank_metrics=lab,
    )
    assert [r["status"] for r in recs] == ["fail", "fail", "pass"]  # the lab's ranks owe counters
