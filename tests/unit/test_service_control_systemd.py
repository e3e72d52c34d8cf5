"""roles/dsv41_service under systemd (production, the nspawn lab): tasks/control.yml (stop, start,
restart, kill, status) and tasks/wait.yml (the readiness wait), run by ansible-playbook itself on
localhost against a stand-in systemctl/journalctl on PATH (fake_systemd.py, systemd's output
shapes) - the modules (ansible.builtin.systemd_service) are the real ones.

Every action of control's argument spec is exercised (checked against its ``choices``): the state
facts are set after every action, kill included; systemd is reloaded only when a unit says
NeedDaemonReload=yes; a start of a unit that exhausted its restart budget clears it first
(reset-failed); stopping a stopped unit and starting an active one change nothing; check mode
makes no mutating call; a probe reports no change. A readiness wait that fails names the host, the
unit, its state and its last journal lines."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from servicectlutil import fake_bin
from serviceutil import ACTIONS, caller_roles, env, mutating_calls, play, run_playbook

A, I = "active", "inactive"  # noqa: E741 - one letter each keeps the case table below one row per case
# name: (units before {unit: (ActiveState, NeedDaemonReload)}, action, names, probe,
#        states after, changed, the mutating calls made)
CASES = {
    "stop_active": ({"a": (A, "no")}, "stop", ["a"], False, {"a": I}, True, ["stop a"]),
    "stop_inactive_is_a_noop": ({"a": (I, "no")}, "stop", ["a"], False, {"a": I}, False, []),
    "start_inactive": ({"a": (I, "no")}, "start", ["a"], False, {"a": A}, True, ["start a"]),
    "start_active_is_a_noop": ({"a": (A, "no")}, "start", ["a"], False, {"a": A}, False, []),
    "start_a_changed_unit_reloads_first": (
        {"a": (I, "yes")},
        "start",
        ["a"],
        False,
        {"a": A},
        True,
        ["daemon-reload", "start a"],
    ),
    "restart_reloads_once_for_two_units": (
        {"a": (A, "yes"), "b": (A, "yes")},
        "restart",
        ["a", "b"],
        False,
        {"a": A, "b": A},
        True,
        ["daemon-reload", "restart a", "restart b"],
    ),
    "start_failed_clears_the_start_limit_first": (
        {"a": ("failed", "no")},
        "start",
        ["a"],
        False,
        {"a": A},
        True,
        ["reset-failed -- a", "start a"],
    ),
    "stop_failed_keeps_it_failed": ({"a": ("failed", "no")}, "stop", ["a"], False, {"a": "failed"}, False, []),
    "restart_inactive_starts": ({"a": (I, "no")}, "restart", ["a"], False, {"a": A}, True, ["start a"]),
    "restart_probe_reports_no_change": ({"a": (A, "no")}, "restart", ["a"], True, {"a": A}, False, ["restart a"]),
    "kill_sets_the_states": (
        {"a": (A, "no")},
        "kill",
        ["a"],
        False,
        {"a": "activating"},
        True,
        ["kill --signal=KILL -- a"],
    ),
    "status_only_reads": (
        {"a": (A, "yes"), "b": (I, "no")},
        "status",
        ["a", "b", "c"],
        False,
        {"a": A, "b": I, "c": I},
        False,
        [],
    ),
}
MUTATING = ("start", "stop", "restart", "kill", "daemon-reload", "reset-failed", "enable", "disable")

TASK = """
    - name: Control {case}
      ansible.builtin.include_role:
        name: dsv41_service_caller
      vars:
        dsv41_service_caller_entry: control
        dsv41_service_control_names: {names}
        dsv41_service_control_action: {action}
        dsv41_service_control_probe: {probe}

    - name: Result of {case}
      ansible.builtin.copy:
        content: "{{{{ {{'changed': (dsv41_service_control_systemd is changed) or
                                    (dsv41_service_control_kill | default({{}}) is changed),
                       'states': dsv41_service_control_states,
                       'running': dsv41_service_control_running}} | to_json }}}}"
        dest: {out}
        mode: "0644"
      check_mode: false
