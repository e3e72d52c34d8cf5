"""The faults of a drill (:mod:`dsv41.harness.drill`) and the lab hosts they are injected into.

Faults (what is done, on which simulated host; everything by service name, pid or interface,
never by process name). Services are driven through the hosts' service manager
(:mod:`dsv41.service_control`: ``systemctl``):

=================  =======================================================================
``engram_server``  ``systemctl stop dsv41-engram-server.service`` on x86host; cleared by
                   ``start``
``drafter_worker`` ``systemctl stop dsv41-drafter.service`` on x86host; cleared by ``start``
``async_proxy``    SIGKILL (by host pid) of the async drafting proxy on sparkhead: the child of
                   the engine (:func:`find_engine`: the ``dsv41-serve`` service's main pid, or
                   in a container the engine under the container's init) whose argv is
                   ``python -m dsv41.drafter.proxy_cli run ... --parent-pid <engine pid as the
                   engine sees it>``; nothing to clear (the engine's watchdog respawns it
                   within its budget), the respawn is checked (a new proxy pid)
``offload_link``   ``ip link set dev ofl0 down`` inside sparkhead; cleared by ``up``
``netem``          ``tc qdisc replace dev ofl0 root netem <spec>`` inside sparkhead (default
                   ``delay 60ms 20ms loss 5%``: RTT above the 100 ms lookup and round
                   deadlines part of the time; a kernel without sch_netem gets a ``tbf``
                   rate limit whose queue delays and drops instead, see :class:`Netem`);
                   cleared by ``tc qdisc del dev ofl0 root``
=================  =======================================================================

Also the checks of a drill request made before the lab is touched (fault names, netem words,
lab-only URLs, host / interface / program names). Lab only: every URL must be in
198.18.0.0/15 and the lab's host pid files (``<lab dir>/<host>.pid``) must exist.
"""

from __future__ import annotations

import abc
import dataclasses
import ipaddress
import re
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from dsv41 import fileio
from dsv41.errors import Dsv41Error
from dsv41.service_control import ServiceControl

LAB_NET = ipaddress.ip_network("198.18.0.0/15")

