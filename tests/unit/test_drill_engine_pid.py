"""Every drill fault finds rank 0's engine for both serve runtimes of roles/serve (issue 22).

Plain process: the engine is the ``dsv41-serve`` service's main pid. Container: the unit's main pid
is the ``docker run`` client and the engine lives under containerd-shim -> docker-init -> engine ->
proxy, with the proxy's ``--parent-pid`` in the container's numbering. Enumerated from the code's
own definitions: every fault of ``drill_faults.FAULTS`` (its name table) x both runtimes x every
service manager x the runtime said (``--serve-container/--plain-engine``) or asked of the host
(auto: ``docker inspect dsv41-serve``) is injected and cleared against a process-tree fake of the
host (``TreeLab``: the manager is servicectlutil's real fake, ``/proc`` and ``docker inspect``
come from a table), and the pids it signals are checked; every lookup of the engine's pid or
children anywhere in python/dsv41 goes through ``drill_faults.find_engine`` (an AST scan and a
runtime guard); the failures (no container, stopped, no engine under the init, no proxy, a bad
answer, a host that cannot say whether it has the container) are one DrillError line naming host
and cause; ``dsv41 drill run`` asks once, before any fault. drill.yml's own argv: test_drill_yml_runtime.py."""

from __future__ import annotations

import ast
import contextlib
import json
import subprocess
from pathlib import Path

import pytest

from dsv41.cli import main
from dsv41.harness import drill_faults
from dsv41.harness.drill_faults import DrillError
from dsv41.service_control import MANAGERS
from servicectlutil import FakeLab, FakeManager

ROOT = Path(__file__).resolve().parents[2]
TOPO = drill_faults.Topology(serve_container=False)
CTOPO = drill_faults.Topology(serve_container=True)
ATOPO = drill_faults.Topology()  # auto: the head host is asked
ENGINE = ["/opt/dsv41/venv/bin/dsv41", "engine", "serve", "--rank", "0"]


def proxy_argv(parent_ns_pid: int) -> list[str]:
    """The async proxy's argv as AsyncSpeculator._spawn builds it."""
    return [
        "/opt/dsv41/venv/bin/python",
        "-m",
        "dsv41.drafter.proxy_cli",
        "run",
        "--shm",
        "/dsv41-ring",
        "--parent-pid",
        str(parent_ns_pid),
    ]


# host pid -> (parent host pid, pid in its own namespace, argv); MAIN: the service's main pid.
PLAIN = {
    "main": 500,
    "engine": 500,
    "proxy": 501,
    "container": None,
    "procs": {
        1: (0, 1, ["/lib/systemd/systemd"]),
        500: (1, 500, ENGINE),
        501: (500, 501, proxy_argv(500)),
        502: (500, 502, ["/opt/dsv41/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main"]),
    },
}
CONTAINER = {
    "main": 600,
    "engine": 702,
    "proxy": 703,
    "container": ("true", 701, "true"),
    "procs": {
        1: (0, 1, ["/lib/systemd/systemd"]),
        600: (1, 600, ["/usr/bin/docker", "run", "--rm", "--name", "dsv41-serve", "--init", "sha256:ab", *ENGINE[1:]]),
        650: (1, 650, ["/usr/bin/dockerd", "-H", "fd://"]),
        700: (1, 700, ["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", "c0ffee"]),
        701: (700, 1, ["/sbin/docker-init", "--", *ENGINE[1:]]),
        702: (701, 7, ENGINE),
        703: (702, 8, proxy_argv(7)),
        704: (702, 9, ["/opt/dsv41/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main"]),
        # a proxy orphaned by an earlier engine, reparented to the init: never the engine, never killed
        705: (701, 12, proxy_argv(3)),
    },
}
RUNTIMES = {"plain": (PLAIN, TOPO), "container": (CONTAINER, CTOPO)}
MODES = ("explicit", "auto")


