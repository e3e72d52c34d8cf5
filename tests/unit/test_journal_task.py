"""Every promotion journal append goes through one task file (roles/promotion/tasks/journal.yml),
called with the entry's fields; run by ansible-playbook itself it writes one entry per host, or
one for the play with promotion_journal_once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TASK_FILE = REPO / "roles" / "promotion" / "tasks" / "journal.yml"


def _tasks(tasks):
    for t in tasks or []:
        yield t
        for key in ("block", "rescue", "always"):
            yield from _tasks(t.get(key))


def _all_tasks():
    """(file, task) for every task of every playbook and role task file."""
    for path in sorted(REPO.glob("*.yml")) + sorted((REPO / "playbooks").glob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        for play in doc if isinstance(doc, list) else []:
            for key in ("pre_tasks", "tasks", "post_tasks", "handlers"):
                for t in _tasks(play.get(key)):
                    yield path, t
    for path in sorted((REPO / "roles").glob("*/tasks/*.yml")) + sorted((REPO / "roles").glob("*/handlers/*.yml")):
        for t in _tasks(yaml.safe_load(path.read_text())):
            yield path, t


def test_only_the_task_file_appends_to_the_journal():
    appends = [
        (p.relative_to(REPO).as_posix(), t["name"])
        for p, t in _all_tasks()
        if (t.get("promotion_journal") or {}).get("action") == "append"
    ]
    assert appends == [("roles/promotion/tasks/journal.yml", "Promotion | journal {{ promotion_journal_step }}")]


def test_every_call_names_op_and_step():
    calls = [
        (p.relative_to(REPO).as_posix(), t)
        for p, t in _all_tasks()
        if (t.get("ansible.builtin.include_role") or {}).get("tasks_from") == "journal"
    ]
    # the change role's steps (begin, apply, finish) journal for every operation; the rest are
    # promote's own steps (applied per host, failed), the package record and deploy's finish
    files = {name for name, _ in calls}
    change = {f"roles/change/tasks/{step}.yml" for step in ("begin", "apply", "finish")}
    others = {
        "roles/promote/tasks/offload.yml",
        "roles/promote/tasks/spark.yml",
        "roles/promotion/tasks/revert.yml",
        "roles/promotion/tasks/record_store.yml",
        "roles/deploy/tasks/finish.yml",
    }
    assert change | others <= files, files
    for name, t in calls:
        assert t["ansible.builtin.include_role"]["name"] == "promotion", name
        assert {"promotion_journal_op", "promotion_journal_step"} <= set(t["vars"]), f"{name}: {t['name']}"


PLAY = """
- hosts: spark:offload
  gather_facts: false
  roles: [dsv41]  # as every play of the project: the shared defaults (dsv41_packages_dir)
  tasks:
    - name: One entry per host
      ansible.builtin.include_role:
        name: promotion
        tasks_from: journal
      vars:
        promotion_journal_op: op1
        promotion_journal_step: applied
        promotion_journal_fields: {host: "{{ inventory_hostname }}"}
    - name: One entry for the play
      ansible.builtin.include_role:
        name: promotion
        tasks_from: journal
      vars:
        promotion_journal_op: op1
        promotion_journal_step: verified
        promotion_journal_once: true
"""


def test_the_task_file_writes_the_entries(tmp_path):
    (tmp_path / "play.yml").write_text(PLAY)
    journal = tmp_path / "journal.jsonl"
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        PATH=f"{BIN}:{os.environ['PATH']}",
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
        ANSIBLE_LIBRARY=str(REPO / "library"),
    )
    r = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(REPO / "inventories" / "sim"),
            "play.yml",
            "-e",
            json.dumps(
                {
                    "ansible_connection": "local",
                    "promotion_journal": str(journal),
                    "ansible_python_interpreter": sys.executable,
                }
            ),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    assert sorted(e["host"] for e in entries if e["step"] == "applied") == ["sparkhead", "sparkworker", "x86host"]
    assert [e["op"] for e in entries if e["step"] == "verified"] == ["op1"]
    assert all(e["op"] == "op1" for e in entries)
