"""Every drill fault finds rank 0's engine for both serve runtimes of roles/serve (issue 22).

Plain process: the engine is the ``dsv41-serve`` service's main pid. Container: the unit's main pid
is the ``docker run`` client and the engine lives under containerd-shim -> docker-init -> engine ->
proxy, with the proxy's ``--parent-pid`` in the container's numbering. Enumerated from the code's
own definitions: every fault of ``drill_faults.FAULTS`` (its name table) x both runtimes x every
service manager is injected and cleared against a process-tree fake of the host (``TreeLab``: the
manager is servicectlutil's real fake, ``/proc`` and ``docker inspect`` come from a table), and
the pids it signals are checked; every lookup of the engine's pid or children anywhere in
python/dsv41 goes through ``drill_faults.find_engine`` (an AST scan and a runtime guard); the
failures (no container, stopped, no engine under the init, no proxy, a bad answer) are one
DrillError line naming host and container; drill.yml's runtime fallback equals roles/serve's
defaults, and its argv is accepted by ``dsv41 drill clear``."""

from __future__ import annotations

import ast
import contextlib
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from servicectlutil import FakeLab, FakeManager

from dsv41.cli import main
from dsv41.harness import drill_faults
from dsv41.harness.drill_faults import DrillError
from dsv41.service_control import MANAGERS

ROOT = Path(__file__).resolve().parents[2]
TOPO = drill_faults.Topology()
CTOPO = drill_faults.Topology(serve_container=True)
ENGINE = ["/opt/dsv41/venv/bin/dsv41", "engine", "serve", "--rank", "0"]


def proxy_argv(parent_ns_pid: int) -> list[str]:
    """The async proxy's argv as AsyncSpeculator._spawn builds it."""
    return ["/opt/dsv41/venv/bin/python", "-m", "dsv41.drafter.proxy_cli", "run", "--shm", "/dsv41-ring",
            "--parent-pid", str(parent_ns_pid)]


# host pid -> (parent host pid, pid in its own namespace, argv); MAIN: the service's main pid.
PLAIN = {"main": 500, "engine": 500, "proxy": 501, "container": None, "procs": {
    1: (0, 1, ["/lib/systemd/systemd"]),
    500: (1, 500, ENGINE),
    501: (500, 501, proxy_argv(500)),
    502: (500, 502, ["/opt/dsv41/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main"])}}
CONTAINER = {"main": 600, "engine": 702, "proxy": 703, "container": ("true", 701, "true"), "procs": {
    1: (0, 1, ["/lib/systemd/systemd"]),
    600: (1, 600, ["/usr/bin/docker", "run", "--rm", "--name", "dsv41-serve", "--init", "sha256:ab", *ENGINE[1:]]),
    650: (1, 650, ["/usr/bin/dockerd", "-H", "fd://"]),
    700: (1, 700, ["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", "c0ffee"]),
    701: (700, 1, ["/sbin/docker-init", "--", *ENGINE[1:]]),
    702: (701, 7, ENGINE),
    703: (702, 8, proxy_argv(7)),
    704: (702, 9, ["/opt/dsv41/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main"]),
    # a proxy orphaned by an earlier engine, reparented to the init: never the engine, never killed
    705: (701, 12, proxy_argv(3))}}
RUNTIMES = {"plain": (PLAIN, TOPO), "container": (CONTAINER, CTOPO)}


