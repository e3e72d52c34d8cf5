"""drill.yml passes no serve runtime of its own: without ``-e drill_serve_container`` the argv it
templates (Ansible's own Templar) names no runtime, whatever the head Spark's serve_* say (``dsv41
drill`` asks the host); with it, the flag; the override must be a boolean; the argv is accepted by
``dsv41 drill clear``. How the drill finds the engine for each runtime: test_drill_engine_pid.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsv41.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _drill_vars() -> dict:
    plays = yaml.safe_load((ROOT / "playbooks" / "drill.yml").read_text())
    return next(p["vars"] for p in plays if "drill_common_args" in p.get("vars", {}))


def _template(expr, variables: dict, tmp_path: Path):
    """``expr`` templated by Ansible's own Templar with ``variables`` (written to a file and loaded
    as Ansible loads a playbook: trusted as templates, so nested variables resolve too)."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar

    f = tmp_path / "vars.yml"
    f.write_text(yaml.safe_dump({"x": expr, **variables}))
    loader = DataLoader()
    doc = loader.load_from_file(str(f), cache="none", trusted_as_template=True)
    return Templar(loader=loader, variables=doc).template(doc["x"])


# The head Spark's variables the role would decide by: none of them changes what drill.yml passes.
HEADS = [
    {},
    {"serve_runtime": "vllm"},
    {"serve_container": True},
    {"serve_container": False, "serve_runtime": "vllm"},
    {"serve_container_runtime": "/opt/bin/docker"},
]


OVERRIDES = {
    "unset": (None, []),
    "true": ("true", ["--serve-container"]),
    "false": ("false", ["--plain-engine"]),
    "yaml true": (True, ["--serve-container"]),
}


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("inv", HEADS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "defaults")
def test_drill_yml_passes_only_the_operators_runtime(inv: dict, override: str, tmp_path: Path, capsys) -> None:
    """Without ``-e drill_serve_container`` the argv names no runtime (dsv41 drill asks the host),
    whatever the head Spark's serve_* say; with it, the flag; ``--container-runtime`` only from an
    inventory that sets it. The argv gets ``dsv41 drill clear`` past every option check."""
    value, flag = OVERRIDES[override]
    head = {"dsv41_lab": True, **inv, "dsv41_lab_dir": str(tmp_path / "nolab"), "dsv41_service_manager": "systemd"}
    play = {**_drill_vars(), "hostvars": {"sparkhead": head}, "drill_head": "sparkhead", "drill_link": "sparkhead:ofl0"}
    if value is not None:
        play["drill_serve_container"] = value
    args = list(_template("{{ drill_common_args }}", play, tmp_path))
    runtime = ["--container-runtime", inv["serve_container_runtime"]] if "serve_container_runtime" in inv else []
    assert args == [
        "--link",
        "sparkhead:ofl0",
        "--lab-dir",
        head["dsv41_lab_dir"],
        "--service-manager",
        "systemd",
        *runtime,
        *flag,
    ], args
    assert main(["drill", "clear", "--faults", "all", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the lab is not up" in err[0], err


@pytest.mark.parametrize(
    "value, ok",
    [
        (None, True),
        ("true", True),
        ("false", True),
        (True, True),
        (False, True),
        ("True", True),
        ("maybe", False),
        ("", False),
        ("yes", False),
    ],
)
def test_drill_yml_refuses_an_override_that_is_not_a_boolean(value, ok: bool, tmp_path: Path) -> None:
    """The first play's check of ``-e drill_serve_container`` (before production is even read)."""
    tasks = yaml.safe_load((ROOT / "roles" / "drill" / "tasks" / "check.yml").read_text())
    task = next(t for t in tasks if "drill_serve_container" in t["name"])
    that = task["ansible.builtin.assert"]["that"]
    assert len(that) == 1
    got = _template("{{ " + that[0] + " }}", {} if value is None else {"drill_serve_container": value}, tmp_path)
    assert bool(yaml.safe_load(str(got))) is ok, (value, got)
