"""roles/dsv41 tasks/reach.yml, the first contact of every entry playbook with a host: each cause
in ``dsv41_access_causes`` (roles/dsv41/defaults) is a case, enumerated from the table itself.

ansible-playbook runs the real tasks against a stand-in ``ssh`` (``ansible_ssh_executable``) that
prints OpenSSH's own message and exits 255, as ssh does when it cannot connect or log in, and a
stand-in ``sudo`` (``ansible_become_exe``) that prints sudo's refusal and exits 1. The host must
fail with one line naming it and the cause, and nothing after the contact may run. The lab runs
the same faults for real (tests/integration/test_reach_lab.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from serviceutil import REPO, env, run_playbook

CAUSES = yaml.safe_load((REPO / "roles/dsv41/defaults/main.yml").read_text())["dsv41_access_causes"]

# Messages as OpenSSH's ssh(1) and sudo(8) print them; (tool, message) per case, every cause at
# least once (test_every_cause_has_a_case). The key_file and host_key cases end in the same
# "Permission denied" a refused login does: the table's order must name the first cause.
MESSAGES = [
    (
        "key_file",
        "ssh",
        "Warning: Identity file /srv/keys/gone not accessible: No such file or directory.\n"
        "ops@198.18.0.13: Permission denied (publickey).",
    ),
    (
        "key_file",
        "ssh",
        "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n"
        "@         WARNING: UNPROTECTED PRIVATE KEY FILE!          @\n"
        "Permissions 0644 for '/srv/keys/id' are too open.\n"
        'Load key "/srv/keys/id": bad permissions\nops@198.18.0.13: Permission denied (publickey).',
    ),
    (
        "host_key",
        "ssh",
        "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n"
        "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n"
        "Host key for 198.18.0.13 has changed and you have requested strict checking.\n"
        "Host key verification failed.",
    ),
    (
        "host_key",
        "ssh",
        "No ED25519 host key is known for 198.18.0.13 and you have requested strict checking.\n"
        "Host key verification failed.",
    ),
    ("login", "ssh", "intruder@198.18.0.13: Permission denied (publickey)."),
    ("login", "ssh", "Received disconnect from 198.18.0.13 port 22:2: Too many authentication failures"),
    ("sudo", "sudo", "sudo: a password is required"),
    ("sudo", "sudo", "ops is not in the sudoers file."),
    ("refused", "ssh", "ssh: connect to host 198.18.0.13 port 22: Connection refused"),
    ("no_route", "ssh", "ssh: connect to host 198.18.0.99 port 22: Connection timed out"),
    ("no_route", "ssh", "ssh: connect to host 198.18.0.13 port 22: No route to host"),
    ("no_route", "ssh", "ssh: Could not resolve hostname x86host.invalid: Name or service not known"),
]
STANDIN = """#!/bin/sh
printf '%s\\n' "$FAKE_MESSAGE" >&2
exit {rc}
"""
PLAY = """
- name: First contact
  hosts: all
  gather_facts: false
  tasks:
    - name: Reach
      ansible.builtin.include_role:
        name: dsv41
        tasks_from: reach
    - name: After the contact
      ansible.builtin.command: /bin/true
      changed_when: false
