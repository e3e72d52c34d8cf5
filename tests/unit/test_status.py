"""`dsv41 status` without the lab: host facts from files and a fake service manager, the endpoint
probe against loopback fakes, the verdicts (healthy, fallbacks growing, admission held since when,
identity mismatch, unreachable), rendering, and the CLI's bad-input paths (unknown inventory, an
inventory whose hosts cannot be reached) through the real status playbook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest

from dsv41.entrypoints import status as st, status_host, status_render
from dsv41.service_control import ServiceControlError
from serverutil import FakeStack

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

T = {"1": "a" * 64, "14": "b" * 64}


def _manifest(path: Path, tables=T, revision="r1") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"revision": revision, "tables": [{"layer_id": int(k), "identity": v} for k, v in tables.items()]})
    )


def _fake_systemctl(tmp_path: Path, lines: str, rc: int = 0) -> Path:
    """A directory with a ``systemctl`` that prints ``lines`` for ``list-units`` (and fails for
    anything else) and exits ``rc``: put it first on PATH."""
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    p = b / "systemctl"
    p.write_text(f"#!/bin/sh\n[ \"$1\" = list-units ] || exit 64\ncat <<'EOF'\n{lines}\nEOF\nexit {rc}\n")
    p.chmod(0o755)
    return b


# ---- host facts -----------------------------------------------------------------------------


def test_host_facts_from_files_and_systemd(tmp_path, monkeypatch):
    root = tmp_path / "opt"
    _manifest(root / "tables" / "manifest.json")
    (root / "packages" / "pkg-0007").mkdir(parents=True)
    os.symlink("pkg-0007", root / "packages" / "current")
    b = _fake_systemctl(
        tmp_path,
        "dsv41-serve.service   loaded active   running dsv41 engine\n"
        "dsv41-other.service   loaded inactive dead    dsv41 other\n"
        "unrelated.service     loaded active   running unrelated",
    )
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")
    f = status_host.host_facts(service_manager="systemd", root=str(root), container_runtime="")
    assert f["services"] == {"dsv41-serve": "active", "dsv41-other": "inactive"}
    assert f["manifest"]["revision"] == "r1" and f["manifest"]["tables"] == T and len(f["manifest"]["sha256"]) == 64
    assert f["drafter"] is None and f["image"] is None and f["promotion"] == "pkg-0007"
    import dsv41

    assert f["dsv41"] == dsv41.__version__


def test_host_facts_missing_and_broken_things_are_reported_not_raised(tmp_path, monkeypatch):
    root = tmp_path / "opt"
    (root / "tables").mkdir(parents=True)
    (root / "tables" / "manifest.json").write_text("{not json")
    (root / "drafter").mkdir()
    (root / "packages").mkdir()
    (root / "packages" / "current").write_text("pkg-0002\n")
    # systemd that cannot be asked (no systemctl on PATH)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    f = status_host.host_facts(service_manager="systemd", root=str(root), container_runtime="/no/such/docker")
    assert f["services"] == {"systemd": "unavailable: cannot run systemctl"}
    assert "manifest.json" in f["manifest"]["error"]
    assert "error" in f["drafter"]
    assert f["promotion"] == "pkg-0002" and f["image"] is None
    assert status_host.host_facts(root=str(tmp_path / "none"), service_manager="systemd")["manifest"] is None
    # systemctl that answers with an error: its stderr, one line
    b = _fake_systemctl(tmp_path, "", rc=1)
    (b / "systemctl").write_text("#!/bin/sh\necho 'System has not been booted with systemd' >&2\nexit 1\n")
    monkeypatch.setenv("PATH", str(b))
    assert status_host.service_states("systemd") == {"systemd": "unavailable: System has not been booted with systemd"}
    for bad in ("upstart", "supervisor"):
        with pytest.raises(ServiceControlError, match=rf"^--service-manager must be one of systemd, not '{bad}'$"):
            status_host.service_states(bad)


def test_image_of_the_running_container(tmp_path):
    rt = tmp_path / "docker"
    rt.write_text(
        '#!/bin/sh\n[ "$1" = inspect ] && [ "$4" = dsv41-serve ] && echo \'reg/vllm@sha256:abc sha256:def\' && exit 0\nexit 1\n'
    )
    rt.chmod(0o755)
    assert status_host.image_facts(str(rt), "dsv41-serve") == "reg/vllm@sha256:abc sha256:def"
    assert status_host.image_facts(str(rt), "other") is None


def test_last_window_is_the_newest_decision(tmp_path):
    assert st.last_window(tmp_path) is None and st.last_window(None) is None
    for i, (wid, verdict) in enumerate([("w1", "LOSE"), ("w2", "WIN")]):
        (tmp_path / wid).mkdir()
        p = tmp_path / wid / "decision.json"
        p.write_text(json.dumps({"verdict": verdict}))
        os.utime(p, (1000 + i, 1000 + i))
    assert st.last_window(tmp_path) == {"id": "w2", "verdict": "WIN", "path": str(tmp_path / "w2" / "decision.json")}
    # what `dsv41 window run` writes: the verdict inside "decision"
    p = tmp_path / "w3" / "decision.json"
    p.parent.mkdir()
    p.write_text(json.dumps({"decision": {"verdict": "LOSS", "metric": "step_ms_p50"}, "candidate": "slow-rows"}))
    os.utime(p, (2000, 2000))
    assert st.last_window(tmp_path)["verdict"] == "LOSS"


# ---- the endpoints (loopback fakes) ---------------------------------------------------------


@pytest.fixture
def fake():
    f = FakeStack()
    yield f
    f.close()


def _hosts(spark_tables=T, x86_tables=T, drafter=None, reachable=True):
    d = drafter or {"drafter": "d" * 64, "markov": "m" * 64, "target": "t" * 64}
    base = {"dsv41": "0.1.0", "image": None, "promotion": None, "reachable": True, "error": None}
    return {
        "sparkhead": {
            **base,
            "groups": ["spark"],
            "rank": 0,
            "services": {"dsv41-serve": "active"},
            "manifest": {"revision": "r1", "sha256": "x", "tables": spark_tables},
            "drafter": d,
        },
        "sparkworker": {
            **base,
            "groups": ["spark"],
            "rank": 1,
            "services": {"dsv41-serve": "active"},
            "manifest": {"revision": "r1", "sha256": "x", "tables": T},
            "drafter": None,
            **({} if reachable else {"reachable": False, "error": "Failed to connect"}),
        },
        "x86host": {
            **base,
            "groups": ["offload"],
            "rank": None,
            "services": {"dsv41-engram-server": "active", "dsv41-drafter": "active"},
            "manifest": {"revision": "r1", "sha256": "x", "tables": x86_tables},
            "drafter": d,
        },
    }


def _probe(fake, bump=None, window=2.0):
    def sleep(s):
        assert s == window
        if bump:
            bump()

    return st.probe(fake.url, fake.url, fake.url + "/w", window_s=window, sleep=sleep)


def test_healthy_stack(fake):
    rep = st.evaluate(_hosts(), _probe(fake))
    assert rep["healthy"] and rep["reasons"] == [] and rep["warnings"] == []
    assert rep["api"]["admission"] == "open" and rep["api"]["model"] == "dsv41-lab"
    assert rep["engine"]["engram"]["1"] == {"lookups": 90.0, "fallbacks": 0.0}
    assert rep["engine"]["spec"] == {"accepted_tokens": 40.0, "draft_tokens": 50.0}
    assert rep["engine"]["drafter"]["proxy_respawns"] == 2.0
    lines = status_render.render_lines(rep)
    assert lines[0] == "status: HEALTHY"
    assert any(
        ln.startswith(f"API: {fake.url} (model dsv41-lab; health ok)") and "admission open" in ln for ln in lines
    )
    assert "Engram rank 1: 90 lookups (+0 in 2 s), 0 fallbacks (+0 in 2 s)" in lines
    assert any(
        "drafter rounds 12 (+0), accepted tokens 40/50 (+0), fail-closed 1 (+0), proxy respawns 2" in ln for ln in lines
    )
    assert "last window: none" in lines and any(ln.startswith("sparkhead (rank 0): serve active") for ln in lines)
    json.dumps(rep)  # what --json prints


def test_fallbacks_growing_on_both_ranks_are_named(fake):
    def bump():
        fake.lookups = [130, 120]
        fake.fallbacks = [7, 5]

    fake.ready = False
    rep = st.evaluate(_hosts(), _probe(fake, bump))
    assert not rep["healthy"]
    assert "rank 0: Engram fallbacks growing (+7 in 2 s, 7 since start)" in rep["reasons"]
    assert "rank 1: Engram fallbacks growing (+5 in 2 s, 5 since start)" in rep["reasons"]
    assert any(r.startswith(f"Engram table server {fake.url}: /ready HTTP 503") for r in rep["reasons"])
    assert "Engram rank 0: 130 lookups (+30 in 2 s), 7 fallbacks (+7 in 2 s)" in status_render.render_lines(rep)


def test_old_fallbacks_are_a_warning_not_a_failure(fake):
    fake.fallbacks = [3, 0]
    rep = st.evaluate(_hosts(), _probe(fake))
    assert rep["healthy"] and rep["warnings"] == ["rank 0: 3 Engram fallbacks since start (none in the last 2 s)"]


def test_admission_held_says_since_when(fake):
    fake.paused, fake.since = True, time.time() - 42
    rep = st.evaluate(_hosts(), _probe(fake, window=0.0 + 1))
    assert not rep["healthy"]
    (reason,) = rep["reasons"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(fake.since))
    assert reason.startswith(f"admission held since {stamp} (4") and reason.endswith(" s)")


def test_hold_ok_makes_an_expected_hold_a_warning_only(fake):
    fake.paused, fake.since = True, time.time() - 7
    rep = st.evaluate(_hosts(), _probe(fake))
    ok = st.allow_hold(rep)
    assert not rep["healthy"] and rep["reasons"] == [rep["held_reason"]]  # the input is unchanged
    assert ok["healthy"] and ok["reasons"] == [] and ok["warnings"][-1] == rep["held_reason"] + " (expected: --hold-ok)"
    # every other reason still counts
    fake.ready = False
    bad = st.allow_hold(st.evaluate(_hosts(), _probe(fake)))
    assert not bad["healthy"] and all("admission held" not in r for r in bad["reasons"]) and bad["reasons"]
    # nothing held: nothing to move
    fake.paused, fake.ready = False, True
    rep = st.evaluate(_hosts(), _probe(fake))
    assert rep["held_reason"] is None and st.allow_hold(rep) == rep


def test_identity_mismatches(fake):
    fake.worker_ids["target"] = "e" * 64
    rep = st.evaluate(_hosts(spark_tables={"1": "a" * 64, "14": "c" * 64}), _probe(fake))
    assert "identity mismatch: Engram tables on sparkhead differ from x86host (layers 14)" in rep["reasons"]
    assert (
        "identity mismatch: drafter worker reports target eeeeeeeeeeee; rank 0 expects target tttttttttttt"
        in rep["reasons"]
    )
    hosts = _hosts()
    hosts["sparkworker"]["dsv41"] = "0.0.9"
    hosts["sparkhead"]["image"] = "reg/vllm@sha256:old sha256:1"
    rep = st.evaluate(hosts, _probe(fake), expected_image="reg/vllm@sha256:new")
    assert any(
        r.startswith("identity mismatch: dsv41 versions differ") and "sparkworker 0.0.9" in r for r in rep["reasons"]
    )
    assert (
        "identity mismatch: sparkhead runs image reg/vllm@sha256:old, configured reg/vllm@sha256:new" in rep["reasons"]
    )


def test_unreachable_host_rank_and_endpoints():
    closed = "http://127.0.0.1:9"  # discard port: nothing listens on loopback
    probed = st.probe(closed, closed, closed, window_s=1.0, timeout_s=1.0, sleep=lambda s: pytest.fail("no sleep"))
    rep = st.evaluate(_hosts(reachable=False), probed)
    assert not rep["healthy"]
    assert "sparkworker: unreachable (Failed to connect)" in rep["reasons"]
    assert any(r.startswith(f"rank 0 API {closed}: unreachable (cannot connect: ") for r in rep["reasons"])
    assert any(r.startswith(f"Engram table server {closed}: unreachable") for r in rep["reasons"])
    assert any(r.startswith(f"drafter worker {closed}: unreachable") for r in rep["reasons"])
    with pytest.raises(st.StatusError, match="--window"):
        st.probe(closed, None, None, window_s=float("nan"))


def test_rank_missing_from_metrics_is_unreachable(fake):
    fake_metrics = fake.engine_metrics
    fake.engine_metrics = lambda: "\n".join(ln for ln in fake_metrics().splitlines() if 'rank="1"' not in ln) + "\n"
    rep = st.evaluate(_hosts(), _probe(fake))
    assert f"rank 1: unreachable (no Engram counters on {fake.url}/metrics)" in rep["reasons"]


def test_host_entry_from_registered_results():
    ok = st.host_entry({"groups": ["all", "spark"], "rank": "1", "rc": 0, "stdout": json.dumps({"dsv41": "0.1.0"})})
    assert ok == {"groups": ["spark"], "rank": 1, "reachable": True, "error": None, "dsv41": "0.1.0"}
    down = st.host_entry({"groups": ["offload"], "unreachable": True, "msg": "Failed to connect\n to x"})
    assert down["reachable"] is False and down["error"] == "Failed to connect to x"
    bad = st.host_entry({"groups": ["spark"], "rank": 0, "rc": 2, "stderr": "Traceback\nNo such file: dsv41"})
    assert bad["error"] == "dsv41 status --local failed: No such file: dsv41"
    assert st.host_entry({"rc": 0, "stdout": "garbage"})["error"] == "dsv41 status --local printed no JSON"


def test_rich_tables_render(fake):
    from rich.console import Console

    fake.paused, fake.since = True, time.time() - 5
    rep = st.evaluate(_hosts(), _probe(fake))
    buf = StringIO()
    status_render.render_tables(rep, Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert "dsv41 hosts" in out and "sparkworker" in out and "Engram per rank" in out
    assert "admission held since" in out and "unhealthy: admission held since" in out


# ---- the engine's /is_paused says since when --------------------------------------------------


def test_is_paused_reports_paused_since():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from authutil import OP_HEADERS, OPERATOR, TEST_HOSTS
    from dsv41.engine.server import create_app
    from engineutil import FakeEngine

    c = TestClient(
        create_app(FakeEngine(), "m", 64, operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS), headers=OP_HEADERS
    )
    assert c.get("/is_paused").json() == {"is_paused": False, "paused_since": None}
    t0 = time.time()
    assert c.post("/pause").status_code == 200
    since = c.get("/is_paused").json()["paused_since"]
    assert t0 - 1 <= since <= time.time()
    c.post("/pause")  # a second HOLD keeps the first one's time
    assert c.get("/is_paused").json()["paused_since"] == since
    c.post("/resume")
    assert c.get("/is_paused").json() == {"is_paused": False, "paused_since": None}


# ---- the command: bad input is one line, exit 1 --------------------------------------------------


def _dsv41(*args, cwd=ROOT, timeout=180, path_first: Path | None = None):
    path = f"{BIN}:{os.environ.get('PATH', '')}"
    env = dict(os.environ, NO_COLOR="1", PATH=f"{path_first}:{path}" if path_first else path)
    return subprocess.run(
        [str(BIN / "dsv41"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_unknown_inventory_is_one_line():
    r = _dsv41("status", "--inventory", "no/such/inventory.yml")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == "dsv41: error: inventory no/such/inventory.yml: no such file or directory\n"


def test_inventory_without_dsv41_hosts_is_one_line(tmp_path):
    inv = tmp_path / "hosts.yml"
    inv.write_text("all:\n  hosts:\n    somehost:\n")
    r = _dsv41("status", "--inventory", str(inv))
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert "no hosts in the 'spark' and 'offload' groups" in r.stderr


def test_local_facts_json(tmp_path):
    _manifest(tmp_path / "tables" / "manifest.json")
    b = _fake_systemctl(tmp_path, "dsv41-serve.service loaded active running dsv41 engine")
    r = _dsv41(
        "status",
        "--local",
        "--json",
        "--root",
        str(tmp_path),
        "--container-runtime",
        str(tmp_path / "no-docker"),
        path_first=b,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["services"] == {"dsv41-serve": "active"}


@pytest.mark.slow
def test_unreachable_hosts_through_the_status_playbook(tmp_path):
    """The real status playbook (ansible-runner) against an inventory whose hosts cannot be entered
    and whose endpoints are closed loopback ports: every host and endpoint named, exit 1."""
    inv = tmp_path / "inv"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text(
        "all:\n  children:\n    spark:\n      hosts:\n        sparkhead:\n"
        "          dsv41_rank: 0\n          dsv41_mgmt_address: 127.0.0.1\n"
        "        sparkworker:\n          dsv41_rank: 1\n"
        "    offload:\n      hosts:\n        x86host:\n          dsv41_mgmt_address: 127.0.0.1\n"
    )
    # dsv41_api_url names another host's variable through hostvars, as the real inventories do
    (inv / "group_vars" / "all.yml").write_text(
        # ssh to a loopback port nothing listens on: every host is unreachable
        "ansible_connection: ssh\nansible_host: 127.0.0.1\nansible_port: 9\n"
        "ansible_ssh_common_args: -o ConnectTimeout=5 -o BatchMode=yes\n"
        'ansible_python_interpreter: "{{ ansible_playbook_python }}"\n'
        "dsv41_api_url: \"http://{{ hostvars['sparkhead'].dsv41_mgmt_address }}:9\"\ndsv41_drafter_metrics_port: 9\n"
    )
    r = _dsv41("status", "--inventory", str(inv / "hosts.yml"), "--window", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    for h in ("sparkhead", "sparkworker", "x86host"):
        assert f"unhealthy: {h}: unreachable (" in r.stdout, r.stdout
    assert "unhealthy: rank 0 API http://127.0.0.1:9: unreachable" in r.stdout
    r = _dsv41("status", "--inventory", str(inv / "hosts.yml"), "--window", "0", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["healthy"] is False and not rep["hosts"]["x86host"]["reachable"]
    # a second inventory source overrides the first (ansible-playbook -i A -i B, as the vLLM lab
    # and a site's own group_vars do): status reads both, in order
    over = tmp_path / "over"
    (over / "group_vars").mkdir(parents=True)
    (over / "hosts.yml").write_text("all:\n  children:\n    spark:\n    offload:\n")
    (over / "group_vars" / "all.yml").write_text(
        "dsv41_api_url: \"http://{{ hostvars['sparkhead'].dsv41_mgmt_address }}:7\"\n"
    )
    r = _dsv41("status", "-i", str(inv / "hosts.yml"), "-i", str(over), "--window", "0")
    assert r.returncode == 1 and "unhealthy: rank 0 API http://127.0.0.1:7: unreachable" in r.stdout, r.stdout
    r = _dsv41("status", "-i", str(inv / "hosts.yml"), "-i", str(tmp_path / "absent"))
    assert (
        r.returncode == 1 and r.stderr == f"dsv41: error: inventory {tmp_path / 'absent'}: no such file or directory\n"
    )


def test_inventory_that_does_not_parse_is_one_line(tmp_path):
    inv = tmp_path / "hosts.yml"
    inv.write_text("all: [\n")
    r = _dsv41("status", "--inventory", str(inv))
    assert r.returncode == 1 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(
        f"dsv41: error: inventory {inv}: no hosts in the 'spark' and 'offload' groups (it did not parse: YAML"
    )


def test_metrics_endpoint_failing_is_a_reason(fake):
    fake.engine_metrics = None  # the handler raises: the server answers nothing useful
    probed = st.probe(fake.url, None, None, window_s=0)
    rep = st.evaluate(_hosts(), probed)
    assert probed["engine"]["error"].startswith(f"rank 0: metrics endpoint {fake.url}/metrics ")
    assert any(r.startswith(f"metrics: rank 0: metrics endpoint {fake.url}/metrics ") for r in rep["reasons"]), rep[
        "reasons"
    ]
