"""Data is never code: a candidate, or a window arm file, with Jinja template syntax in any field
is refused before it reaches Ansible, and the arm file is loaded the way window_switch.yml loads
it (roles/dsv41 tasks/arm.yml, then tasks/candidate.yml) by ansible-playbook itself: with a
`lookup('pipe', ...)` in every field nothing runs. A control run with the old `-e @file` load
shows the probe would have fired."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv41.harness import candidates as C

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SHIPPED = sorted(p.stem for p in (REPO / "candidates").glob("*.yml"))


def _probe(marker: Path) -> str:
    return "{{ lookup('ansible.builtin.pipe', 'touch " + str(marker) + "') }}"


def _string_fields(doc, path=()):
    """Every (path, value) of a string in a candidate document, keys included (as ('key', path))."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield ("key", path + (k,)), k
            yield from _string_fields(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _string_fields(v, path + (i,))
    elif isinstance(doc, str):
        yield path, doc


def _set(doc, path, value, key=False):
    d = doc
    for p in path[:-1]:
        d = d[p]
    if key:
        d[value] = d.pop(path[-1])
    else:
        d[path[-1]] = value


@pytest.mark.parametrize("name", SHIPPED)
def test_template_syntax_in_any_field_of_a_candidate_is_refused(name, tmp_path):
    base = yaml.safe_load((REPO / "candidates" / f"{name}.yml").read_text())
    base.setdefault("roles", {}).setdefault("serve", {}).setdefault("env", {})["DSV41_ENGINE_THREADS"] = "2"
    fields = list(_string_fields(base))
    assert len(fields) >= 8
    for where, _value in fields:
        for mark in ("{{ 7*7 }}", "{% if 1 %}x{% endif %}", "{# c #}"):
            doc = json.loads(json.dumps(base))
            if where[0] == "key":
                if where[1] == ("name",) or len(where[1]) < 2:
                    continue  # top-level keys are fixed by the schema (additionalProperties false)
                _set(doc, where[1], "DSV41_X" + mark, key=True)
            elif where == ("name",):
                continue  # the file name is checked as a name (test_names_are_names)
            else:
                _set(doc, where, "x" + mark)
            d = tmp_path / f"c{abs(hash((where, mark)))}"
            d.mkdir()
            (d / f"{name}.yml").write_text(yaml.safe_dump(doc))
            with pytest.raises(C.CandidateError):
                C.load_checked(name, d)


def _arm(marker: Path) -> dict:
    probe = _probe(marker)
    arm = {var: probe for var in C.ROLE_VARS.values()}
    arm["serve_extra_env"] = {"DSV41_ENGINE_THREADS": probe, probe: "1"}
    arm["engram_server_extra_env"] = {"DSV41_ENGRAM_FAULT_DELAY_MS": probe}
    return {"window_arm": arm, "window_switch_roles": ["serve", probe]}


def _play(tmp: Path, extra: list[str], tasks: list[dict]) -> subprocess.CompletedProcess:
    play = tmp / "play.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "load an arm as window_switch.yml does",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "roles": [{"role": "dsv41"}],
                    "tasks": tasks,
                }
            ],
            sort_keys=False,
        )
    )
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
        PATH=f"{BIN}:{os.environ['PATH']}",
        PYTHONPATH=str(REPO / "python"),
    )
    return subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(REPO / "inventories" / "sim"),
            str(play),
            "-e",
            json.dumps({"ansible_connection": "local", "ansible_python_interpreter": sys.executable}),
            *extra,
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _switch_load_tasks() -> list[dict]:
    """window_switch.yml's own load: its arm task and its candidate task, as written."""
    tasks = yaml.safe_load((REPO / "playbooks" / "window_switch.yml").read_text())[0]["tasks"]
    # the play's body is the window role's entry point it imports
    imp = tasks[0]["ansible.builtin.import_role"]
    tasks = yaml.safe_load((REPO / "roles" / imp["name"] / "tasks" / f"{imp['tasks_from']}.yml").read_text())
    want = [t for t in tasks if (t.get("ansible.builtin.include_role") or {}).get("tasks_from") in ("arm", "candidate")]
    assert [t["ansible.builtin.include_role"]["tasks_from"] for t in want] == ["arm", "candidate"]
    return want + [{"name": "use every value", "ansible.builtin.debug": {"msg": "{{ dsv41_arm | to_json }}"}}]


def test_an_arm_with_template_syntax_everywhere_runs_nothing(tmp_path):
    marker = tmp_path / "RAN"
    arm_file = tmp_path / "arm.json"
    arm_file.write_text(json.dumps(_arm(marker)))
    r = _play(tmp_path, ["-e", f"window_arm_file={arm_file}"], _switch_load_tasks())
    assert r.returncode != 0 and "template syntax" in r.stdout, r.stdout[-3000:]
    assert not marker.exists()
    # the control: the load window_switch.yml used before (-e @file) runs the probe
    control = tmp_path / "control"
    control.mkdir()
    r = _play(
        control, ["-e", f"@{arm_file}"], [{"name": "use it", "ansible.builtin.debug": {"msg": "{{ window_arm }}"}}]
    )
    assert marker.exists(), "the probe is not a probe: the old load did not run it either"


def test_a_module_result_is_data_even_unchecked(tmp_path):
    """Ansible's half on its own: JSON that a command printed, through from_json and set_fact (the
    arm task's path) stays a string when used, even with no refusal in front of it."""
    marker = tmp_path / "RAN"
    f = tmp_path / "raw.json"
    f.write_text(json.dumps(_arm(marker)))
    r = _play(
        tmp_path,
        [],
        [
            {
                "name": "read",
                "ansible.builtin.command": {"argv": ["cat", str(f)]},
                "register": "raw",
                "changed_when": False,
            },
            {"name": "keep", "ansible.builtin.set_fact": {"dsv41_arm": "{{ (raw.stdout | from_json).window_arm }}"}},
            {"name": "use", "ansible.builtin.debug": {"msg": "{{ dsv41_arm.serve_extra_env.DSV41_ENGINE_THREADS }}"}},
        ],
    )
    assert r.returncode == 0, r.stdout[-3000:]
    assert not marker.exists() and "ansible.builtin.pipe" in r.stdout  # printed, not run
