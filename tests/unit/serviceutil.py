"""Shared by the tests of roles/dsv41_service's control body (tests/unit/test_service_control_systemd.py)
and of roles/serve's pair restart (test_serve_pair_restart.py), against a stand-in systemctl:
the control action choices of the role's argument spec, the localhost play, the environment and
the ``ansible-playbook`` run, and reading the calls a stand-in logged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SPEC = yaml.safe_load((REPO / "roles" / "dsv41_service" / "meta" / "argument_specs.yml").read_text())
#: Every ``dsv41_service_control_action`` the role's argument spec admits (the cases must cover them).
ACTIONS = SPEC["argument_specs"]["control"]["options"]["dsv41_service_control_action"]["choices"]

PLAY = """
- hosts: localhost
  gather_facts: false
  vars:
    ansible_connection: local
    ansible_python_interpreter: {py}
    dsv41_service_manager: {manager}
  tasks:
{tasks}
"""


def play(manager: str, tasks: str) -> str:
    """A play on localhost (local connection, this Python) with ``dsv41_service_manager: manager``
    running ``tasks`` (YAML text, indented as list items of ``tasks:``)."""
    return PLAY.format(py=sys.executable, manager=manager, tasks=tasks)


#: A role standing in for the project's roles that include roles/dsv41_service (the role refuses a
#: play as its caller): it includes the entry point ``dsv41_service_caller_entry`` with the
#: including task's variables.
CALLER_ROLE = """---
- name: Include roles/dsv41_service from a role
  ansible.builtin.include_role:
    name: dsv41_service
    tasks_from: "{{ dsv41_service_caller_entry }}"
"""


def caller_roles(directory: Path) -> str:
    """Write the caller role (role ``dsv41_service_caller``) under ``directory``/roles; returns the
    roles path (it, then the repository's roles) for ``ANSIBLE_ROLES_PATH``."""
    tasks = directory / "roles" / "dsv41_service_caller" / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "main.yml").write_text(CALLER_ROLE)
    return f"{directory / 'roles'}:{REPO / 'roles'}"


def env(path_first: str | os.PathLike | None = None, **extra: str) -> dict:
    """The environment of an ``ansible-playbook`` run: the repository's ansible.cfg, this venv's
    bin first on PATH (after ``path_first``, a directory of stand-in tools), no colour, ``extra``."""
    path = f"{BIN}:{os.environ['PATH']}"
    return dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_FORCE_COLOR="0",
        NO_COLOR="1",
        PATH=f"{path_first}:{path}" if path_first else path,
        **extra,
    )


def run_playbook(
    inventory: str | os.PathLike,
    playbook: Path,
    cwd: Path,
    environ: dict,
    *,
    check: bool = False,
    timeout: int = 600,
    ok: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``ansible-playbook -i inventory playbook`` (``--check`` when asked) in ``cwd``; with
    ``ok`` the run must succeed (its output's tail is the failure message)."""
    r = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(playbook), *(["--check"] if check else [])],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if ok:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return r


def mutating_calls(log: Path, mutating: tuple[str, ...], first: str | None = None) -> list[str]:
    """The calls a stand-in logged to ``log`` (lines ``WHO VERB ARGS...``) whose verb is in
    ``mutating``, without ``WHO``; only those of ``first`` (a host or a tool) when given."""
    lines = log.read_text().splitlines()
    return [
        line.split(None, 1)[1]
        for line in lines
        if (first is None or line.split()[0] == first) and line.split()[1] in mutating
    ]
