"""roles/window tasks/fault.yml (window.yml's mid-cell drill: SIGKILL rank 0's engine), run by
ansible-playbook on localhost against a stand-in systemctl (fake_systemd.py) and a stand-in
container runtime.

A CI run found the class: with the engine in a container (roles/serve's serve_container, both the
lab and vLLM in production), a SIGKILL to the unit reached only the ``docker run`` client, the
engine went on serving and the drill saw no failed cell. Every answer the runtime can give about
the container is a case: running (the container is killed, the unit is not), stopped, absent, no
runtime on the host (the unit's own process is the engine: systemd kills it). Rank 1 never acts;
check mode kills nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servicectlutil import fake_bin
from serviceutil import env, mutating_calls, play, run_playbook

# docker inspect --format {{.State.Running}}: its stdout and exit status for each state
RUNTIME = """#!/bin/sh
echo "$@" >> {log}
case "$1" in
  inspect)
    case "$FAKE_CONTAINER" in
      running) echo true ;;
      stopped) echo false ;;
      *) echo "Error: No such object: $5" >&2; exit 1 ;;
    esac ;;
  kill) [ "$FAKE_CONTAINER" = running ] || {{ echo "Error: No such container" >&2; exit 1; }} ;;
esac
"""
# container state -> (the runtime's mutating calls, systemctl's)
CASES = {
    "running": (["kill --signal=KILL -- dsv41-serve"], []),
    "stopped": ([], ["kill --signal=KILL -- dsv41-serve"]),
    "absent": ([], ["kill --signal=KILL -- dsv41-serve"]),
    "no_runtime": ([], ["kill --signal=KILL -- dsv41-serve"]),
}
TASK = """
    - name: The mid-cell fault
      ansible.builtin.include_role:
        name: window
        tasks_from: fault
      vars:
        dsv41_rank: {rank}
        dsv41_serve_service: dsv41-serve
        dsv41_rank0_host: "{{{{ inventory_hostname if {rank} == 0 else 'another-spark' }}}}"
        serve_container_runtime: {runtime}
"""


def _run(tmp: Path, state: str, rank: int = 0, check: bool = False) -> tuple[list[str], list[str]]:
    d = tmp / f"{state}-{rank}"
    d.mkdir()
    units = d / "systemd.json"
    units.write_text(json.dumps({"units": {"dsv41-serve": {"ActiveState": "active", "NeedDaemonReload": "no"}}}))
    Path(str(units) + ".log").write_text("")
    log = d / "runtime.log"
    log.write_text("")
    runtime = d / "docker"
    runtime.write_text(RUNTIME.format(log=log))
    runtime.chmod(0o755)
    (d / "play.yml").write_text(
        play(
            "systemd",
            TASK.format(rank=rank, runtime=json.dumps(str(d / "missing" if state == "no_runtime" else runtime))),
        )
    )
    run_playbook(
        "localhost,",
        d / "play.yml",
        d,
        env(fake_bin(d), FAKE_SYSTEMD_STATE=str(units), FAKE_CONTAINER=state),
        check=check,
    )
    made = [line for line in log.read_text().splitlines() if not line.startswith("inspect")]
    return made, mutating_calls(Path(str(units) + ".log"), ("kill", "stop", "start", "restart"), "systemctl")


@pytest.mark.parametrize("state", sorted(CASES))
def test_rank_0_engine_is_killed_where_it_runs(tmp_path, state):
    runtime_calls, systemctl_calls = CASES[state]
    assert _run(tmp_path, state) == (runtime_calls, systemctl_calls)


@pytest.mark.parametrize("state", ["running", "absent"])
def test_rank_1_is_left_alone(tmp_path, state):
    assert _run(tmp_path, state, rank=1) == ([], [])


@pytest.mark.parametrize("state", ["running", "absent"])
def test_check_mode_kills_nothing(tmp_path, state):
    assert _run(tmp_path, state, check=True) == ([], [])
