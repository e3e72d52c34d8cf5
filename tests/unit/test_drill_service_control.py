"""The drill's faults and ``dsv41 status`` drive services through the hosts' service manager
(:mod:`dsv41.service_control`; systemd, the only one since the supervisord lab was retired).

Enumerated from the code's own definitions: every fault of ``drill_faults.FAULT_CLASSES`` under
every manager of ``service_control.MANAGERS`` is injected and cleared against a fake lab whose
service manager is a real process (fake_systemd.py, servicectlutil), and its effect checked on the
fake's state; every command of the ``dsv41`` command tree that takes ``--service-manager`` refuses
a bad value with the one line, and none takes ``--supervisorctl`` any more; no playbook or role
passes it; the argv that status.yml, the promotion facts and drill.yml render (Ansible's own
Templar) for each manager are accepted by the commands they call."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import yaml
from typer.main import get_command

from dsv41 import cli, errors, service_control
from dsv41.cli import main
from dsv41.entrypoints import status_host
from dsv41.harness import drill_faults
from dsv41.service_control import MANAGERS, ServiceControlError
from servicectlutil import STATES, FakeLab, FakeManager, fake_bin, spawn_engine

ROOT = Path(__file__).resolve().parents[2]
TOPO = drill_faults.Topology()
SERVICES = (TOPO.engram_program, TOPO.drafter_program, TOPO.serve_program)


@pytest.fixture
def engine():
    """A stand-in engine with an async-proxy child; both ended by pid afterwards."""
    eng, proxy = spawn_engine()
    yield eng, proxy
    for pid in (proxy, eng.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    eng.wait(timeout=10)
    eng.stdout.close()


def _lab(tmp_path: Path, manager: str, engine_pid: int, states: dict[str, str] | None = None) -> FakeLab:
    services = {n: "up" for n in SERVICES} | (states or {})
    return FakeLab(tmp_path, FakeManager(tmp_path / "mgr", manager, services, {TOPO.serve_program: engine_pid}))


def _proxy_alive(pid: int, settle_s: float = 5.0) -> bool:
    """Whether ``pid`` still runs, allowing ``settle_s`` for a SIGKILL to be delivered (a zombie or
    a reaped pid is dead)."""
    import time

    end = time.monotonic() + settle_s
    while True:
        try:
            alive = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
        except (OSError, IndexError):
            alive = False
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.02)


# Per fault class: what its inject must have done to the fake lab, and what its clear must restore.
# Keyed by class name so that a new fault class fails test_every_fault_class_has_an_effect until
# its effect is written here.
def _program_down(lab: FakeLab, f) -> bool:
    return lab.mgr.states()[f.program] != "up"


EFFECTS = {
    "EngramServerStop": (_program_down, lambda lab, f: lab.mgr.states()[f.program] == "up"),
    "DrafterWorkerStop": (_program_down, lambda lab, f: lab.mgr.states()[f.program] == "up"),
    "AsyncProxyKill": (lambda lab, f: not _proxy_alive(f.killed), lambda lab, f: not _proxy_alive(f.killed)),
    "LinkDown": (lambda lab, f: not lab.link_up, lambda lab, f: lab.link_up),
    "Netem": (lambda lab, f: lab.qdisc in ("netem", "tbf"), lambda lab, f: lab.qdisc == "noqueue"),
}


def test_every_fault_class_has_an_effect() -> None:
    assert {c.__name__ for c in drill_faults.FAULT_CLASSES.values()} == set(EFFECTS)
    assert set(drill_faults.FAULT_CLASSES) == set(drill_faults.FAULTS)


@pytest.mark.parametrize("manager", MANAGERS)
@pytest.mark.parametrize("fault", list(drill_faults.FAULT_CLASSES))
def test_every_fault_under_every_manager(fault: str, manager: str, tmp_path: Path, engine) -> None:
    eng, proxy = engine
    lab = _lab(tmp_path, manager, eng.pid)
    cls = drill_faults.FAULT_CLASSES[fault]
    injected, cleared = EFFECTS[cls.__name__]
    before = lab.mgr.states()
    f = cls(lab.hosts, TOPO)
    rec = f.inject()
    assert injected(lab, f), (fault, manager, rec)
    ctl = lab.mgr.ctl
    if isinstance(f, drill_faults._ProgramStop):
        # the record says what ran, in the manager's words; nothing else was touched
        assert rec["action"] == ctl.describe(ctl.stop(f.program)) and rec["action"].startswith(ctl.tool + " stop ")
        assert lab.mgr.calls() == [f"stop {f.program}"]
    if isinstance(f, drill_faults.AsyncProxyKill):
        assert rec["engine_pid"] == eng.pid and rec["proxy_pid"] == proxy
    out = f.clear()
    assert cleared(lab, f), (fault, manager, out)
    assert lab.mgr.states() == before
    again = drill_faults.FAULT_CLASSES[fault](lab.hosts, TOPO).clear()  # idempotent: nothing more to do
    assert again["action"].startswith("none"), again
    # the whole lab was entered the way its backend is entered, every time
    assert set(lab.entries) == {drill_faults.NSENTER_FLAGS}
    if isinstance(f, drill_faults._ProgramStop):
        assert out["action"] == ctl.describe(ctl.start(f.program)) and out["was"] == STATES[manager]["down"]
        assert lab.mgr.calls() == [f"stop {f.program}", f"start {f.program}"]


@pytest.mark.parametrize("manager", MANAGERS)
def test_clear_of_a_failed_service(manager: str, tmp_path: Path, engine) -> None:
    """A failed unit gets its start limit cleared before the start (as control.yml does)."""
    eng, _ = engine
    lab = _lab(tmp_path, manager, eng.pid, {TOPO.engram_program: "failed"})
    out = drill_faults.EngramServerStop(lab.hosts, TOPO).clear()
    assert lab.mgr.states()[TOPO.engram_program] == "up"
    assert lab.mgr.calls() == [f"reset-failed {TOPO.engram_program}", f"start {TOPO.engram_program}"]
    assert out["was"] == STATES[manager]["failed"]


@pytest.mark.parametrize("manager", MANAGERS)
def test_a_stopped_engine_is_named(manager: str, tmp_path: Path, engine) -> None:
    eng, _ = engine
    lab = _lab(tmp_path, manager, eng.pid, {TOPO.serve_program: "down"})
    with pytest.raises(drill_faults.DrillError, match=f"{TOPO.serve_program} on sparkhead is not running"):
        drill_faults.AsyncProxyKill(lab.hosts, TOPO).inject()


@pytest.mark.parametrize("manager", MANAGERS)
def test_builders_round_trip_through_the_fake(manager: str, tmp_path: Path) -> None:
    """Every builder of ServiceControl, run against the manager's fake: the parsers read back what
    the fake holds."""
    mgr = FakeManager(tmp_path, manager, {"dsv41-a": "up", "dsv41-b": "down", "other": "up"}, {"dsv41-a": 777})
    ctl = mgr.ctl
    r = mgr.run(ctl.list_services())
    assert r.returncode == 0, r.stderr
    assert ctl.parse_list(r.stdout) == {
        "dsv41-a": ctl.parse_state("dsv41-a", mgr.run(ctl.state("dsv41-a")).stdout),
        "dsv41-b": ctl.parse_state("dsv41-b", mgr.run(ctl.state("dsv41-b")).stdout),
    }
    assert ctl.parse_state("dsv41-a", mgr.run(ctl.state("dsv41-a")).stdout) in ctl.up_states
    assert ctl.parse_state("dsv41-b", mgr.run(ctl.state("dsv41-b")).stdout) not in ctl.up_states
    assert ctl.parse_main_pid(mgr.run(ctl.main_pid("dsv41-a")).stdout) == 777
    assert ctl.parse_main_pid(mgr.run(ctl.main_pid("dsv41-b")).stdout) is None
    assert mgr.run(ctl.start("dsv41-b")).returncode == 0 and mgr.states()["dsv41-b"] == "up"
    assert mgr.run(ctl.stop("dsv41-a")).returncode == 0 and mgr.states()["dsv41-a"] == "down"
    assert mgr.run(ctl.kill("dsv41-b")).returncode == 0 and mgr.states()["dsv41-b"] != "up"
    assert mgr.calls() == ["start dsv41-b", "stop dsv41-a", "kill --kill-whom=main --signal=KILL dsv41-b"]


@pytest.mark.parametrize("manager", MANAGERS)
def test_status_reads_services_through_every_manager(manager: str, tmp_path: Path, monkeypatch) -> None:
    """``dsv41 status --local``'s service listing under each manager's fake: the dsv41 services
    and their states in the manager's words, nothing else."""
    mgr = FakeManager(tmp_path, manager, {"dsv41-serve": "up", "dsv41-drafter": "failed", "other": "up"})
    monkeypatch.setenv("PATH", f"{fake_bin(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SYSTEMD_STATE", str(mgr.state))
    words = STATES[manager]
    assert status_host.service_states(manager) == {"dsv41-serve": words["up"], "dsv41-drafter": words["failed"]}
    facts = status_host.host_facts(service_manager=manager, root=str(tmp_path / "opt"), container_runtime="")
    assert facts["services"] == {"dsv41-serve": words["up"], "dsv41-drafter": words["failed"]}