"""


def _env(tmp: Path, state: Path) -> dict:
    return env(fake_bin(tmp), FAKE_SYSTEMD_STATE=str(state), ANSIBLE_ROLES_PATH=caller_roles(tmp))


def _calls(state: Path) -> list[str]:
    return mutating_calls(Path(str(state) + ".log"), MUTATING, "systemctl")


def _run_case(tmp: Path, case: str, check: bool) -> tuple[dict, list[str]]:
    before, action, names, probe, *_ = CASES[case]
    d = tmp / case
    d.mkdir()
    state = d / "state.json"
    state.write_text(
        json.dumps({"units": {n: {"ActiveState": s, "NeedDaemonReload": r} for n, (s, r) in before.items()}})
    )
    Path(str(state) + ".log").write_text("")
    out = d / "out.json"
    (d / "play.yml").write_text(
        play(
            "systemd", TASK.format(case=case, names=json.dumps(names), action=action, probe=str(probe).lower(), out=out)
        )
    )
    run_playbook("localhost,", d / "play.yml", d, _env(d, state), check=check)
    return json.loads(out.read_text()), _calls(state)


def test_the_cases_cover_every_action_of_the_argument_spec():
    assert {c[1] for c in CASES.values()} == set(ACTIONS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_control_systemd(tmp_path, case):
    before, action, names, probe, after, changed, calls = CASES[case]
    res, made = _run_case(tmp_path, case, check=False)
    assert made == calls
    assert res["states"] == after
    assert res["running"] == {n: s == A for n, s in after.items()}
    assert res["changed"] is changed


@pytest.mark.parametrize(
    "case",
    [
        "stop_active",
        "start_a_changed_unit_reloads_first",
        "kill_sets_the_states",
        "restart_reloads_once_for_two_units",
        "status_only_reads",
    ],
)
def test_check_mode_makes_no_mutating_call(tmp_path, case):
    before, *_ = CASES[case]
    res, made = _run_case(tmp_path, case, check=True)
    assert made == []
    # the facts are what systemd says now (nothing was changed)
    assert res["states"] == {n: before.get(n, (I, "no"))[0] for n in CASES[case][2]}


WAIT_TASKS = """
    - name: Readiness
      ansible.builtin.include_role:
        name: dsv41_service_caller
      vars:
        dsv41_service_caller_entry: wait
        dsv41_service_name: dsv41-bad
        dsv41_service_command: /bin/false
        dsv41_service_env_file: /nonexistent.env
        dsv41_service_ready_host: 127.0.0.1
        dsv41_service_ready_port: {port}
        dsv41_service_ready_retries: 1
        dsv41_service_ready_delay: 1
        dsv41_service_log_lines: 3
"""


def test_a_failed_readiness_wait_names_the_unit_and_its_last_journal_lines(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tmp_path / "state.json"
    journal = [f"line {i}" for i in range(5)] + ["dsv41: DSV41_METRICS_MAX_CONNECTIONS: not an integer: 'many'"]
    state.write_text(
        json.dumps(
            {
                "units": {
                    "dsv41-bad": {
                        "ActiveState": "failed",
                        "NeedDaemonReload": "no",
                        "NRestarts": 5,
                        "Result": "exit-code",
                        "journal": journal,
                    }
                }
            }
        )
    )
    Path(str(state) + ".log").write_text("")
    (tmp_path / "play.yml").write_text(play("systemd", WAIT_TASKS.format(port=port)))
    r = run_playbook("localhost,", tmp_path / "play.yml", tmp_path, _env(tmp_path, state), timeout=300, ok=False)
    assert r.returncode != 0
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("[ERROR]: Task failed") and "is not ready" in ln]
    assert len(fails) == 1, r.stdout[-4000:]
    msg = fails[0]
    m = re.search(r"localhost: dsv41-bad\.service is not ready \(127\.0\.0\.1:\d+ after 1 s; ([^)]*)\)", msg)
    assert m and set(m[1].split()) == {"ActiveState=failed", "SubState=running", "Result=exit-code", "NRestarts=5"}, msg
    # the last 3 journal lines, in order, and only those
    assert msg.endswith("its last journal lines: line 3 | line 4 | " + journal[-1]), msg
    assert _calls(state) == []