class TreeLab(FakeLab):
    """servicectlutil's fake lab (service manager, link, qdisc) whose host has the process table
    ``tree`` (PLAIN / CONTAINER shape): the probe of ``LabHosts.proc_tree`` and ``docker
    inspect`` answer from it, ``kill`` removes a pid, and killing the engine's proxy makes the
    engine's watchdog respawn it with new pids (``kills``: the pids signalled). ``inspect_reply``
    ``(rc, stderr)``: every ``docker inspect`` answers that failure instead ("timeout": no answer)."""

    inspect_reply: tuple[int, str] | str | None = None

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
        argv = list(cmd[cmd.index("--") + 1 :])
        if argv[:2] == ["python3", "-c"]:
            self.entries.append(tuple(cmd[3 : cmd.index("--")]))
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
            if self.inspect_reply == "timeout":
                raise subprocess.TimeoutExpired(cmd, kw.get("timeout", 60))
            if self.inspect_reply:
                return self._reply(cmd, self.inspect_reply[0], "", self.inspect_reply[1] + "\n")
            if self.container is None or argv[4] != CTOPO.serve_program:
                return self._reply(cmd, 1, "", f"Error: No such object: {argv[4]}\n")
            return self._reply(cmd, out=" ".join(map(str, self.container)) + "\n")
        return super().__call__(cmd, **kw)


# Per fault class: whether it needs rank 0's engine. Keyed by class name so that a new fault class
# fails test_every_fault_class_is_classified until it is said here.
NEEDS_ENGINE = {
    "EngramServerStop": False,
    "DrafterWorkerStop": False,
    "AsyncProxyKill": True,
    "LinkDown": False,
    "Netem": False,
}
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("manager", MANAGERS)
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("fault", list(drill_faults.FAULTS))
def test_every_fault_acts_on_the_right_pid(
    fault: str, runtime: str, manager: str, mode: str, tmp_path: Path, guarded
) -> None:
    tree, topo = RUNTIMES[runtime]
    topo = topo if mode == "explicit" else ATOPO
    lab = TreeLab(tmp_path, manager, tree)
    f = drill_faults.FAULT_CLASSES[fault](lab.hosts, topo)
    rec = f.inject()
    out = f.clear()
    needs = NEEDS_ENGINE[type(f).__name__]
    assert bool(guarded) == needs and set(guarded) <= {topo.head_host}, guarded
    # docker is asked only to find the engine: when it runs in a container, or to learn whether it does
    assert bool(lab.inspects) == (needs and (runtime == "container" or mode == "auto")), lab.inspects
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
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in names
                and fn != allowed
            ):
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "case, tree, expect",
    [
        (
            "no container",
            _tree(CONTAINER, container=None),
            "no container dsv41-serve on sparkhead (Error: No such object",
        ),
        (
            "stopped",
            _tree(CONTAINER, container=("false", 0, "true")),
            "container dsv41-serve on sparkhead is not running",
        ),
        (
            "no engine",
            _tree(CONTAINER, drop=(702, 703, 704, 705)),
            "container dsv41-serve on sparkhead: its init (pid 701) runs no engine",
        ),
        (
            "no proxy",
            _tree(CONTAINER, drop=(703,)),
            "no async proxy process under container dsv41-serve (engine pid 702, 7 in the container) on sparkhead",
        ),
        (
            "bad answer",
            _tree(CONTAINER, container=("[]",)),
            "container dsv41-serve on sparkhead: /usr/bin/docker inspect said",
        ),
        ("gone", _tree(CONTAINER, drop=(701,)), "pid 701 on sparkhead is gone"),
    ],
)
def test_container_failures_are_one_line(case: str, tree: dict, expect: str, mode: str, tmp_path: Path) -> None:
    topo = CTOPO if mode == "explicit" else ATOPO
    if case == "no container" and mode == "auto":
        # no container: the plain path, where the service's main pid is the docker client
        expect, case = "no async proxy process under dsv41-serve (pid 600) on sparkhead", "no proxy"
    lab = TreeLab(tmp_path, "systemd", tree)
    with pytest.raises(DrillError) as exc:
        drill_faults.AsyncProxyKill(lab.hosts, topo).inject()
    assert expect in _one_line(exc, "sparkhead"), (case, str(exc.value))
    assert lab.kills == []
    # clear_all keeps going: the other faults clear, this one is its error line (an engine
    # without a proxy is not an error to clear: it is recorded as not respawned)
    out = drill_faults.clear_all(lab.hosts, topo)
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
    tree = _tree(
        CONTAINER,
        container=("true", 702, "<nil>"),
        engine=702,
        drop=(701, 705),
        procs={702: (700, 1, ENGINE), 703: (702, 8, proxy_argv(1)), 704: (702, 9, ["x"])},
    )
    lab = TreeLab(tmp_path, "systemd", tree)
    rec = drill_faults.AsyncProxyKill(lab.hosts, CTOPO).inject()
    assert lab.kills == [703] and rec["engine_pid"] == 702 and "1 in the container" in rec["action"]