@pytest.mark.parametrize("manager", MANAGERS)
def test_names_and_signals_are_checked(manager: str) -> None:
    ctl = service_control.for_manager(manager)
    for bad in ("-rf", "a b", "", "x;y", "ü"):
        with pytest.raises(ServiceControlError, match="bad service name"):
            ctl.stop(bad)
    for bad in ("kill", "KILL; rm", "", "-9"):
        with pytest.raises(ServiceControlError, match="bad signal"):
            ctl.kill("dsv41-a", bad)
    assert ctl.kill("dsv41-a", "SIGTERM")[-2:] == ["--signal=TERM", "dsv41-a.service"]
    assert all(isinstance(w, str) for w in ctl.main_pid("dsv41-a") + ctl.list_services() + ctl.state("dsv41-a"))


def test_for_manager_refusals() -> None:
    # supervisor: the retired manager is an unknown one now
    for bad in ("upstart", "", "Systemd", "supervisor", "supervisord"):
        with pytest.raises(ServiceControlError) as e:
            service_control.for_manager(bad)
        assert str(e.value) == f"--service-manager must be one of systemd, not {bad!r}"
    assert service_control.for_manager("systemd").prefix == ("systemctl",)


# ---- every CLI that takes --service-manager --------------------------------------------------------


def _commands_with(option: str) -> dict[tuple[str, ...], set[str]]:
    """``{command path: its options}`` of every command of the dsv41 tree that has ``option``."""
    opts: dict[tuple[str, ...], set[str]] = {}
    for path, p in errors.iter_parameters(get_command(cli.app)):
        opts.setdefault(path, set()).update(getattr(p, "opts", ()))
    return {path: o for path, o in opts.items() if option in o}


