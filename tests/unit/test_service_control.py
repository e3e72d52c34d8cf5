"""roles/dsv41_service tasks/control.yml (the one body that stops, starts, restarts, kills or reads
dsv41 services) and roles/serve tasks/restart.yml (the one restart of the TP pair), run by
ansible-playbook itself on localhost against a stand-in supervisorctl (fake_supervisorctl.py,
supervisor's messages and exit codes).

Every action of control's argument spec is exercised (the cases are checked against its
``choices``): a stop of a stopped program and a start of a running one are no-ops that report no
change; a start or restart first runs ``update``, and a restart does not restart again what
``update`` already restarted; status only reads (also in check mode); the other actions change
nothing in check mode; a probe reports no change. The pair restart stops both ranks before rank 1
starts, starts rank 1 before rank 0, polls rank 0's /health only after rank 0 started, and in check
mode touches nothing."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from serviceutil import ACTIONS, env, mutating_calls, play, run_playbook

FAKE = Path(__file__).with_name("fake_supervisorctl.py")

R, S = "RUNNING", "STOPPED"
# name: (programs before, pending definitions, action, names, probe,
#        programs after, changed, the mutating calls made (stop/start/signal/update))
CASES = {
    "stop_running": ({"a": R}, {}, "stop", ["a"], False, {"a": S}, True, ["stop a"]),
    "stop_stopped_is_a_noop": ({"a": S}, {}, "stop", ["a"], False, {"a": S}, False, []),
    "stop_unknown_is_a_noop": ({}, {}, "stop", ["a"], False, {}, False, []),
    "stop_does_not_update": ({"a": R}, {"a": "updated"}, "stop", ["a"], False, {"a": S}, True, ["stop a"]),
    "start_stopped": ({"a": S}, {}, "start", ["a"], False, {"a": R}, True, ["update", "start a"]),
    "start_running_is_a_noop": ({"a": R}, {}, "start", ["a"], False, {"a": R}, False, ["update"]),
    "start_added_by_update": ({}, {"a": "added"}, "start", ["a"], False, {"a": R}, True, ["update"]),
    "restart_running": ({"a": R, "b": R}, {}, "restart", ["a", "b"], False, {"a": R, "b": R}, True,
                        ["update", "stop a", "start a", "stop b", "start b"]),
    "restart_stopped": ({"a": S}, {}, "restart", ["a"], False, {"a": R}, True, ["update", "stop a", "start a"]),
    "restart_once_when_update_did": ({"a": R}, {"a": "updated"}, "restart", ["a"], False, {"a": R}, True, ["update"]),
    "restart_removes_dropped_programs": ({"a": R, "old": R}, {"old": "removed"}, "restart", ["a"], False, {"a": R},
                                         True, ["update", "stop a", "start a"]),
    "restart_probe_reports_no_change": ({"a": R}, {}, "restart", ["a"], True, {"a": R}, False,
                                        ["update", "stop a", "start a"]),
    "kill_running": ({"a": R}, {}, "kill", ["a"], False, {"a": S}, True, ["signal KILL a"]),
    "status_only_reads": ({"a": R, "b": S}, {"a": "updated"}, "status", ["a", "b", "c"], False,
                          {"a": R, "b": S}, False, []),
}
MUTATING = ("update", "stop", "start", "signal")

TASK = """
    - name: Control {case}
      ansible.builtin.include_role:
        name: dsv41_service
        tasks_from: control
      vars:
        dsv41_supervisorctl: {py} {fake} {state} h0
        dsv41_service_control_names: {names}
        dsv41_service_control_action: {action}
        dsv41_service_control_probe: {probe}

    - name: Result of {case}
      ansible.builtin.copy:
        content: "{{{{ {{'changed': dsv41_service_control_supervisor is changed,
                       'skipped': dsv41_service_control_supervisor is skipped,
                       'states': dsv41_service_control_states,
                       'running': dsv41_service_control_running}} | to_json }}}}"
        dest: {out}
        mode: "0644"
      check_mode: false
