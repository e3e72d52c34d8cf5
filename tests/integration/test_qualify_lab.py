"""`ansible-playbook qualify.yml` on the deployed three-host lab (the session's shared lab, conftest.py).

make test:
- qualify.yml passes with the lab's expectations (inventories/sim: tcp backend, lab runtime, MTU
  9000): every check group is in report.json with values, every skipped check names why, nothing
  changes on any host; --check passes too, changes nothing and names the probes it skipped;
- bad input: a CHANGE_ME left (the shipped production inventory), a report directory that
  cannot be written (both refused before any host step, no report), an unreachable host and a
  link the inventory names that does not exist (one line each, a FAIL report, never a PASS).

make lab-long (lab_long): a second normal run changes nothing either, then a deliberately broken
lab fails the right checks and only those: MTU 1500 on one link, the table server stopped, a wrong
manifest on one rank; each fault is cleared by the test and the lab left as deploy.yml made it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from labutil import BIN, ROOT, extra_inventory, host_path, inside, needs_lab, play

pytestmark = [pytest.mark.lab, pytest.mark.slow, needs_lab]

GROUPS = {"links", "transport", "exactness", "serving", "drafter"}
CTL = ["systemctl"]  # the lab hosts run systemd, as production


def _recap(stdout: str) -> dict[str, int]:
    recap = stdout.split("PLAY RECAP")[-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s*:\s*ok=\d+\s+changed=(\d+)", recap, re.M)}


def _qualify(tmp_path, *args, timeout=900):
    r = play("qualify.yml", "-e", f"qualify_dir={tmp_path}", *args, timeout=timeout)
    reports = sorted(tmp_path.glob("*/report.json"))
    rep = json.loads(reports[-1].read_text()) if reports else None
    return r, rep


def _assert_complete(rep):
    assert {c["group"] for c in rep["checks"]} == GROUPS
    for c in rep["checks"]:
        assert c["status"] in ("pass", "fail", "skipped") and c["host"] and c["time"]
        if c["status"] == "skipped":
            assert c["reason"], c
        if c["status"] == "pass" and c["group"] in ("transport", "exactness"):
            assert c["value"] is not None and c["expected"] is not None, c
    assert set(rep["versions"]) == {"sparkhead", "sparkworker", "x86host"}


def test_qualify_passes_on_the_lab_and_changes_nothing(deployed_lab, tmp_path):
    r, rep = _qualify(tmp_path / "a")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert rep["result"] == "PASS" and rep["failed"] == [] and not rep["check_mode"]
    _assert_complete(rep)
    ids = {(c["id"], c["host"]): c for c in rep["checks"]}
    for host in ("sparkhead", "sparkworker"):
        for check in ("latency_p50", "latency_p99", "bandwidth", "late_reply_dropped", "refused_identity", "backend"):
            assert ids[(f"transport.{check}[ofl0]", host)]["status"] == "pass"
        assert ids[("links.mtu[ofl0]", host)]["value"] == 9000
        assert ids[("links.rdma_port[ofl0]", host)]["status"] == "skipped"  # no RDMA device in the lab
    assert ids[("transport.bandwidth_both[both links]", "localhost")]["status"] == "pass"
    for rank, host in (("0", "sparkhead"), ("1", "sparkworker")):
        assert ids[(f"transport.reconnect[rank {rank}]", "localhost")]["value"]["reconnects"] >= 1
        assert ids[(f"serving.counters[rank {rank}]", "localhost")]["status"] == "pass"
        for layer in (1, 2):
            c = ids[(f"exactness.bad_rows[rank {rank} layer {layer}]", host)]
            assert c["status"] == "pass" and c["value"]["bad_rows"] == 0 and c["value"]["lookups"] > 0
        assert (
            ids[(f"serving.piecewise[rank {rank}]", host)]["reason"]
            == "serve_runtime lab: no vLLM container on this host"
        )
    assert ids[("serving.greedy_refs", "localhost")]["value"] == "6/6"
    assert ids[("drafter.fail_closed", "localhost")]["status"] == "pass"
    assert ids[("drafter.worker_identity", "localhost")]["status"] == "pass"
    changed = _recap(r.stdout)
    assert {h: changed[h] for h in ("sparkhead", "sparkworker", "x86host")} == {
        "sparkhead": 0,
        "sparkworker": 0,
        "x86host": 0,
    }
    summary = next((tmp_path / "a").glob("*/summary.md")).read_text()
    assert (
        summary.startswith(f"# Qualification {rep['id']}: PASS")
        and "| transport.latency_p99[ofl0] | sparkhead | pass |" in summary
    )
    assert (
        f"# Qualification {rep['id']}: PASS" in r.stdout.split("TASK [qualify : Summary]")[-1]
    )  # printed by the playbook too

    chk, crep = _qualify(tmp_path / "c", "--check")
    assert chk.returncode == 0, chk.stdout[-5000:]
    assert crep["result"] == "PASS" and crep["check_mode"]
    cids = {(c["id"], c["host"]): c for c in crep["checks"]}
    for cid in ("transport.reconnect", "drafter.fail_closed"):
        c = cids[(cid, "localhost")]
        assert c["status"] == "skipped" and c["reason"].startswith("check mode"), c
    assert cids[("exactness.bad_rows[rank 0 layer 1]", "sparkhead")]["status"] == "pass"  # read-only checks still run
    assert set(_recap(chk.stdout).values()) <= {0, 1} and _recap(chk.stdout)["x86host"] == 0


def test_change_me_and_an_unwritable_report_dir_are_refused_before_any_host_step(deployed_lab, tmp_path):
    r = play("qualify.yml", "-i", "inventories/production", "-e", f"qualify_dir={tmp_path}", timeout=300)
    assert r.returncode != 0 and not list(tmp_path.iterdir())
    assert "dsv41: error: inventory still has CHANGE_ME in" in r.stdout and "sparkhead.ansible_host" in r.stdout
    assert "Reach the host (dsv41 version" not in r.stdout  # no host was touched
    f = tmp_path / "file"
    f.write_text("x")
    r = play("qualify.yml", "-e", f"qualify_dir={f}", timeout=300)
    assert r.returncode != 0 and f"dsv41: error: report directory {f}/" in r.stdout and "cannot be written" in r.stdout
    assert "Reach the host (dsv41 version" not in r.stdout


def test_unreachable_host_and_a_missing_link_fail_with_one_line_each(deployed_lab, tmp_path):
    import yaml

    x86 = yaml.safe_load((ROOT / "inventories/sim/host_vars/x86host.yml").read_text())
    links = x86["dsv41_links"] + [
        {
            "name": "ofl9",
            "purpose": "offload",
            "address": "198.18.9.1",
            "prefix": 30,
            "mtu": 9000,
            "peer": "sparkhead",
            "peer_if": "ofl9",
            "peer_address": "198.18.9.2",
        }
    ]
    extra = extra_inventory(
        tmp_path,
        {
            "sparkworker": {"ansible_host": "198.18.0.99"},  # no such host: blackholed
            "x86host": {"dsv41_links": links},
        },
    )
    r, rep = _qualify(
        tmp_path / "r",
        "-i",
        "inventories/sim",
        "-i",
        extra,
        "-e",
        f"dsv41_project_dir={ROOT}",
        "--tags",
        "qualify_links",
    )
    assert r.returncode != 0 and rep is not None and rep["result"] == "FAIL"
    assert "links.reachable@sparkworker" in rep["failed"] and "links.netdev[ofl9]@x86host" in rep["failed"]
    reasons = {c["id"] + "@" + c["host"]: c["reason"] for c in rep["checks"] if c["status"] == "fail"}
    assert reasons["links.netdev[ofl9]@x86host"] == "ofl9: no such interface"
    assert reasons["links.reachable@sparkworker"].startswith("sparkworker: unreachable: ")
    assert "\n" not in reasons["links.reachable@sparkworker"]
    assert re.search(r"qualification FAIL: .*links\.reachable@sparkworker", r.stdout)
    assert "qualification PASS" not in r.stdout


# --- make lab-long: a second run, then the broken lab -------------------------------------------------


def _failed(rep) -> set[str]:
    return set(rep["failed"])


def _server(action: str) -> None:
    inside("x86host", *CTL, action, "dsv41-engram-server", check=False)


@pytest.mark.lab_long
def test_broken_lab_fails_the_right_checks_and_only_those(deployed_lab, tmp_path):
    r, rep = _qualify(tmp_path / "again")
    assert r.returncode == 0 and rep["result"] == "PASS", r.stdout[-4000:]
    assert {h: v for h, v in _recap(r.stdout).items() if h != "localhost"} == {
        "sparkhead": 0,
        "sparkworker": 0,
        "x86host": 0,
    }

    # MTU 1500 on the link x86host <-> sparkhead (both ends: one end alone also breaks TCP segments
    # sized for 9000, which the counters would rightly report too)
    ends = (("x86host", "ofl-head"), ("sparkhead", "ofl0"))
    for host, dev in ends:
        inside(host, "ip", "link", "set", "dev", dev, "mtu", "1500")
    try:
        r, rep = _qualify(tmp_path / "mtu")
    finally:
        for host, dev in ends:
            inside(host, "ip", "link", "set", "dev", dev, "mtu", "9000")
    assert r.returncode != 0 and _failed(rep) == {"links.mtu[ofl-head]@x86host", "links.mtu[ofl0]@sparkhead"}, rep[
        "reasons"
    ]
    assert "links.mtu[ofl-head]@x86host" in r.stdout
    assert "ofl-head: MTU 1500, expected 9000" in rep["reasons"]

    # the table server stopped: transport and exactness on both ranks, the counters (fallbacks),
    # and the reconnect (the probe does not start a stopped server); the references still match
    _server("stop")
    try:
        r, rep = _qualify(tmp_path / "server")
    finally:
        _server("start")
    want = {
        "transport.reconnect[rank 0]@localhost",
        "transport.reconnect[rank 1]@localhost",
        "serving.counters[rank 0]@localhost",
        "serving.counters[rank 1]@localhost",
    }
    for host, rank in (("sparkhead", 0), ("sparkworker", 1)):
        want |= {
            f"transport.{c}[ofl0]@{host}"
            for c in ("latency_p50", "latency_p99", "bandwidth", "late_reply_dropped", "refused_identity")
        }
        want |= {f"exactness.bad_rows[rank {rank} layer {L}]@{host}" for L in (1, 2)}
    assert r.returncode != 0 and _failed(rep) == want, sorted(_failed(rep) ^ want)
    ids = {c["id"]: c for c in rep["checks"] if c["host"] == "localhost"}
    assert ids["serving.greedy_refs"]["status"] == "pass"  # the exact local fallback

    # a wrong manifest on rank 1: its transport and its sweep fail, nothing else
    manifest = host_path("sparkworker", "/opt/dsv41/tables/manifest.json")
    keep = manifest.read_bytes()
    doc = json.loads(keep)
    doc["tables"] = list(reversed(doc["tables"]))  # layer 1's table where layer 2's belongs and back
    for t in doc["tables"]:
        t["layer_id"] = {1: 2, 2: 1}[t["layer_id"]]
    try:
        manifest.write_text(json.dumps(doc))
        r, rep = _qualify(tmp_path / "manifest")
    finally:
        manifest.write_bytes(keep)
    bad = _failed(rep)
    assert r.returncode != 0 and bad and all(x.endswith("@sparkworker") for x in bad), sorted(bad)
    assert any(x.startswith("exactness.bad_rows[rank 1") for x in bad), sorted(bad)
    assert any(x.startswith("transport.latency_p50[ofl0]") for x in bad), sorted(bad)
    assert not any(x.startswith(("links.", "serving.", "drafter.")) for x in bad), sorted(bad)

    # the lab is production again
    s = subprocess.run(
        [str(BIN / "dsv41"), "status", "--window", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert s.returncode == 0, s.stdout[-3000:]
    assert shutil.which("ip")