SM_COMMANDS = _commands_with("--service-manager")


def test_the_enumeration_finds_the_known_commands() -> None:
    assert {("status",), ("drill", "run"), ("drill", "clear")} <= set(SM_COMMANDS), SM_COMMANDS


@pytest.mark.parametrize("path", sorted(SM_COMMANDS), ids=" ".join)
def test_bad_service_manager_is_one_line(path: tuple[str, ...], capsys, tmp_path: Path) -> None:
    extra = ["--lab-dir", str(tmp_path)] if "--lab-dir" in SM_COMMANDS[path] else []
    assert main([*path, "--service-manager", "upstart", *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dsv41: error: --service-manager must be one of systemd, not 'upstart'"], err


def test_no_command_takes_supervisorctl() -> None:
    """The supervisord lab is retired: no command of the tree has ``--supervisorctl`` any more."""
    assert _commands_with("--supervisorctl") == {}


@pytest.mark.parametrize("path", sorted(SM_COMMANDS), ids=" ".join)
def test_supervisorctl_is_an_unknown_option(path: tuple[str, ...], capsys) -> None:
    """``--supervisorctl`` (a script of the supervisord lab) is refused like any unknown option."""
    assert main([*path, "--supervisorctl", "supervisorctl -c x"]) != 0
    err = capsys.readouterr().err
    assert "No such option: --supervisorctl" in err, err


@pytest.mark.parametrize("manager", MANAGERS)
def test_drill_clear_reaches_the_lab_check_with_every_manager(manager: str, capsys, tmp_path: Path) -> None:
    """A good manager gets past the option checks to the lab (not up here): one line naming it."""
    assert main(["drill", "clear", "--service-manager", manager, "--lab-dir", str(tmp_path / "nolab")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the lab is not up" in err[0], err


# ---- the playbooks and roles pass the hosts' manager ----------------------------------------------


def _yaml_files() -> list[Path]:
    return sorted([*ROOT.glob("playbooks/*.yml"), *ROOT.glob("*.yml"), *ROOT.glob("roles/*/tasks/*.yml")])


def test_no_playbook_or_role_passes_supervisorctl() -> None:
    """No task passes ``--supervisorctl`` (gone from every command) or reads ``dsv41_supervisorctl``;
    the ones that call ``dsv41 status`` or ``dsv41 drill`` pass ``--service-manager``."""
    callers = []
    for p in _yaml_files():
        text = p.read_text()
        assert not re.search(r"supervisorctl", text), p
        if "'--service-manager'" in text or "- --service-manager" in text:
            callers.append(p.relative_to(ROOT).as_posix())
    assert {"playbooks/drill.yml", "roles/status/tasks/host.yml", "roles/promotion/tasks/facts.yml"} <= set(callers), (
        callers
    )


def _rendered(path: str, where, variables: dict, play_vars: bool = False):
    """The value at ``where`` (keys/indices) of YAML file ``path`` templated by Ansible's own
    Templar with ``variables`` (loaded as Ansible loads a playbook: trusted as a template);
    ``play_vars``: the play's own ``vars`` (``where[0]``) under ``variables``."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar

    loader = DataLoader()
    node = doc = loader.load_from_file(str(ROOT / path), trusted_as_template=True)
    for k in where:
        node = node[k]
    if play_vars:
        variables = {**doc[where[0]]["vars"], **variables}
    return list(Templar(loader=loader, variables=variables).template(node))


@pytest.mark.parametrize("manager", MANAGERS)
@pytest.mark.parametrize(
    "path, where",
    [
        ("roles/status/tasks/host.yml", (0, "ansible.builtin.command", "argv")),
        ("roles/promotion/tasks/facts.yml", (2, "ansible.builtin.command", "argv")),
    ],
)
def test_status_argv_of_the_playbooks_runs(path: str, where, manager: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """The argv status.yml and the promotion facts render for each manager is accepted by
    ``dsv41 status --local`` and lists the services through that manager."""
    mgr = FakeManager(tmp_path, manager, {"dsv41-serve": "up"})
    monkeypatch.setenv("PATH", f"{fake_bin(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SYSTEMD_STATE", str(mgr.state))
    argv = _rendered(path, where, {"dsv41_venv": "/opt/dsv41/venv", "dsv41_service_manager": manager})
    assert argv[:2] == ["/opt/dsv41/venv/bin/dsv41", "status"]
    assert argv[argv.index("--service-manager") + 1] == manager
    assert (
        main([*argv[1:], "--root", str(tmp_path / "opt"), "--container-runtime", str(tmp_path / "no-docker")]) == 0
    ), capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["services"] == {"dsv41-serve": STATES[manager]["up"]}


@pytest.mark.parametrize("manager", MANAGERS)
def test_drill_argv_of_the_playbook_is_accepted(manager: str, tmp_path: Path, capsys) -> None:
    """drill.yml's common arguments for each manager get ``dsv41 drill clear`` past every option
    check, to the lab (not up here)."""
    plays = yaml.safe_load((ROOT / "playbooks" / "drill.yml").read_text())
    at = next(i for i, p in enumerate(plays) if "drill_common_args" in p.get("vars", {}))
    head = {"dsv41_lab_dir": str(tmp_path / "nolab"), "dsv41_service_manager": manager}
    args = _rendered(
        "playbooks/drill.yml",
        (at, "vars", "drill_common_args"),
        {"hostvars": {"sparkhead": head}, "drill_head": "sparkhead", "drill_link": "sparkhead:ofl0"},
        play_vars=True,
    )
    assert args[args.index("--service-manager") + 1] == manager
    assert main(["drill", "clear", "--faults", "all", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the lab is not up" in err[0], err


@pytest.mark.parametrize("manager", MANAGERS)
def test_list_prefix_is_checked(manager: str) -> None:
    ctl = service_control.for_manager(manager)
    assert ctl.list_services("dsv41-")[-1] == "dsv41-*"
    with pytest.raises(ServiceControlError, match="bad service name prefix"):
        ctl.list_services("-x")
