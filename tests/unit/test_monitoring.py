"""dsv41.monitoring: the operations exporter, the alerts reader and `dsv41 status`'s alerts line
(fake rank 0 and fake Prometheus API on 127.0.0.1), the dashboard (regenerates to the checked-in
JSON; every expression valid PromQL for promtool), `dsv41 monitor` bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from dsv41.entrypoints import status as st, status_render
from dsv41.monitoring import alerts as A, dashboard as D, exporter as E
from dsv41.promotion import journal as J
from serverutil import FakeStack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake():
    f = FakeStack()
    yield f
    f.close()


def _alert(name, state="firing", severity="critical", **labels):
    return {
        "labels": {"alertname": name, "severity": severity, **labels},
        "annotations": {"summary": f"{name} says"},
        "state": state,
        "activeAt": "2026-12-02T00:00:00Z",
        "value": "1e+00",
    }


# ---- the operations exporter ---------------------------------------------------------------


def test_exporter_idle(fake, tmp_path):
    col = E.OpsCollector(fake.url, tmp_path / "packages" / "journal.jsonl")
    v = E.describe(col)
    assert v == {
        "dsv41_admission_up": 1.0,
        "dsv41_admission_held": 0.0,
        "dsv41_admission_held_since_seconds": 0.0,
        "dsv41_window_active": 0.0,
        "dsv41_window_active_since_seconds": 0.0,
        "dsv41_promotion_journal_open": 0.0,
        "dsv41_promotion_journal_last_step_seconds": 0.0,
        "dsv41_promotion_current_since_seconds": 0.0,
        "dsv41_promotion_journal_readable": 1.0,
    }


def test_exporter_window_hold_and_open_journal(fake, tmp_path):
    fake.paused, fake.since = True, 1234.5
    jp = tmp_path / "packages" / "journal.jsonl"
    J.append(jp, "op1", "begin", kind="promote")
    J.append(jp, "op1", "done", package="p1")
    began = J.append(jp, "20261202T000000-aa", "begin", kind="window", prev="p1", target="p1")
    J.append(jp, "20261202T000000-aa", "held")
    (tmp_path / "packages" / "current").symlink_to("p1")
    v = E.describe(E.OpsCollector(fake.url, jp))
    assert v["dsv41_admission_held"] == 1 and v["dsv41_admission_held_since_seconds"] == 1234.5
    assert v["dsv41_window_active"] == 1 and v["dsv41_window_active_since_seconds"] == began["ts"]
    assert v['dsv41_window_info{"id": "20261202T000000-aa"}'] == 1
    assert v["dsv41_promotion_journal_open"] == 1 and v["dsv41_promotion_journal_last_step_seconds"] > 0
    assert v["dsv41_promotion_current_since_seconds"] > 0
    J.append(jp, "20261202T000000-aa", "done", package="p1")
    v = E.describe(E.OpsCollector(fake.url, jp))
    assert v["dsv41_promotion_journal_open"] == 0 and v["dsv41_window_active"] == 0
    J.append(jp, "op2", "begin", kind="rollback")
    v = E.describe(E.OpsCollector(fake.url, jp))  # an open rollback is not a window
    assert v["dsv41_promotion_journal_open"] == 1 and v["dsv41_window_active"] == 0


def test_exporter_rank0_unreachable_or_foreign(tmp_path):
    v = E.describe(E.OpsCollector("http://127.0.0.1:9", tmp_path / "j.jsonl", timeout_s=0.5))
    assert v["dsv41_admission_up"] == 0 and v["dsv41_admission_held"] == 0


def test_exporter_serves_prometheus_text(fake, tmp_path):
    server, _t = E.serve("127.0.0.1:0", E.OpsCollector(fake.url, tmp_path / "j.jsonl"))
    try:
        body = httpx.get(f"http://127.0.0.1:{server.server_address[1]}/metrics", trust_env=False).text
    finally:
        server.shutdown()
    assert "dsv41_admission_held 0.0" in body and "dsv41_window_active 0.0" in body


@pytest.mark.parametrize("listen", ["nohost", "127.0.0.1:99999", "http://127.0.0.1:1"])
def test_exporter_bad_listen_is_one_error(listen, tmp_path):
    with pytest.raises(E.Dsv41Error):
        E.serve(listen, E.OpsCollector("", tmp_path / "j.jsonl"))


# ---- the alerts reader and dsv41 status ------------------------------------------------------


def test_firing_alerts_only_dsv41_and_firing(fake):
    fake.alerts_body["data"]["alerts"] = [
        _alert("Dsv41TableServerDown", instance="198.18.0.13:9441"),
        _alert("Dsv41EngramFallbacksGrowing", state="pending", rank="0"),
        _alert("Watchdog", severity="none"),
        _alert("Dsv41ProxyRespawning", severity="warning"),
    ]
    got = A.firing(fake.url)
    assert [a["name"] for a in got] == ["Dsv41ProxyRespawning", "Dsv41TableServerDown"]
    assert A.describe(got[1]) == "Dsv41TableServerDown{instance=198.18.0.13:9441} (critical): Dsv41TableServerDown says"


@pytest.mark.parametrize(
    "code,body",
    [
        (500, {"status": "error"}),
        (200, {"status": "error", "error": "x"}),
        (200, {"status": "success", "data": {}}),
        (200, "not json"),
        (200, {"status": "success", "data": {"alerts": [1]}}),
    ],
)
def test_bad_alerts_answers_are_one_error(fake, code, body):
    fake.alerts_code, fake.alerts_body = code, body
    with pytest.raises(A.AlertsError):
        A.firing(fake.url)


def _report():
    return {
        "time": 0,
        "window_s": 0,
        "healthy": True,
        "reasons": [],
        "warnings": [],
        "hosts": {},
        "api": {"url": "http://x", "health": "ok", "admission": "open"},
        "engine": {"engram": {}, "window": {}, "drafter": {}, "spec": {}},
        "engram_server": {},
        "drafter_worker": {},
        "window": None,
    }


def test_status_says_which_alerts_fire(fake):
    fake.alerts_body["data"]["alerts"] = [
        _alert("Dsv41TableServerDown"),
        _alert("Dsv41ProxyRespawning", severity="warning"),
    ]
    rep = st.add_alerts(_report(), fake.url)
    assert not rep["healthy"]
    assert rep["reasons"] == ["alert firing: Dsv41TableServerDown (critical): Dsv41TableServerDown says"]
    assert rep["warnings"] == ["alert firing: Dsv41ProxyRespawning (warning): Dsv41ProxyRespawning says"]
    lines = status_render.render_lines(rep)
    assert f"alerts ({fake.url}): 2 firing: Dsv41ProxyRespawning, Dsv41TableServerDown" in lines


def test_status_none_firing_and_none_configured(fake):
    rep = st.add_alerts(_report(), fake.url)
    assert rep["healthy"] and f"alerts ({fake.url}): none firing" in status_render.render_lines(rep)
    rep = st.add_alerts(_report(), "")
    assert rep["alerts"] is None and not any(ln.startswith("alerts") for ln in status_render.render_lines(rep))


def test_status_prometheus_unreachable_is_a_warning():
    rep = st.add_alerts(_report(), "http://127.0.0.1:9", timeout_s=0.5)
    assert rep["healthy"] and rep["warnings"][0].startswith("alerts not read: Prometheus http://127.0.0.1:9")
    assert "alerts (http://127.0.0.1:9): not read" in status_render.render_lines(rep)


# ---- the dashboard ---------------------------------------------------------------------------


def test_dashboard_json_is_the_generated_one():
    assert (ROOT / "monitoring" / "grafana" / "dsv41-offload.json").read_text() == D.render(), (
        "monitoring/grafana/dsv41-offload.json is stale: dsv41 monitor dashboard --out it"
    )


def test_dashboard_has_every_panel_and_annotation():
    doc = json.loads(D.render())
    titles = [p["title"] for p in doc["panels"] if p["type"] != "row"]
    assert titles == [p[0] for _r, ps in D.PANELS for p in ps]
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in doc["panels"] if p["type"] != "row")
    assert [a["name"] for a in doc["annotations"]["list"]] == [a[0] for a in D.ANNOTATIONS]
    assert doc["uid"] == D.UID and doc["templating"]["list"][0]["type"] == "datasource"


def test_dashboard_expressions_are_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's prometheus package (tools/install_prometheus.sh)")
    exprs = [e.replace("$__rate_interval", D.LAB_RATE_INTERVAL) for _t, e in D.expressions()]
    exprs += [a[1] for a in D.ANNOTATIONS]
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"dashboard:expr{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    f = tmp_path / "d.yml"
    f.write_text(yaml.safe_dump(rules))
    r = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- dsv41 monitor: bad input is one line ----------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["monitor", "rules", "--overrides", "[1]"],
        ["monitor", "rules", "--overrides", "{"],
        ["monitor", "rules", "--ranks", "a,b"],
        ["monitor", "rules", "--project", "/nonexistent"],
        ["monitor", "rules", "--overrides", '{"table_server_down": 3}'],
        ["monitor", "exporter", "--listen", "bad"],
        ["monitor", "dashboard", "--out", "/nonexistent/dir/x.json"],
    ],
)
def test_monitor_bad_input_one_line(argv, tmp_path):
    r = subprocess.run(
        [str(Path(sys.executable).parent / "dsv41"), *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("dsv41: error: ") and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1


def test_monitor_rules_prints_the_checked_in_file():
    r = subprocess.run(
        [str(Path(sys.executable).parent / "dsv41"), "monitor", "rules"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0 and r.stdout == (ROOT / "monitoring" / "prometheus" / "dsv41.rules.yml").read_text()


def test_render_draws_every_panel(fake, tmp_path):
    from dsv41.monitoring import render as R

    out = tmp_path / "d.png"
    drawn = R.render(fake.url, 100, 200, str(out), step_s=5, marks=[(150, "fault")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(drawn) == {p[0] for _r, ps in D.PANELS for p in ps} and all(n >= 1 for n in drawn.values())
    assert fake.range_queries == len(D.expressions()) + 1  # + the ALERTS spans


def test_render_unreachable_prometheus_is_one_error(tmp_path):
    from dsv41.monitoring import render as R

    with pytest.raises(R.Dsv41Error, match="query_range failed"):
        R.render("http://127.0.0.1:9", 0, 60, str(tmp_path / "x.png"))