# ---- auto: how the drill learns the runtime from the head host ---------------------------------

# What a host can answer to ``docker inspect dsv41-serve`` when it has no such container, or cannot
# say: (rc, stderr) -> None (plain) or the words of the one error line.
NO_CONTAINER = {
    "runtime not installed": (127, "nsenter: failed to execute /usr/bin/docker: No such file or directory"),
    "docker: no such object": (1, "Error: No such object: dsv41-serve"),
    "podman: no such object": (125, 'Error: no such object: "dsv41-serve"'),
}
CANNOT_TELL = {
    "daemon down": (
        1,
        "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?",
    ),
    "permission denied": (
        1,
        "permission denied while trying to connect to the Docker daemon socket at "
        'unix:///var/run/docker.sock: Get "http://%2Fvar%2Frun%2Fdocker.sock/v1.47/containers/json"',
    ),
    "runtime not executable": (126, "nsenter: failed to execute /usr/bin/docker: Permission denied"),
    "no stderr": (2, ""),
}


@pytest.mark.parametrize("manager", MANAGERS)
@pytest.mark.parametrize("case", NO_CONTAINER)
def test_auto_without_the_container_is_the_plain_engine(case: str, manager: str, tmp_path: Path) -> None:
    lab = TreeLab(tmp_path, manager, PLAIN)
    lab.inspect_reply = NO_CONTAINER[case]
    assert drill_faults.engine_in_container(lab.hosts, "sparkhead", ATOPO) is False
    rec = drill_faults.AsyncProxyKill(lab.hosts, ATOPO).inject()
    assert lab.kills == [PLAIN["proxy"]] and rec["engine_pid"] == PLAIN["engine"] and rec["container"] is None, rec


@pytest.mark.parametrize("case", CANNOT_TELL)
def test_auto_when_the_host_cannot_tell_is_one_line(case: str, tmp_path: Path) -> None:
    """Any other inspect failure may hide a container: one line naming host and cause, nothing
    signalled; clear_all still clears the other faults."""
    rc, err = CANNOT_TELL[case]
    lab = TreeLab(tmp_path, "systemd", CONTAINER)
    lab.inspect_reply = (rc, err)
    want = [
        "cannot tell how the engine runs on sparkhead",
        f"(exit {rc}",
        "--serve-container or --plain-engine",
        *([err.splitlines()[-1]] if err else []),
    ]
    with pytest.raises(DrillError) as exc:
        drill_faults.AsyncProxyKill(lab.hosts, ATOPO).inject()
    _one_line(exc, *want)
    assert lab.kills == []
    out = drill_faults.clear_all(lab.hosts, ATOPO)
    assert all("error" not in r for n, r in out.items() if n != "async_proxy"), out
    assert "cannot tell how the engine runs on sparkhead" in out["async_proxy"]["error"], out
    # said explicitly, nobody asks the host
    lab.inspects.clear()
    assert drill_faults.engine_in_container(lab.hosts, "sparkhead", TOPO) is False and lab.inspects == []