"""


def _write_state(path: Path, programs: dict, pending: dict) -> None:
    path.write_text(json.dumps({"programs": programs, "pending": pending}))
    (path.parent / (path.name + ".log")).write_text("")


def _calls(state: Path, host: str | None = None) -> list[str]:
    return mutating_calls(state.parent / (state.name + ".log"), MUTATING, host)


def _run_cases(tmp: Path, check: bool) -> dict:
    tasks = []
    for case, (before, pending, action, names, probe, *_rest) in CASES.items():
        state = tmp / f"{case}.json"
        _write_state(state, before, pending)
        tasks.append(TASK.format(case=case, py=sys.executable, fake=FAKE, state=state, names=json.dumps(names),
                                 action=action, probe=str(probe).lower(), out=tmp / f"{case}.out.json"))
    (tmp / "play.yml").write_text(play("supervisor", "".join(tasks)))
    run_playbook("localhost,", tmp / "play.yml", tmp, env(), check=check)
    return {case: json.loads((tmp / f"{case}.out.json").read_text()) for case in CASES}


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("control")
    return tmp, _run_cases(tmp, check=False)


def test_the_cases_cover_every_action_of_the_argument_spec():
    assert {c[2] for c in CASES.values()} == set(ACTIONS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_control(ran, case):
    tmp, results = ran
    before, pending, action, names, probe, after, changed, calls = CASES[case]
    state = json.loads((tmp / f"{case}.json").read_text())
    assert state["programs"] == after
    assert _calls(tmp / f"{case}.json") == calls
    assert results[case]["changed"] is changed
    # the states after the action, as the caller reads them
    want = {n: after.get(n, "ERROR" if n not in before and n not in pending else after.get(n)) for n in names}
    assert results[case]["states"] == {n: (v if v else "ERROR") for n, v in want.items()}
    assert results[case]["running"] == {n: after.get(n) == R for n in names}


def test_check_mode_only_reads(tmp_path):
    results = _run_cases(tmp_path, check=True)
    for case, (before, pending, action, *_rest) in CASES.items():
        state = json.loads((tmp_path / f"{case}.json").read_text())
        assert state["programs"] == before and state["pending"] == pending, case
        assert _calls(tmp_path / f"{case}.json") == [], case
        assert results[case]["skipped"] is (action != "status"), case
    assert results["status_only_reads"]["running"] == {"a": True, "b": False, "c": False}


class _Health(BaseHTTPRequestHandler):
    """/health answers 200 and records whether rank 0's program was RUNNING when it was asked."""

    seen: list = []
    state: Path | None = None

    def do_GET(self):  # noqa: N802 (http.server's name)
        running = json.loads(self.state.read_text())["programs"].get("dsv41-serve") == R
        self.seen.append((self.path, running))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


PAIR_PLAY = """
- hosts: spark
  gather_facts: false
  tasks:
    - name: The one restart of the pair
      ansible.builtin.include_role:
        name: serve
        tasks_from: restart
      vars:
        serve_base_url: http://127.0.0.1:{port}
        serve_health_retries: 5
"""


@pytest.mark.parametrize("check", [False, True], ids=["run", "check_mode"])
def test_pair_restart_order(tmp_path, check):
    log = tmp_path / "log.json"
    states = {h: tmp_path / f"{h}.json" for h in ("sparkhead", "sparkworker")}
    for h, p in states.items():
        p.write_text(json.dumps({"programs": {"dsv41-serve": R}, "pending": {}}))
    log.write_text("")
    # one shared call log: the fake appends to STATE.log, so point both hosts' logs at one file
    for p in states.values():
        (p.parent / (p.name + ".log")).symlink_to(log)
    _Health.seen, _Health.state = [], states["sparkhead"]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    inv = {"all": {"vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                            "dsv41_service_manager": "supervisor",
                            "dsv41_supervisorctl": f"{sys.executable} {FAKE} {tmp_path}/{{{{ inventory_hostname }}}}.json "
                                                   "{{ inventory_hostname }}"},
                   "children": {"spark": {"hosts": {"sparkhead": {"dsv41_rank": 0}, "sparkworker": {"dsv41_rank": 1}}}}}}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inv))
    (tmp_path / "play.yml").write_text(PAIR_PLAY.format(port=srv.server_address[1]))
    try:
        run_playbook(tmp_path / "hosts.yml", tmp_path / "play.yml", tmp_path, env(), check=check)
    finally:
        srv.shutdown()
    calls = [line for line in log.read_text().splitlines() if line.split()[1] in MUTATING]
    if check:
        assert calls == [] and _Health.seen == []
        return
    stops = [i for i, c in enumerate(calls) if c.endswith("stop dsv41-serve")]
    start1 = calls.index("sparkworker start dsv41-serve")
    start0 = calls.index("sparkhead start dsv41-serve")
    assert len(stops) == 2 and max(stops) < start1 < start0, calls
    assert _Health.seen and _Health.seen[0] == ("/health", True)
    assert all(json.loads(p.read_text())["programs"] == {"dsv41-serve": R} for p in states.values())