"""
ADDRESS, LOGIN, KEY = "198.18.0.13", "ops", "/srv/keys/id_ed25519"


def _run(tmp: Path, tool: str | None, message: str = "", *extra: str, check: bool = False):
    for name, rc in (("ssh", 255), ("sudo", 1)):
        p = tmp / name
        p.write_text(STANDIN.format(rc=rc))
        p.chmod(0o755)
    (tmp / "play.yml").write_text(PLAY)
    if tool == "ssh":
        conn = (
            f"ansible_connection=ssh ansible_ssh_executable={tmp / 'ssh'} ansible_host={ADDRESS} "
            f"ansible_user={LOGIN} ansible_ssh_private_key_file={KEY} ansible_become=true"
        )
    elif tool == "sudo":  # local: the become is what fails (a user other than root, so it is not skipped)
        conn = (
            f"ansible_connection=local ansible_become=true ansible_become_user=dsv41probe "
            f"ansible_become_exe={tmp / 'sudo'} ansible_user={LOGIN}"
        )
    else:
        conn = "ansible_connection=local ansible_user=root"
    (tmp / "hosts.ini").write_text(f"x86host {conn} ansible_python_interpreter=/usr/bin/python3 {' '.join(extra)}\n")
    r = run_playbook(
        tmp / "hosts.ini",
        tmp / "play.yml",
        REPO,
        env(FAKE_MESSAGE=message, ANSIBLE_CALLBACK_RESULT_FORMAT="json"),
        check=check,
        ok=False,
        timeout=120,
    )
    return r


def _failure(out: str) -> str:
    """The one failure the contact reports (a become refusal's own failure is ignored, then explained)."""
    msgs = [
        json.loads(ln.split(" => ", 1)[1])["msg"]
        for ln in out.splitlines()
        if ln.startswith("fatal: [x86host]: FAILED! => ")
    ]
    ours = [m for m in msgs if m.startswith("x86host: ")]
    assert len(ours) == 1 and len(msgs) <= 2, out[-3000:]
    return ours[0]


def _expected(cause: dict, user: str, become_user: str) -> str:
    text = cause["cause"]
    for k, v in {
        "host": "x86host",
        "address": ADDRESS,
        "port": "22",
        "user": user,
        "key": KEY,
        "become_user": become_user,
    }.items():
        text = text.replace("{" + k + "}", v)
    return text


def test_every_cause_has_a_case():
    assert [c["id"] for c in CAUSES] == list(dict.fromkeys(c["id"] for c in CAUSES)), "ids repeat"
    assert {c["id"] for c in CAUSES} == {m[0] for m in MESSAGES}
    for c in CAUSES:
        re.compile(c["search"])
        assert set(re.findall(r"\{(\w+)\}", c["cause"])) <= {"host", "address", "port", "user", "key", "become_user"}, c


@pytest.mark.parametrize(("cause_id", "tool", "message"), MESSAGES, ids=[f"{m[0]}-{i}" for i, m in enumerate(MESSAGES)])
def test_each_cause_fails_the_host_with_one_line_naming_it(tmp_path, cause_id, tool, message):
    r = _run(tmp_path, tool, message)
    assert r.returncode != 0
    msg = _failure(r.stdout)
    (cause,) = [c for c in CAUSES if c["id"] == cause_id]
    want = _expected(cause, LOGIN, "dsv41probe" if tool == "sudo" else "root")
    assert msg.startswith(f"x86host: {want} ["), msg
    assert "\n" not in msg and message.splitlines()[-1].strip() in msg, msg
    matched = [ln for ln in message.splitlines() if re.search(cause["search"], ln) and not ln.startswith("@")][0]
    assert matched in msg, msg
    assert "TASK [After the contact]" not in r.stdout


def test_a_message_no_cause_matches_still_names_the_host(tmp_path):
    r = _run(tmp_path, "ssh", "ssh: something nobody has seen before")
    msg = _failure(r.stdout)
    assert msg.startswith("x86host: cannot be reached [") and msg.endswith("ssh: something nobody has seen before]"), (
        msg
    )


@pytest.mark.parametrize("check", [False, True])
def test_a_reachable_host_goes_on(tmp_path, check):
    r = _run(tmp_path, None, check=check)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "TASK [After the contact]" in r.stdout and "FAILED" not in r.stdout


def test_a_host_that_logs_in_as_someone_else_is_stopped(tmp_path):
    # become off and the login not the user the commands run as (root here): the contact says so
    r = _run(tmp_path, None, "", "ansible_become=false", "ansible_user=ops")
    assert (
        _failure(r.stdout) == "x86host: commands run as root, not as ops: check ansible_become and ansible_become_user"
    )