class TreeLab(FakeLab):
    """servicectlutil's fake lab (service manager, link, qdisc) whose host has the process table
    ``tree`` (PLAIN / CONTAINER shape): the probe of ``LabHosts.proc_tree`` and ``docker
    inspect`` answer from it, ``kill`` removes a pid, and killing the engine's proxy makes the
    engine's watchdog respawn it with new pids (``kills``: the pids signalled)."""

    def __init__(self, d: Path, manager: str, tree: dict, states: dict[str, str] | None = None) -> None:
        services = {n: "up" for n in (TOPO.engram_program, TOPO.drafter_program, TOPO.serve_program)}
        mgr = FakeManager(d / "mgr", manager, services | (states or {}), {TOPO.serve_program: tree["main"]})
        super().__init__(d, mgr)
        self.procs = {pid: tuple(v) for pid, v in tree["procs"].items()}
        self.container = tree["container"]
        self.engine, self.proxy = tree["engine"], tree["proxy"]
        self.kills: list[int] = []
        self.inspects: list[tuple[str, ...]] = []

    def _one(self, pid: int) -> list:
        return [pid, self.procs[pid][1], list(self.procs[pid][2])]

    def __call__(self, cmd, **kw) -> subprocess.CompletedProcess:
        argv = list(cmd[cmd.index("--") + 1:])
        if argv[:2] == ["python3", "-c"]:
            self.entries.append(tuple(cmd[3:cmd.index("--")]))
            pid = int(argv[3])
            if pid not in self.procs:
                return self._reply(cmd, out="null\n")
            kids = [self._one(c) for c in sorted(self.procs) if self.procs[c][0] == pid]
            return self._reply(cmd, out=json.dumps([self._one(pid), kids]) + "\n")
        if argv[:1] == ["kill"]:
            pid = int(argv[-1])
            self.kills.append(pid)
            if pid not in self.procs:
                return self._reply(cmd, 1, "", f"kill: ({pid}) - No such process")
            parent, _, was = self.procs.pop(pid)
            if pid == self.proxy:  # the watchdog: a new proxy under the same engine
                self.proxy = max(self.procs) + 1
                ns = max(n for p, n, _ in self.procs.values()) + 1
                self.procs[self.proxy] = (parent, ns, was)
            return self._reply(cmd)
        if argv[1:2] == ["inspect"]:
            self.inspects.append(tuple(argv))
            assert argv[:4] == [CTOPO.container_runtime, "inspect", "--format", drill_faults.CONTAINER_FORMAT], argv
            if self.container is None or argv[4] != CTOPO.serve_program:
                return self._reply(cmd, 1, "", f"Error: No such object: {argv[4]}\n")
            return self._reply(cmd, out=" ".join(map(str, self.container)) + "\n")
        return super().__call__(cmd, **kw)


# Per fault class: whether it needs rank 0's engine. Keyed by class name so that a new fault class
# fails test_every_fault_class_is_classified until it is said here.
NEEDS_ENGINE = {"EngramServerStop": False, "DrafterWorkerStop": False, "AsyncProxyKill": True,
                "LinkDown": False, "Netem": False}
LOOKUPS = ("program_pid", "proc_tree", "container_pid")


def test_every_fault_class_is_classified() -> None:
    assert {drill_faults.FAULT_CLASSES[n].__name__ for n in drill_faults.FAULTS} == set(NEEDS_ENGINE)


