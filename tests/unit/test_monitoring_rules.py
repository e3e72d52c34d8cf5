"""roles/monitoring's rules: `promtool check rules` on the production and the lab rendering,
`promtool test rules` on every case of tests/monitoring/rules_cases.yml, every alert covered by a
case where it fires and one where it stays silent, and the checked-in operator copy
(monitoring/prometheus/dsv41.rules.yml) equal to a fresh rendering."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dsv41.monitoring import rules

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "monitoring" / "rules_cases.yml"
CHECKED_IN = ROOT / "monitoring" / "prometheus" / "dsv41.rules.yml"
LAB_VARS = ROOT / "inventories" / "sim" / "group_vars" / "all.yml"


def promtool() -> str:
    p = shutil.which("promtool")
    if p is None:
        pytest.fail(
            "promtool not found: install Debian's prometheus package (tools/install_prometheus.sh; .ci/run does)"
        )
    return p


def alerts_of(text: str) -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(text)["groups"] for r in g["rules"] if "alert" in r}


def _fill(template: str, labels: dict) -> str:
    # the rules' annotations use only {{ $labels.NAME }} (no $value), so the expectation is exact
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def promtool_tests(text: str) -> dict:
    """The promtool test file for the cases, expected annotations filled from the rules."""
    alerts = alerts_of(text)
    tests = []
    for case in yaml.safe_load(CASES.read_text())["cases"]:
        art = []
        for chk in case["checks"]:
            rule = alerts[chk["alert"]]
            exp = []
            for extra in chk["fires"]:
                labels = {**{str(k): str(v) for k, v in extra.items()}, **rule["labels"]}
                exp.append(
                    {
                        "exp_labels": labels,
                        "exp_annotations": {k: _fill(v, labels) for k, v in rule["annotations"].items()},
                    }
                )
            art.append({"eval_time": chk["at"], "alertname": chk["alert"], "exp_alerts": exp})
        tests.append(
            {"name": case["name"], "interval": case["interval"], "input_series": case["series"], "alert_rule_test": art}
        )
    return {"rule_files": ["dsv41.rules.yml"], "evaluation_interval": "1m", "tests": tests}


def lab_overrides() -> dict:
    return yaml.safe_load(LAB_VARS.read_text()).get("monitoring_alert_overrides", {})


def test_checked_in_rules_are_the_rendering():
    assert CHECKED_IN.read_text() == rules.render(ROOT), (
        "monitoring/prometheus/dsv41.rules.yml is stale: python -m dsv41.cli monitor rules > it"
    )


@pytest.mark.parametrize("which", ["production", "lab"])
def test_promtool_check_rules(tmp_path, which):
    f = tmp_path / "dsv41.rules.yml"
    f.write_text(rules.render(ROOT, lab_overrides() if which == "lab" else None))
    r = subprocess.run([promtool(), "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_fires_and_stays_silent_in_some_case():
    alerts = set(alerts_of(rules.render(ROOT)))
    fired, silent = set(), set()
    for case in yaml.safe_load(CASES.read_text())["cases"]:
        for chk in case["checks"]:
            assert chk["alert"] in alerts, f"case {case['name']!r} names an alert the rules lack: {chk['alert']}"
            (fired if chk["fires"] else silent).add(chk["alert"])
    assert alerts - fired == set(), f"alerts without a case where they fire: {sorted(alerts - fired)}"
    assert alerts - silent == set(), f"alerts without a case where they stay silent: {sorted(alerts - silent)}"


def test_promtool_test_rules(tmp_path):
    text = rules.render(ROOT)
    (tmp_path / "dsv41.rules.yml").write_text(text)
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(promtool_tests(text), sort_keys=False))
    r = subprocess.run(
        [promtool(), "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "SUCCESS" in r.stdout


def test_promtool_test_rules_catches_a_wrong_expectation(tmp_path):
    """The harness is not vacuous: a case expecting the wrong rank fails promtool."""
    text = rules.render(ROOT)
    doc = promtool_tests(text)
    first = doc["tests"][0]
    for art in first["alert_rule_test"]:
        for e in art["exp_alerts"]:
            e["exp_labels"]["rank"] = "7"
    doc["tests"] = [first]
    (tmp_path / "dsv41.rules.yml").write_text(text)
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run(
        [promtool(), "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0