def test_auto_when_the_host_does_not_answer_is_one_line(tmp_path: Path) -> None:
    lab = TreeLab(tmp_path, "systemd", CONTAINER)
    lab.inspect_reply = "timeout"
    with pytest.raises(DrillError) as exc:
        drill_faults.engine_in_container(lab.hosts, "sparkhead", ATOPO)
    _one_line(exc, "inspect", "on sparkhead: no answer within")


def _run_cli(lab: TreeLab, tmp_path: Path, monkeypatch, *args: str) -> tuple[int, list[str]]:
    """``dsv41 drill run`` against ``lab`` (its hosts instead of the real nsenter); the drill
    itself is replaced by recording the topology it was given."""
    from dsv41.harness import drill, drill_cli

    seen: list = []
    monkeypatch.setattr(drill_cli, "_lab_hosts", lambda *a: lab.hosts)
    monkeypatch.setattr(drill, "run_drill", lambda params, hosts, topo, **kw: seen.append(topo))
    refs = tmp_path / "refs.json"
    refs.write_text("{}")
    rc = main(
        [
            "drill",
            "run",
            "--faults",
            "async_proxy",
            "--refs",
            str(refs),
            "--out-dir",
            str(tmp_path / "d"),
            "--id",
            "t",
            *args,
        ]
    )
    return rc, seen


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_run_asks_once_before_any_fault(runtime: str, mode: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """The drill is given the runtime decided (said or asked); the report records it and how."""
    tree, topo = RUNTIMES[runtime]
    lab = TreeLab(tmp_path, "systemd", tree)
    flag = {"plain": ["--plain-engine"], "container": ["--serve-container"]}[runtime] if mode == "explicit" else []
    rc, seen = _run_cli(lab, tmp_path, monkeypatch, *flag)
    assert rc == 1 and "no fault ran" in capsys.readouterr().err  # the replaced drill ran no fault
    assert [t.serve_container for t in seen] == [topo.serve_container]
    params = json.loads((tmp_path / "d" / "t" / "report.json").read_text())["params"]
    assert (params["serve_container"], params["serve_container_detected"]) == (topo.serve_container, mode == "auto")


def test_run_refuses_a_host_that_cannot_tell_before_any_fault(tmp_path: Path, monkeypatch, capsys) -> None:
    lab = TreeLab(tmp_path, "systemd", CONTAINER)
    lab.inspect_reply = CANNOT_TELL["daemon down"]
    rc, seen = _run_cli(lab, tmp_path, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "cannot tell how the engine runs on sparkhead" in err[0], err
    assert seen == [] and lab.kills == [] and lab.mgr.calls() == [] and not (tmp_path / "d").exists()


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

    code = (
        "import os,subprocess,sys,time\n"
        "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(120)','-m','dsv41.drafter.proxy_cli',"
        "'run','--parent-pid',str(os.getpid())])\n"
        "print(os.getpid(),flush=True)\n"
        "time.sleep(120)\n"
    )
    ns = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
                if cmd[cmd.index("--") + 1 :][1:2] == ["inspect"]:
                    return self._reply(cmd, out=f"true {engine} <nil>\n")
                return super().__call__(cmd, **kw)

        mgr = FakeManager(tmp_path / "mgr", "systemd", {TOPO.serve_program: "up"}, {TOPO.serve_program: ns.pid})
        lab = Inspect(tmp_path, mgr)
        rec = drill_faults.AsyncProxyKill(lab.hosts, CTOPO).inject()
        assert (rec["engine_pid"], rec["proxy_pid"]) == (engine, proxy), rec
        assert "1 in the container" in rec["action"] and ("kill", "-KILL", str(proxy)) in lab.argvs
        deadline = time.monotonic() + 5
        while (
            Path(f"/proc/{proxy}/stat").exists()
            and Path(f"/proc/{proxy}/stat").read_text().split(") ")[1][0] not in "ZX"
        ):
            assert time.monotonic() < deadline, "the proxy still runs"
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ns.pid, signal.SIGKILL)
        ns.wait(timeout=10)
        ns.stdout.close()
        ns.stderr.close()
