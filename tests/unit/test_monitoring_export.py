"""`monitoring.yml --tags monitoring_export` (controller files for an existing Prometheus) on an
inventory of three hosts: file_sd targets per job from the inventory, the rules with the
inventory's overrides, and `promtool check config` on a Prometheus configuration made of the
exported scrape_configs snippet and rules (what docs/operations.md tells an operator to do)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

INVENTORY = {
    "all": {
        "vars": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "dsv41_lab": False,
            "dsv41_project_dir": str(ROOT),
            "dsv41_service_manager": "systemd",
            "monitoring_alert_overrides": {"table_server_down": {"for": "1m"}},
            "monitoring_ops_exporter_target": "10.0.0.5:9461",
        },
        "children": {
            "spark": {
                "hosts": {
                    "sparkhead": {"dsv41_rank": 0, "dsv41_mgmt_address": "10.0.0.11"},
                    "sparkworker": {
                        "dsv41_rank": 1,
                        "dsv41_mgmt_address": "10.0.0.12",
                        "monitoring_node_exporter": False,
                    },
                }
            },
            "offload": {"hosts": {"x86host": {"dsv41_mgmt_address": "10.0.0.13"}}},
        },
    }
}


def _export(tmp_path_factory, inventory: dict) -> Path:
    d = tmp_path_factory.mktemp("export")
    inv = d / "hosts.yml"
    inv.write_text(yaml.safe_dump(inventory))
    out = d / "out"
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    )
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            str(inv),
            "monitoring.yml",
            "--tags",
            "monitoring_export",
            "-e",
            f"monitoring_export_dir={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export(tmp_path_factory, INVENTORY)


def test_the_stock_stage_has_no_overlay_targets_and_no_rank_rule(tmp_path_factory):
    """vLLM with remote Engram and remote drafting off (the bring-up's stock stage): no rank runs
    the overlay, so there is no dsv41-overlay target to find down and no rank whose counters can
    be missing (a lost rank shows as Dsv41ApiDown)."""
    inv = json.loads(json.dumps(INVENTORY))
    inv["all"]["vars"] |= {"engram_overlay_remote": False, "spec_decode_enabled": False}
    out = _export(tmp_path_factory, inv)
    assert json.loads((out / "file_sd" / "dsv41-overlay.json").read_text()) == []
    rules = (out / "dsv41.rules.yml").read_text()
    assert "Dsv41TPRankMissing" not in rules and "Dsv41ApiDown" in rules
    yaml.safe_load(rules)


def test_targets_per_job_from_the_inventory(exported):
    t = {p.stem: json.loads(p.read_text()) for p in (exported / "file_sd").glob("*.json")}
    assert sorted(t) == [
        "dsv41-api",
        "dsv41-drafter-worker",
        "dsv41-ops",
        "dsv41-overlay",
        "dsv41-table-server",
        "node",
    ]
    # the inventory serves with vLLM (dsv41_lab false): each Spark's overlay endpoint, no rank label
    assert t["dsv41-overlay"] == [
        {"targets": ["10.0.0.11:9471"], "labels": {"host": "sparkhead", "dsv41_role": "spark"}},
        {"targets": ["10.0.0.12:9471"], "labels": {"host": "sparkworker", "dsv41_role": "spark"}},
    ]
    assert t["dsv41-api"] == [{"targets": ["10.0.0.11:8000"], "labels": {"host": "sparkhead", "dsv41_role": "spark"}}]
    assert t["dsv41-table-server"] == [
        {"targets": ["10.0.0.13:9441"], "labels": {"host": "x86host", "dsv41_role": "offload"}}
    ]
    assert t["dsv41-drafter-worker"][0]["targets"] == ["10.0.0.13:9451"]
    assert t["dsv41-ops"][0]["targets"] == ["10.0.0.5:9461"]
    # node metrics where present: every host but the one that opted out
    assert sorted(g["labels"]["host"] for g in t["node"]) == ["sparkhead", "x86host"]


def test_rules_carry_the_inventory_overrides(exported):
    rules = yaml.safe_load((exported / "dsv41.rules.yml").read_text())
    down = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "Dsv41TableServerDown"]
    assert down[0]["for"] == "1m"


def test_promtool_check_config_on_the_exported_files(exported, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's prometheus package (tools/install_prometheus.sh)")
    cfg = {
        "global": {"scrape_interval": "15s"},
        "rule_files": [str(exported / "dsv41.rules.yml")],
        "scrape_configs": yaml.safe_load((exported / "scrape_configs.yml").read_text()),
    }
    f = tmp_path / "prometheus.yml"
    f.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([promtool, "check", "config", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_role_variable_has_an_argument_spec():
    role = ROOT / "roles" / "monitoring"
    defaults = set(yaml.safe_load((role / "defaults" / "main.yml").read_text()))
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    for entry in ("main", "export"):
        opts = set(specs[entry]["options"])
        assert defaults - opts == set(), (entry, sorted(defaults - opts))
        assert opts - defaults == set(), (entry, sorted(opts - defaults))
    alerts = yaml.safe_load((role / "defaults" / "main.yml").read_text())["monitoring_alerts"]
    assert all("for" in v for v in alerts.values()), "every alert's for: is a variable"