@pytest.fixture
def guarded(monkeypatch) -> list[str]:
    """The engine lookups of LabHosts raise unless called from within find_engine; returns the
    list of find_engine calls (the host of each)."""
    inside, calls = [0], []
    real = drill_faults.find_engine

    def find_engine(hosts, host, topo):
        calls.append(host)
        inside[0] += 1
        try:
            return real(hosts, host, topo)
        finally:
            inside[0] -= 1

    for name in LOOKUPS:
        orig = getattr(drill_faults.LabHosts, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            assert inside[0] > 0, f"LabHosts.{_name} called outside find_engine"
            return _orig(self, *a, **kw)
        monkeypatch.setattr(drill_faults.LabHosts, name, wrapped)
    monkeypatch.setattr(drill_faults, "find_engine", find_engine)
    return calls


@pytest.mark.parametrize("manager", MANAGERS)
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("fault", list(drill_faults.FAULTS))
def test_every_fault_acts_on_the_right_pid(fault: str, runtime: str, manager: str, tmp_path: Path, guarded) -> None:
    tree, topo = RUNTIMES[runtime]
    lab = TreeLab(tmp_path, manager, tree)
    f = drill_faults.FAULT_CLASSES[fault](lab.hosts, topo)
    rec = f.inject()
    out = f.clear()
    needs = NEEDS_ENGINE[type(f).__name__]
    assert bool(guarded) == needs and set(guarded) <= {topo.head_host}, guarded
    # docker is asked only to find the engine, and only when it runs in a container
    assert bool(lab.inspects) == (needs and runtime == "container"), lab.inspects
    if not needs:
        assert lab.kills == [], lab.kills
        return
    # the proxy under the engine, by its host pid; never the docker client, the init or an orphan
    assert lab.kills == [tree["proxy"]], lab.kills
    assert rec["engine_pid"] == tree["engine"] and rec["proxy_pid"] == tree["proxy"], rec
    assert rec["container"] == (topo.serve_program if runtime == "container" else None), rec
    assert out["respawned"] is True and out["proxy_pid"] == lab.proxy != tree["proxy"], out
    assert set(lab.procs) == set(tree["procs"]) - {tree["proxy"]} | {lab.proxy}


def _calls_outside(tree: ast.AST, names: tuple[str, ...], allowed: str) -> list[int]:
    """Line numbers of calls ``X.<name>(...)`` (``name`` in ``names``) not inside a function named
    ``allowed`` (nor being its definition's own body of a method of that name)."""
    bad = []

    def walk(node: ast.AST, fn: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            here = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in names and fn != allowed):
                bad.append(child.lineno)
            walk(child, here)
    walk(tree, None)
    return bad


def test_engine_lookups_only_in_find_engine() -> None:
    """Anywhere in the package (harness, status, drill): the service's main pid, a process tree
    or a container's pid is looked up by find_engine alone."""
    found = {}
    for p in sorted((ROOT / "python" / "dsv41").rglob("*.py")):
        bad = _calls_outside(ast.parse(p.read_text()), LOOKUPS, "find_engine")
        if bad:
            found[p.relative_to(ROOT).as_posix()] = bad
    assert found == {}, found
    src = ast.parse((ROOT / "python/dsv41/harness/drill_faults.py").read_text())
    assert _calls_outside(src, LOOKUPS, "nothing"), "the scan found none of the calls find_engine makes"


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def _tree(base: dict, **changes) -> dict:
    procs = dict(base["procs"])
    for pid in changes.pop("drop", ()):
        procs.pop(pid)
    procs.update(changes.pop("procs", {}))
    return {**base, **changes, "procs": procs}


@pytest.mark.parametrize("case, tree, expect", [
    ("no container", _tree(CONTAINER, container=None), "no container dsv41-serve on sparkhead (Error: No such object"),
    ("stopped", _tree(CONTAINER, container=("false", 0, "true")), "container dsv41-serve on sparkhead is not running"),
    ("no engine", _tree(CONTAINER, drop=(702, 703, 704, 705)),
     "container dsv41-serve on sparkhead: its init (pid 701) runs no engine"),
    ("no proxy", _tree(CONTAINER, drop=(703,)),
     "no async proxy process under container dsv41-serve (engine pid 702, 7 in the container) on sparkhead"),
    ("bad answer", _tree(CONTAINER, container=("[]",)), "container dsv41-serve on sparkhead: /usr/bin/docker inspect said"),
    ("gone", _tree(CONTAINER, drop=(701,)), "pid 701 on sparkhead is gone"),
])
def test_container_failures_are_one_line(case: str, tree: dict, expect: str, tmp_path: Path) -> None:
    lab = TreeLab(tmp_path, "systemd", tree)
    with pytest.raises(DrillError) as exc:
        drill_faults.AsyncProxyKill(lab.hosts, CTOPO).inject()
    assert expect in _one_line(exc, "sparkhead"), (case, str(exc.value))
    assert lab.kills == []
    # clear_all keeps going: the other faults clear, this one is its error line (an engine
    # without a proxy is not an error to clear: it is recorded as not respawned)
    out = drill_faults.clear_all(lab.hosts, CTOPO)
    assert all("error" not in r for n, r in out.items() if n != "async_proxy"), out
    if case == "no proxy":
        assert out["async_proxy"]["proxy_pid"] is None and out["async_proxy"]["respawned"] is False
    else:
        assert expect in out["async_proxy"]["error"], out


def test_plain_failures_name_the_service(tmp_path: Path) -> None:
    lab = TreeLab(tmp_path, "systemd", _tree(PLAIN, drop=(501,)))
    with pytest.raises(DrillError) as exc:
        drill_faults.AsyncProxyKill(lab.hosts, TOPO).inject()
    _one_line(exc, "no async proxy process under dsv41-serve (pid 500) on sparkhead")
    lab = TreeLab(tmp_path, "systemd", PLAIN, {TOPO.serve_program: "down"})
    with pytest.raises(DrillError) as exc:
        drill_faults.AsyncProxyKill(lab.hosts, TOPO).inject()
    _one_line(exc, "dsv41-serve on sparkhead is not running")
    assert lab.kills == [] and lab.inspects == []


def test_container_without_init(tmp_path: Path) -> None:
    """Without docker's init the container's PID 1 is the engine itself (proxy --parent-pid 1)."""
    tree = _tree(CONTAINER, container=("true", 702, "<nil>"), engine=702, drop=(701, 705),
                 procs={702: (700, 1, ENGINE), 703: (702, 8, proxy_argv(1)), 704: (702, 9, ["x"])})
    lab = TreeLab(tmp_path, "systemd", tree)
    rec = drill_faults.AsyncProxyKill(lab.hosts, CTOPO).inject()
    assert lab.kills == [703] and rec["engine_pid"] == 702 and "1 in the container" in rec["action"]


# ---- how the drill learns the runtime: drill.yml, from the inventory, with the role's default --

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


INVENTORIES = [{}, {"serve_runtime": "vllm"}, {"serve_runtime": "lab"}, {"serve_container": True},
               {"serve_container": False, "serve_runtime": "vllm"}, {"serve_container": "true"},
               {"serve_container_runtime": "/opt/bin/docker"}, {"dsv41_lab": False}]


@pytest.mark.parametrize("inv", INVENTORIES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "defaults")
def test_drill_runtime_fallback_is_the_roles_default(inv: dict, tmp_path: Path, capsys) -> None:
    """drill.yml's drill_serve_container / drill_container_runtime equal what roles/serve resolves
    for the head Spark (its defaults under the inventory's variables), and the argv it renders
    gets ``dsv41 drill clear`` past every option check, to the lab (not up here)."""
    defaults = yaml.safe_load((ROOT / "roles" / "serve" / "defaults" / "main.yml").read_text())
    host = {"dsv41_lab": True, **inv}
    role = {k: defaults[k] for k in ("serve_runtime", "serve_container", "serve_container_runtime")}
    want_container = bool(yaml.safe_load(str(_template("{{ serve_container | bool }}", {**role, **host}, tmp_path))))
    want_runtime = _template("{{ serve_container_runtime }}", {**role, **host}, tmp_path)
    head = {**host, "dsv41_lab_dir": str(tmp_path / "nolab"), "dsv41_service_manager": "systemd"}
    play = {**_drill_vars(), "hostvars": {"sparkhead": head}, "drill_head": "sparkhead", "drill_link": "sparkhead:ofl0"}
    got = _template("{{ drill_serve_container | bool }}", play, tmp_path)
    assert bool(yaml.safe_load(str(got))) == want_container, (inv, got)
    args = list(_template("{{ drill_common_args }}", play, tmp_path))
    assert ("--serve-container" in args) == want_container, args
    if want_container:
        assert args[args.index("--container-runtime") + 1] == want_runtime
    assert main(["drill", "clear", "--faults", "all", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the lab is not up" in err[0], err


@pytest.mark.parametrize("cmd", [["clear"], ["run", "--refs", "/nonexistent"]])
def test_bad_container_runtime_is_one_line(cmd: list[str], capsys) -> None:
    assert main(["drill", *cmd, "--serve-container", "--container-runtime", "docker; rm -rf /"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad container runtime" in err[0], err


def test_a_real_pid_namespace(tmp_path: Path) -> None:
    """The probe on a real /proc: an engine that is PID 1 of its own pid namespace (``unshare
    --pid``, as a container without docker's init) spawns a proxy whose ``--parent-pid`` is 1;
    the drill matches it by that pid and kills it by its host pid. Only processes this test
    started are signalled."""
    import os
    import signal
    import sys
    import time

    from servicectlutil import FakeLab

    code = ("import os,subprocess,sys,time\n"
            "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(120)','-m','dsv41.drafter.proxy_cli',"
            "'run','--parent-pid',str(os.getpid())])\n"
            "print(os.getpid(),flush=True)\n"
            "time.sleep(120)\n")
    ns = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = ns.stdout.readline().strip()
        if first != "1":
            pytest.skip(f"no pid namespace here (unshare: {ns.stderr.read().strip()[:200] or first})")
        engine = int(Path(f"/proc/{ns.pid}/task/{ns.pid}/children").read_text().split()[0])
        deadline = time.monotonic() + 10
        while not (kids := Path(f"/proc/{engine}/task/{engine}/children").read_text().split()):
            assert time.monotonic() < deadline, "the stand-in proxy did not start"
            time.sleep(0.02)
        proxy = int(kids[0])

        class Inspect(FakeLab):
            def __call__(self, cmd, **kw):
                if cmd[cmd.index("--") + 1:][1:2] == ["inspect"]:
                    return self._reply(cmd, out=f"true {engine} <nil>\n")
                return super().__call__(cmd, **kw)

        mgr = FakeManager(tmp_path / "mgr", "systemd", {TOPO.serve_program: "up"}, {TOPO.serve_program: ns.pid})
        lab = Inspect(tmp_path, mgr)
        rec = drill_faults.AsyncProxyKill(lab.hosts, CTOPO).inject()
        assert (rec["engine_pid"], rec["proxy_pid"]) == (engine, proxy), rec
        assert "1 in the container" in rec["action"] and ("kill", "-KILL", str(proxy)) in lab.argvs
        deadline = time.monotonic() + 5
        while Path(f"/proc/{proxy}/stat").exists() and Path(f"/proc/{proxy}/stat").read_text().split(") ")[1][0] not in "ZX":
            assert time.monotonic() < deadline, "the proxy still runs"
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ns.pid, signal.SIGKILL)
        ns.wait(timeout=10)
        ns.stdout.close()
        ns.stderr.close()