FAULTS: dict[str, str] = {
    "engram_server": "table server stopped (x86host dsv41-engram-server)",
    "drafter_worker": "drafter worker stopped (x86host dsv41-drafter)",
    "async_proxy": "async drafting proxy SIGKILLed (sparkhead, child of dsv41-serve's engine)",
    "offload_link": "offload link down (ip link set down inside the Spark's namespace)",
    "netem": "delay and loss on the offload link (tc netem inside the Spark's namespace)",
}
DEFAULT_NETEM = "delay 60ms 20ms loss 5%"
# Where sch_netem is missing: 4 Mbit/s with at most 150 ms of queue (longer waits are dropped).
FALLBACK_TBF = "rate 4mbit burst 32kb latency 150ms"
_IFACE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_HOST = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A container runtime command: one word (a path or a name on the host's PATH).
_RUNTIME = re.compile(r"^[A-Za-z0-9_./+-]{1,200}$")
#: ``docker inspect --format`` of a serving container: running, its PID 1 in the host's pid
#: namespace (0 when stopped), whether docker put its init (tini, ``--init``) in front of the
#: command. Docker prints ``<nil>`` for an Init nobody set.
CONTAINER_FORMAT = "{{.State.Running}} {{.State.Pid}} {{.HostConfig.Init}}"
# The runtime's answer for a name it does not know (docker: "Error: No such object: NAME", podman
# likewise in lower case), and nsenter's exit when the runtime is not on the host (execvp ENOENT).
_NO_SUCH_OBJECT = re.compile(r"no such (object|container)", re.IGNORECASE)
EXEC_ENOENT = 127
# tc netem words the drill passes on (anything else is refused before the lab is touched).
_NETEM_WORD = re.compile(
    r"^(delay|loss|duplicate|corrupt|reorder|distribution|normal|pareto|"
    r"\d+(\.\d+)?(us|ms|s|%)?)$"
)


class DrillError(Dsv41Error):
    """Bad drill input, a lab that is not there, or an injection / clearing that failed."""


# ---- request validation ------------------------------------------------------------------------


def parse_faults(text: str | Sequence[str]) -> list[str]:
    """``"a,b"`` (or a list) -> the fault names in order, ``all`` = every fault in :data:`FAULTS`.

    Raises DrillError naming the first unknown name and the known ones (before anything changes),
    or when the list is empty or names a fault twice."""
    parts = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    if parts == ["all"]:
        return list(FAULTS)
    if not parts:
        raise DrillError(f"drill: no fault named (known: {', '.join(FAULTS)}, or all)")
    for p in parts:
        if p not in FAULTS:
            raise DrillError(f"drill: unknown fault {p!r} (known: {', '.join(FAULTS)}, or all)")
    dup = sorted({p for p in parts if parts.count(p) > 1})
    if dup:
        raise DrillError(f"drill: fault {dup[0]!r} named twice")
    return parts


def parse_netem(spec: str) -> list[str]:
    """A ``tc netem`` argument string -> its words; DrillError on words outside delay / loss /
    duplicate / corrupt / reorder / distribution and numbers with us/ms/s/% units."""
    words = spec.split()
    if not words:
        raise DrillError("drill: --netem is empty")
    for w in words:
        if not _NETEM_WORD.match(w):
            raise DrillError(f"drill: --netem word {w!r} is not a delay/loss setting (e.g. {DEFAULT_NETEM!r})")
    return words


def check_lab_url(url: str, what: str) -> str:
    """``url`` unchanged when its host is an address in 198.18.0.0/15; DrillError otherwise (the
    drill injects faults and must never be pointed at anything but the lab)."""
    host = urlsplit(url).hostname or ""
    try:
        ok = ipaddress.ip_address(host) in LAB_NET
    except ValueError:
        ok = False
    if not ok:
        raise DrillError(f"drill: {what} {url} is not a lab address (198.18.0.0/15); the drill runs on the lab only")
    return url


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where each fault is injected: the simulated hosts, their services and the
    offload link (``link_host``'s interface ``link_iface``) that ``offload_link`` and ``netem``
    act on. Defaults are the lab inventory's (inventories/sim)."""

    offload_host: str = "x86host"
    engram_program: str = "dsv41-engram-server"
    drafter_program: str = "dsv41-drafter"
    head_host: str = "sparkhead"
    serve_program: str = "dsv41-serve"
    link_host: str = "sparkhead"
    link_iface: str = "ofl0"
    netem: str = DEFAULT_NETEM
    # roles/serve's serve_container: the engine runs in the container named ``serve_program``
    # (the role's ``docker run --name {{ serve_service }}``), started by ``container_runtime``.
    # None: ask the head host (:func:`engine_in_container`), so no copy of the role's default.
    serve_container: bool | None = None
    container_runtime: str = "/usr/bin/docker"

    def validate(self) -> Topology:
        for h in (self.offload_host, self.head_host, self.link_host):
            if not _HOST.match(h):
                raise DrillError(f"drill: bad host name {h!r}")
        for p in (self.engram_program, self.drafter_program, self.serve_program):
            if not _HOST.match(p):
                raise DrillError(f"drill: bad service name {p!r}")
        if not _IFACE.match(self.link_iface):
            raise DrillError(f"drill: bad interface name {self.link_iface!r}")
        if not _RUNTIME.match(self.container_runtime):
            raise DrillError(
                f"drill: bad container runtime {self.container_runtime!r} (one command, e.g. /usr/bin/docker)"
            )
        parse_netem(self.netem)
        return self


def parse_link(text: str) -> tuple[str, str]:
    """``HOST:IFACE`` -> ``(host, iface)``; DrillError otherwise."""
    host, sep, iface = text.partition(":")
    if not sep or not _HOST.match(host) or not _IFACE.match(iface):
        raise DrillError(f"drill: --link must be HOST:IFACE (e.g. sparkhead:ofl0), not {text!r}")
    return host, iface


# ---- the simulated hosts --------------------------------------------------------------------------

#: How ``nsenter`` enters a lab host (docs/lab.md): ``<host>.pid`` is its nspawn machine's
#: systemd, entered with every namespace (``nsenter -t LEADER -a``, as roles/lab does).
NSENTER_FLAGS: tuple[str, ...] = ("--all",)


class LabHosts:
    """Runs commands inside the lab's simulated hosts: ``nsenter`` into the process named by
    ``<lab_dir>/<host>.pid`` (the nspawn machine's systemd) with the namespaces of
    :data:`NSENTER_FLAGS`. ``ctl`` (:func:`dsv41.service_control.for_manager`)
    builds the hosts' service-manager commands."""

    def __init__(
        self,
        lab_dir: str | Path,
        ctl: ServiceControl,
        runner: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    ) -> None:
        self.lab_dir = Path(lab_dir)
        self.ctl = ctl
        self._run = runner

    def holder(self, host: str) -> str:
        """The pid of ``host``'s systemd (``<lab_dir>/<host>.pid``); DrillError when the lab is not up."""
        p = self.lab_dir / f"{host}.pid"
        try:
            pid = p.read_text().strip()
        except OSError:
            raise DrillError(f"drill: the lab is not up (no {p})") from None
        if not pid.isdigit() or not Path(f"/proc/{pid}").exists():
            raise DrillError(f"drill: the lab is not up ({p} names no running process)")
        return pid

    def run(
        self, host: str, argv: Sequence[str], check: bool = True, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess:
        """``argv`` inside ``host``; DrillError with its stderr when ``check`` and it fails."""
        cmd = ["nsenter", "--target", self.holder(host), *NSENTER_FLAGS, "--", *argv]
        try:
            r = self._run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise DrillError(f"drill: {' '.join(argv)} on {host}: no answer within {timeout_s:g} s") from None
        if check and r.returncode != 0:
            why = (r.stderr or r.stdout or "").strip().splitlines()
            raise DrillError(
                f"drill: {' '.join(argv)} on {host} failed (exit {r.returncode})" + (f": {why[-1]}" if why else "")
            )
        return r

    def program_state(self, host: str, program: str) -> str:
        """The state word of service ``program`` on ``host`` as its manager says it (active,
        inactive, failed, ...)."""
        r = self.run(host, self.ctl.state(program), check=False)
        return self.ctl.parse_state(program, r.stdout)

    def program_pid(self, host: str, program: str) -> int:
        """The main pid (in ``host``'s pid namespace) of running service ``program``; DrillError
        when it runs no process."""
        r = self.run(host, self.ctl.main_pid(program), check=False)
        pid = self.ctl.parse_main_pid(r.stdout)
        if pid is None:
            out = r.stdout.strip()
            raise DrillError(f"drill: {program} on {host} is not running ({out or r.stderr.strip()})")
        return pid

    def has_container(self, host: str, runtime: str, name: str) -> bool:
        """Whether container ``name`` exists on ``host``, running or not (``runtime inspect``
        answers; roles/serve runs it with ``--rm``, so it exists while its unit runs it). False
        when ``runtime`` is not on the host (nsenter's exit 127) or it knows no such object.
        DrillError naming host and cause for any other failure (daemon down, permission denied,
        no answer): the engine may then run in a container nobody can see."""
        r = self.run(host, [runtime, "inspect", "--format", CONTAINER_FORMAT, name], check=False)
        if r.returncode == 0:
            return True
        if r.returncode == EXEC_ENOENT or _NO_SUCH_OBJECT.search(r.stderr or ""):
            return False
        why = (r.stderr or r.stdout or "").strip().splitlines()
        raise DrillError(
            f"drill: cannot tell how the engine runs on {host}: {runtime} inspect {name} failed "
            f"(exit {r.returncode}{': ' + why[-1] if why else ''}); say it with --serve-container or "
            "--plain-engine (drill.yml: -e drill_serve_container=true|false)"
        )

    def container_pid(self, host: str, runtime: str, name: str) -> tuple[int, bool]:
        """``(pid, init)`` of running container ``name`` on ``host``: its PID 1 in ``host``'s pid
        namespace (``docker inspect``, :data:`CONTAINER_FORMAT`; dockerd runs inside the host, so
        the pid is one ``kill`` on the host takes) and whether that is docker's init (``--init``)
        rather than the command. DrillError naming host and container when there is no such
        container, it is not running, or the answer is not docker's."""
        r = self.run(host, [runtime, "inspect", "--format", CONTAINER_FORMAT, name], check=False)
        if r.returncode != 0:
            why = (r.stderr or r.stdout or "").strip().splitlines()
            raise DrillError(
                f"drill: no container {name} on {host} ({why[-1] if why else f'exit {r.returncode}'}); "
                "is the engine running in a container (serve_container)?"
            )
        words = r.stdout.split()
        if len(words) != 3 or words[0] not in ("true", "false") or not words[1].isdigit():
            raise DrillError(f"drill: container {name} on {host}: {runtime} inspect said {r.stdout.strip()[:200]!r}")
        if words[0] != "true" or int(words[1]) <= 0:
            raise DrillError(f"drill: container {name} on {host} is not running")
        return int(words[1]), words[2] == "true"

    def proc_tree(self, host: str, pid: int) -> tuple[Proc, list[Proc]]:
        """``pid`` on ``host`` and its children (``/proc/PID/task/*/children``), each a
        :class:`Proc`; DrillError when ``pid`` is gone or the answer cannot be read."""
        script = (
            "import json,os,sys\n"
            "def ns(p):\n"
            " for l in open(f'/proc/{p}/status'):\n"
            "  if l.startswith('NSpid:'):return int(l.split()[-1])\n"
            " return int(p)\n"
            "def one(p):\n"
            " a=open(f'/proc/{p}/cmdline','rb').read().split(b'\\0')\n"
            " return [int(p),ns(p),[x.decode('utf-8','replace') for x in a if x]]\n"
            "p=sys.argv[1];o=set();r=[]\n"
            "try:\n"
            " me=one(p)\n"
            " for t in os.listdir(f'/proc/{p}/task'):\n"
            "  o.update(open(f'/proc/{p}/task/{t}/children').read().split())\n"
            "except OSError:print('null');sys.exit()\n"
            "for c in sorted(o,key=int):\n"
            " try:r.append(one(c))\n"
            " except OSError:continue\n"
            "print(json.dumps([me,r]))"
        )
        r = self.run(host, ["python3", "-c", script, str(pid)])
        try:
            doc = fileio.loads_json(r.stdout)
            if doc is None:
                raise DrillError(f"drill: pid {pid} on {host} is gone")
            me, kids = doc
            return Proc.of(me), [Proc.of(k) for k in kids]
        except (ValueError, TypeError) as exc:
            raise DrillError(f"drill: cannot read pid {pid} and its children on {host}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Proc:
    """One process on a lab host as that host's ``/proc`` shows it."""

    pid: int  #: in the host's pid namespace: what ``kill`` on the host takes
    ns_pid: int  #: in its own (innermost) pid namespace, ``NSpid``'s last field: in a container, its getpid()
    argv: tuple[str, ...]

    @classmethod
    def of(cls, rec: Sequence) -> Proc:
        """``[pid, ns_pid, [argv...]]`` (the probe's JSON) -> Proc; TypeError/ValueError otherwise."""
        pid, ns_pid, argv = rec
        if not all(isinstance(a, str) for a in argv):
            raise TypeError(f"argv of pid {pid} is not strings")
        return cls(int(pid), int(ns_pid), tuple(argv))


@dataclasses.dataclass(frozen=True)
class Engine:
    """Rank 0's engine process as :func:`find_engine` found it: ``proc``, its ``children``,
    ``where`` (how it was found, for records and errors) and ``container`` (its name, None for
    a plain process)."""

    proc: Proc
    children: tuple[Proc, ...]
    where: str
    container: str | None

    def proxy(self) -> Proc | None:
        """The async proxy among :attr:`children` (:func:`proxy_pid`: its ``--parent-pid`` is
        the engine's own pid, the container's numbering inside a container), None if absent."""
        pid = proxy_pid(((c.pid, list(c.argv)) for c in self.children), self.proc.ns_pid)
        return next((c for c in self.children if c.pid == pid), None)


def engine_in_container(hosts: LabHosts, host: str, topo: Topology) -> bool:
    """Whether rank 0's engine on ``host`` runs in a container: ``topo.serve_container`` when set
    (``--serve-container/--plain-engine``), else whether the host has the container named
    ``topo.serve_program`` (:meth:`LabHosts.has_container` through ``topo.container_runtime``).
    The host is asked because the drill does not run roles/serve, whose default decides it.
    Raises DrillError (one line) when the host cannot tell."""
    if topo.serve_container is not None:
        return topo.serve_container
    return hosts.has_container(host, topo.container_runtime, topo.serve_program)


def find_engine(hosts: LabHosts, host: str, topo: Topology) -> Engine:
    """The serving engine on ``host``, for either runtime of roles/serve
    (:func:`engine_in_container`). Every fault or probe that needs the engine's pid goes through here.

    * plain process: the main pid of service ``topo.serve_program`` (its manager says it);
    * container: the unit's main pid is the ``docker run`` client, and the engine lives under
      containerd-shim -> docker-init -> engine. ``docker inspect`` of the container named
      ``topo.serve_program`` gives its PID 1 in the host's pid namespace; with docker's init
      (``--init``, the role's launch) the engine is that init's first child (the lowest pid in
      the container: tini forks the command once, at start; a process orphaned later inside
      the container is reparented to the init with a higher pid), else PID 1 itself.

    Raises DrillError naming host and service / container when the engine is not running, or
    (with ``topo.serve_container`` None) the host cannot tell how it runs."""
    if not engine_in_container(hosts, host, topo):
        proc, kids = hosts.proc_tree(host, hosts.program_pid(host, topo.serve_program))
        return Engine(proc, tuple(kids), f"{topo.serve_program} (pid {proc.pid})", None)
    name = topo.serve_program
    pid1, init = hosts.container_pid(host, topo.container_runtime, name)
    proc, kids = hosts.proc_tree(host, pid1)
    if init:
        if not kids:
            raise DrillError(f"drill: container {name} on {host}: its init (pid {pid1}) runs no engine")
        proc, kids = hosts.proc_tree(host, min(kids, key=lambda k: k.ns_pid).pid)
    return Engine(proc, tuple(kids), f"container {name} (engine pid {proc.pid}, {proc.ns_pid} in the container)", name)


def proxy_pid(children: Iterable[tuple[int, list[str]]], engine_pid: int) -> int | None:
    """The async proxy among the engine's ``children``: how ``AsyncSpeculator._spawn`` starts it,
    ``python -m dsv41.drafter.proxy_cli run ... --parent-pid <engine_pid>`` (or ``dsv41 proxy
    run ...`` with a custom ``proxy_cmd``); None if absent."""
    for pid, argv in children:
        pairs = list(zip(argv, argv[1:], strict=False))
        if (
            ("--parent-pid", str(engine_pid)) in pairs
            and (("-m", "dsv41.drafter.proxy_cli") in pairs or ("proxy", "run") in pairs)
            and "run" in argv
        ):
            return pid
    return None


# ---- faults ------------------------------------------------------------------------------------


class Fault(abc.ABC):
    """One fault: ``inject`` and ``clear`` return a JSON-able record of what was done; ``clear``
    is idempotent (it is also the playbook's ``always``: ``dsv41 drill clear``)."""

    name = ""
    host = ""

    def __init__(self, hosts: LabHosts, topo: Topology) -> None:
        self.hosts, self.topo = hosts, topo

    @abc.abstractmethod
    def inject(self) -> dict:
        """Start the fault; the record of what was done."""

    @abc.abstractmethod
    def clear(self) -> dict:
        """End the fault (idempotent); the record of what was done."""


class _ProgramStop(Fault):
    program = ""

    def inject(self) -> dict:
        argv = self.hosts.ctl.stop(self.program)
        self.hosts.run(self.host, argv)
        return {"host": self.host, "action": self.hosts.ctl.describe(argv)}

    def clear(self) -> dict:
        ctl = self.hosts.ctl
        state = self.hosts.program_state(self.host, self.program)
        if state in ctl.up_states:
            return {"host": self.host, "action": "none", "state": state}
        # A unit that spent its restart budget refuses a start until its start limit is cleared
        # (what control.yml does before an operator's start).
        if state == "failed":
            self.hosts.run(self.host, ctl.reset_failed(self.program))
        argv = ctl.start(self.program)
        self.hosts.run(self.host, argv, timeout_s=180)
        return {"host": self.host, "action": ctl.describe(argv), "was": state}


class EngramServerStop(_ProgramStop):
    name = "engram_server"

    def __init__(self, hosts, topo):
        super().__init__(hosts, topo)
        self.host, self.program = topo.offload_host, topo.engram_program


class DrafterWorkerStop(_ProgramStop):
    name = "drafter_worker"

    def __init__(self, hosts, topo):
        super().__init__(hosts, topo)
        self.host, self.program = topo.offload_host, topo.drafter_program


class AsyncProxyKill(Fault):
    """SIGKILL of the proxy process by pid; the engine's watchdog must respawn it."""

    name = "async_proxy"

    def __init__(self, hosts, topo):
        super().__init__(hosts, topo)
        self.host = topo.head_host
        self.killed: int | None = None

    def inject(self) -> dict:
        engine = find_engine(self.hosts, self.host, self.topo)
        proxy = engine.proxy()
        if proxy is None:
            raise DrillError(
                f"drill: no async proxy process under {engine.where} on {self.host}: "
                "is DSV41_DRAFTER_ASYNC=1 in production?"
            )
        self.hosts.run(self.host, ["kill", "-KILL", str(proxy.pid)])
        self.killed = proxy.pid
        return {
            "host": self.host,
            "action": f"kill -KILL {proxy.pid} (async proxy, child of {engine.where})",
            "engine_pid": engine.proc.pid,
            "proxy_pid": proxy.pid,
            "container": engine.container,
        }

    def clear(self) -> dict:
        proxy = find_engine(self.hosts, self.host, self.topo).proxy()
        pid = proxy.pid if proxy else None
        return {
            "host": self.host,
            "action": "none (the engine's watchdog respawns the proxy)",
            "proxy_pid": pid,
            "respawned": pid is not None and pid != self.killed,
        }


class LinkDown(Fault):
    name = "offload_link"

    def __init__(self, hosts, topo):
        super().__init__(hosts, topo)
        self.host, self.iface = topo.link_host, topo.link_iface

    def _up(self) -> bool:
        r = self.hosts.run(self.host, ["ip", "-o", "link", "show", "dev", self.iface])
        flags = re.search(r"<([^>]*)>", r.stdout)
        return bool(flags and "UP" in flags.group(1).split(","))

    def inject(self) -> dict:
        self.hosts.run(self.host, ["ip", "link", "set", "dev", self.iface, "down"])
        return {"host": self.host, "action": f"ip link set dev {self.iface} down"}

    def clear(self) -> dict:
        if self._up():
            return {"host": self.host, "action": "none", "iface": self.iface}
        self.hosts.run(self.host, ["ip", "link", "set", "dev", self.iface, "up"])
        return {"host": self.host, "action": f"ip link set dev {self.iface} up"}


class Netem(Fault):
    """Delay and loss on the link: ``tc netem``. A kernel built without sch_netem (tc answers
    "Specified qdisc kind is unknown"; this machine's lab kernel is one) gets the closest thing
    tc still has, a token-bucket filter (:data:`FALLBACK_TBF`): packets queue behind the rate
    (delay) and those that would wait longer than its ``latency`` are dropped (loss). The record
    says which qdisc was used."""

    name = "netem"

    def __init__(self, hosts, topo):
        super().__init__(hosts, topo)
        self.host, self.iface, self.words = topo.link_host, topo.link_iface, parse_netem(topo.netem)

    def inject(self) -> dict:
        base = ["tc", "qdisc", "replace", "dev", self.iface, "root"]
        r = self.hosts.run(self.host, [*base, "netem", *self.words], check=False)
        if r.returncode == 0:
            return {
                "host": self.host,
                "qdisc": "netem",
                "action": f"tc qdisc replace dev {self.iface} root netem {' '.join(self.words)}",
            }
        if "unknown" not in (r.stderr or "").lower():
            self.hosts.run(self.host, [*base, "netem", *self.words])  # the same failure, as one line
        self.hosts.run(self.host, [*base, "tbf", *FALLBACK_TBF.split()])
        return {
            "host": self.host,
            "qdisc": "tbf",
            "action": f"tc qdisc replace dev {self.iface} root tbf {FALLBACK_TBF} (the kernel has no sch_netem)",
        }

    def clear(self) -> dict:
        r = self.hosts.run(self.host, ["tc", "qdisc", "show", "dev", self.iface, "root"])
        kinds = r.stdout.split()[1:2]
        if kinds not in (["netem"], ["tbf"]):
            return {"host": self.host, "action": "none", "iface": self.iface}
        self.hosts.run(self.host, ["tc", "qdisc", "del", "dev", self.iface, "root"])
        return {"host": self.host, "action": f"tc qdisc del dev {self.iface} root ({kinds[0]})"}


FAULT_CLASSES: dict[str, type[Fault]] = {
    c.name: c for c in (EngramServerStop, DrafterWorkerStop, AsyncProxyKill, LinkDown, Netem)
}


def clear_all(hosts: LabHosts, topo: Topology, names: Iterable[str] | None = None) -> dict[str, dict]:
    """Clear every fault (or ``names``), each attempted even when another fails; ``{name: record}``
    (``{"error": line}`` for one that could not be cleared)."""
    out = {}
    for n in names or FAULTS:
        try:
            out[n] = FAULT_CLASSES[n](hosts, topo).clear()
        except Dsv41Error as exc:
            out[n] = {"error": str(exc)}
    return out
