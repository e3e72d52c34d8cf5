"""Fault drills under load on the three-host lab (issue 12): inject a fault, clear it, measure.

For each fault in turn (:data:`FAULTS`), with the bench client (:mod:`dsv41.harness.bench`,
several concurrent streams over the spec's short, code and long prompts) keeping the API busy:

1. ``baseline_s`` seconds of load with nothing wrong;
2. the fault is injected and held for ``duration_s`` seconds;
3. the fault is cleared; the drill waits until the system has recovered (:func:`recovery_time`)
   or ``recover_timeout_s`` passed, then stops the load (requests in flight finish);
4. the six greedy references are verified (``refs.check``: 6/6 identical, and while they run
   every rank counts remote Engram lookups with zero fallbacks and rank 0 drafts remotely).

A sampler reads rank 0's ``/metrics`` every ``interval_s`` seconds: ``dsv41_engram_*_total
{rank="R"}`` carries every rank's row-source counters (rank 1 is headless and has no HTTP
endpoint of its own; the engine gathers its counters), ``dsv41_drafter_*_total`` the speculator's
(fail-closed rounds, proxy respawns), ``vllm:generation_tokens_total`` the tokens generated.
The table server's and the drafter worker's own ``/metrics`` are read too (best effort: they are
down during their own fault).

Faults (what is done, on which simulated host; everything by supervisor program, pid or
interface, never by process name):

=================  =======================================================================
``engram_server``  ``supervisorctl stop dsv41-engram-server`` on x86host; cleared by ``start``
``drafter_worker`` ``supervisorctl stop dsv41-drafter`` on x86host; cleared by ``start``
``async_proxy``    SIGKILL of the async drafting proxy on sparkhead: the child of the
                   ``dsv41-serve`` program's pid whose argv is ``python -m
                   dsv41.drafter.proxy_cli run ... --parent-pid <that pid>``; nothing to clear (the engine's watchdog respawns it within its
                   budget), the respawn is checked (a new proxy pid)
``offload_link``   ``ip link set dev ofl0 down`` inside sparkhead; cleared by ``up``
``netem``          ``tc qdisc replace dev ofl0 root netem <spec>`` inside sparkhead (default
                   ``delay 60ms 20ms loss 5%``: RTT above the 100 ms lookup and round
                   deadlines part of the time; a kernel without sch_netem gets a ``tbf``
                   rate limit whose queue delays and drops instead, see :class:`Netem`);
                   cleared by ``tc qdisc del dev ofl0 root``
=================  =======================================================================

The report (``drills/<id>/``): ``report.json`` (:func:`build_report`), ``summary.md``
(:func:`summary_markdown`) and ``timeline.png`` (:func:`plot_timeline`). Lab only: every URL must
be in 198.18.0.0/15 and the lab's holder pid files must exist.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as _dt
import ipaddress
import json
import math
import re
import shlex
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Sequence
from urllib.parse import urlsplit

from dsv41 import fileio
from dsv41.errors import Dsv41Error

FORMAT = "dsv41-drill-report/1"
LAB_NET = ipaddress.ip_network("198.18.0.0/15")

FAULTS: dict[str, str] = {
    "engram_server": "table server stopped (x86host dsv41-engram-server)",
    "drafter_worker": "drafter worker stopped (x86host dsv41-drafter)",
    "async_proxy": "async drafting proxy SIGKILLed (sparkhead, child of dsv41-serve)",
    "offload_link": "offload link down (ip link set down inside the Spark's namespace)",
    "netem": "delay and loss on the offload link (tc netem inside the Spark's namespace)",
}
DEFAULT_NETEM = "delay 60ms 20ms loss 5%"
# Where sch_netem is missing: 4 Mbit/s with at most 150 ms of queue (longer waits are dropped).
FALLBACK_TBF = "rate 4mbit burst 32kb latency 150ms"
_IFACE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_HOST = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# tc netem words the drill passes on (anything else is refused before the lab is touched).
_NETEM_WORD = re.compile(r"^(delay|loss|duplicate|corrupt|reorder|distribution|normal|pareto|"
                         r"\d+(\.\d+)?(us|ms|s|%)?)$")


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
    """Where each fault is injected: the simulated hosts, their supervisor programs and the
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

    def validate(self) -> "Topology":
        for h in (self.offload_host, self.head_host, self.link_host):
            if not _HOST.match(h):
                raise DrillError(f"drill: bad host name {h!r}")
        for p in (self.engram_program, self.drafter_program, self.serve_program):
            if not _HOST.match(p):
                raise DrillError(f"drill: bad supervisor program name {p!r}")
        if not _IFACE.match(self.link_iface):
            raise DrillError(f"drill: bad interface name {self.link_iface!r}")
        parse_netem(self.netem)
        return self


def parse_link(text: str) -> tuple[str, str]:
    """``HOST:IFACE`` -> ``(host, iface)``; DrillError otherwise."""
    host, sep, iface = text.partition(":")
    if not sep or not _HOST.match(host) or not _IFACE.match(iface):
        raise DrillError(f"drill: --link must be HOST:IFACE (e.g. sparkhead:ofl0), not {text!r}")
    return host, iface


# ---- the simulated hosts --------------------------------------------------------------------------

class LabHosts:
    """Runs commands inside the lab's simulated hosts: ``nsenter`` into the holder process named by
    ``<lab_dir>/<host>.pid`` (its mount, net, uts and pid namespaces; the same entry as the lab
    connection plugin). ``supervisorctl`` is the argv prefix of the hosts' supervisorctl."""

    def __init__(self, lab_dir: str | Path, supervisorctl: Sequence[str],
                 runner: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
        self.lab_dir = Path(lab_dir)
        self.supervisorctl = list(supervisorctl)
        self._run = runner

    def holder(self, host: str) -> str:
        """The holder pid of ``host``; DrillError when the lab is not up."""
        p = self.lab_dir / f"{host}.pid"
        try:
            pid = p.read_text().strip()
        except OSError:
            raise DrillError(f"drill: the lab is not up (no {p})") from None
        if not pid.isdigit() or not Path(f"/proc/{pid}").exists():
            raise DrillError(f"drill: the lab is not up ({p} names no running process)")
        return pid

    def run(self, host: str, argv: Sequence[str], check: bool = True, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """``argv`` inside ``host``; DrillError with its stderr when ``check`` and it fails."""
        cmd = ["nsenter", "--target", self.holder(host), "--mount", "--net", "--uts", "--pid", "--", *argv]
        try:
            r = self._run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise DrillError(f"drill: {' '.join(argv)} on {host}: no answer within {timeout_s:g} s") from None
        if check and r.returncode != 0:
            why = (r.stderr or r.stdout or "").strip().splitlines()
            raise DrillError(f"drill: {' '.join(argv)} on {host} failed (exit {r.returncode})"
                             + (f": {why[-1]}" if why else ""))
        return r

    def program_state(self, host: str, program: str) -> str:
        """The supervisor state word of ``program`` on ``host`` (RUNNING, STOPPED, ...)."""
        r = self.run(host, [*self.supervisorctl, "status", program], check=False)
        words = r.stdout.split()
        return words[1] if len(words) > 1 and words[0] == program else "UNKNOWN"

    def program_pid(self, host: str, program: str) -> int:
        """The pid (in ``host``'s pid namespace) of a RUNNING supervisor program."""
        r = self.run(host, [*self.supervisorctl, "pid", program], check=False)
        out = r.stdout.strip()
        if not out.isdigit() or int(out) <= 1:
            raise DrillError(f"drill: {program} on {host} is not running ({out or r.stderr.strip()})")
        return int(out)

    def children(self, host: str, pid: int) -> list[tuple[int, list[str]]]:
        """``[(child pid, argv)]`` of ``pid`` inside ``host`` (``/proc/PID/task/*/children``)."""
        script = ("import json,os,sys;p=sys.argv[1];o=set();r=[]\n"
                  "for t in os.listdir(f'/proc/{p}/task'):\n"
                  " o.update(open(f'/proc/{p}/task/{t}/children').read().split())\n"
                  "for c in sorted(o,key=int):\n"
                  " try:a=open(f'/proc/{c}/cmdline','rb').read().split(b'\\0')\n"
                  " except OSError:continue\n"
                  " r.append([int(c),[x.decode('utf-8','replace') for x in a if x]])\n"
                  "print(json.dumps(r))")
        r = self.run(host, ["python3", "-c", script, str(pid)])
        try:
            return [(int(c), list(argv)) for c, argv in json.loads(r.stdout)]
        except (ValueError, TypeError) as exc:
            raise DrillError(f"drill: cannot read the children of pid {pid} on {host}: {exc}") from None


def proxy_pid(children: Iterable[tuple[int, list[str]]], engine_pid: int) -> int | None:
    """The async proxy among the engine's ``children``: how ``AsyncSpeculator._spawn`` starts it,
    ``python -m dsv41.drafter.proxy_cli run ... --parent-pid <engine_pid>`` (or ``dsv41 proxy
    run ...`` with a custom ``proxy_cmd``); None if absent."""
    for pid, argv in children:
        pairs = list(zip(argv, argv[1:]))
        if ("--parent-pid", str(engine_pid)) in pairs and (
                ("-m", "dsv41.drafter.proxy_cli") in pairs or ("proxy", "run") in pairs) and "run" in argv:
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
        self.hosts.run(self.host, [*self.hosts.supervisorctl, "stop", self.program])
        return {"host": self.host, "action": f"supervisorctl stop {self.program}"}

    def clear(self) -> dict:
        state = self.hosts.program_state(self.host, self.program)
        if state == "RUNNING":
            return {"host": self.host, "action": "none", "state": state}
        self.hosts.run(self.host, [*self.hosts.supervisorctl, "start", self.program], timeout_s=180)
        return {"host": self.host, "action": f"supervisorctl start {self.program}", "was": state}


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

    def _find(self) -> tuple[int, int | None]:
        engine = self.hosts.program_pid(self.host, self.topo.serve_program)
        return engine, proxy_pid(self.hosts.children(self.host, engine), engine)

    def inject(self) -> dict:
        engine, pid = self._find()
        if pid is None:
            raise DrillError(f"drill: no async proxy process under {self.topo.serve_program} (pid {engine}) on "
                             f"{self.host}: is DSV41_DRAFTER_ASYNC=1 in production?")
        self.hosts.run(self.host, ["kill", "-KILL", str(pid)])
        self.killed = pid
        return {"host": self.host, "action": f"kill -KILL {pid} (async proxy, child of engine pid {engine})",
                "engine_pid": engine, "proxy_pid": pid}

    def clear(self) -> dict:
        engine, pid = self._find()
        return {"host": self.host, "action": "none (the engine's watchdog respawns the proxy)",
                "proxy_pid": pid, "respawned": pid is not None and pid != self.killed}


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
            return {"host": self.host, "qdisc": "netem",
                    "action": f"tc qdisc replace dev {self.iface} root netem {' '.join(self.words)}"}
        if "unknown" not in (r.stderr or "").lower():
            self.hosts.run(self.host, [*base, "netem", *self.words])  # the same failure, as one line
        self.hosts.run(self.host, [*base, "tbf", *FALLBACK_TBF.split()])
        return {"host": self.host, "qdisc": "tbf",
                "action": f"tc qdisc replace dev {self.iface} root tbf {FALLBACK_TBF} (the kernel has no sch_netem)"}

    def clear(self) -> dict:
        r = self.hosts.run(self.host, ["tc", "qdisc", "show", "dev", self.iface, "root"])
        kinds = r.stdout.split()[1:2]
        if kinds not in (["netem"], ["tbf"]):
            return {"host": self.host, "action": "none", "iface": self.iface}
        self.hosts.run(self.host, ["tc", "qdisc", "del", "dev", self.iface, "root"])
        return {"host": self.host, "action": f"tc qdisc del dev {self.iface} root ({kinds[0]})"}


FAULT_CLASSES: dict[str, type[Fault]] = {c.name: c for c in (EngramServerStop, DrafterWorkerStop, AsyncProxyKill,
                                                              LinkDown, Netem)}


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


# ---- sampling and load --------------------------------------------------------------------------

@dataclasses.dataclass
class Sample:
    """One read of the counters at ``t`` seconds after the drill's start (monotonic clock).

    ``engram``: ``{rank: {"lookups", "fallbacks", "remote_rows"}}`` (cumulative); ``drafter``:
    rank 0's speculator counters (``rounds``, ``fail_closed_rounds``, ``proxy_respawns``, ...);
    ``gen_tokens``: ``vllm:generation_tokens_total``; ``server_requests`` / ``worker_rounds``:
    the table server's and drafter worker's own counters (None when unreachable); ``error``: why
    rank 0's ``/metrics`` could not be read (then the counters are empty)."""

    t: float
    engram: dict = dataclasses.field(default_factory=dict)
    drafter: dict = dataclasses.field(default_factory=dict)
    gen_tokens: float | None = None
    server_requests: float | None = None
    worker_rounds: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def read_sample(t: float, api_metrics: str, server_metrics: str | None, worker_metrics: str | None,
                timeout_s: float = 2.0) -> Sample:
    """Read every counter the drill tracks (see :class:`Sample`); never raises for an unreachable
    endpoint (rank 0's goes into ``error``, the others become None)."""
    from dsv41.harness import http, refs

    s = Sample(t)
    try:
        text = http.request("GET", api_metrics, what=f"cannot read metrics at {api_metrics}", timeout_s=timeout_s).text
        s.engram = {r: {k: v for k, v in c.items() if k in ("lookups", "fallbacks", "remote_rows")}
                    for r, c in refs.engram_counters(text).items()}
        s.drafter = refs.flat_values(text, "dsv41_drafter_")
        s.gen_tokens = sum(v for n, _l, v in http.metric_samples(text) if n == "vllm:generation_tokens_total")
    except Dsv41Error as exc:
        s.error = str(exc)
    for url, name, attr in ((server_metrics, "dsv41_engram_requests_total", "server_requests"),
                            (worker_metrics, "dsv41_drafter_rounds_total", "worker_rounds")):
        if not url:
            continue
        try:
            vals = [v for n, _l, v in http.get_metrics(url, timeout_s=timeout_s) if n == name]
            setattr(s, attr, sum(vals) if vals else None)
        except Dsv41Error:
            pass
    return s


class Sampler:
    """Calls ``read()`` (-> :class:`Sample`) every ``interval_s`` seconds on a thread."""

    def __init__(self, read: Callable[[], Sample], interval_s: float = 1.0) -> None:
        self.read, self.interval_s = read, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="drill-sampler", daemon=True)

    def _loop(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            self.samples.append(self.read())
            nxt += self.interval_s
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        return self.samples


class Load:
    """The bench client's requests (``bench.request_body`` / ``bench.stream_one``) on ``streams``
    threads, cycling through the spec's prompts with a fresh seed and cache salt per request,
    until :meth:`stop`. Each result: ``bench.RequestResult.to_dict()`` plus ``t_start`` /
    ``t_end`` (seconds on ``clock``, the drill's timeline)."""

    def __init__(self, endpoint: str, model: str, spec: dict, streams: int, clock: Callable[[], float]) -> None:
        from dsv41.harness import bench

        self.endpoint, self.model, self.spec, self.streams, self.clock = endpoint, model, spec, streams, clock
        self.items = bench.plan_requests(dict(spec, repeats=1), "x")
        self.salt = uuid.uuid4().hex[:12]
        self.results: list[dict] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, name=f"drill-load-{i}", daemon=True)
                         for i in range(streams)]

    def _worker(self) -> None:
        from dsv41.harness import bench

        # The bench's own client settings (timeouts, no proxy variables).
        with bench._client(self.spec["timeout_s"]) as c:
            while not self._stop.is_set():
                with self._lock:
                    k = self._next
                    self._next += 1
                it = self.items[k % len(self.items)]
                salt = f"drill-{self.salt}-{k}" if self.spec["cache_salt"] else None
                body = bench.request_body(self.model, it["prompt"], self.spec["seed"] + k, it["max_tokens"],
                                          self.spec["sampler"], salt)
                t0 = self.clock()
                r = bench.stream_one(c, self.endpoint, body, it["prompt_id"], it["category"])
                self.results.append({**r.to_dict(keep_steps=False), "t_start": t0, "t_end": self.clock()})

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[dict]:
        """Stop submitting, wait for the requests in flight, return every result."""
        self._stop.set()
        for t in self._threads:
            t.join()
        return sorted(self.results, key=lambda r: r["t_start"])


# ---- computations on the samples (pure) ----------------------------------------------------------

def _engram_total(s: Sample, key: str) -> float:
    return sum(c.get(key, 0.0) for c in s.engram.values())


def timeline(samples: Sequence[Sample]) -> list[dict]:
    """Per interval between consecutive readable samples: ``{"t": midpoint s, "tok_s",
    "fallbacks_s" (all ranks), "fail_closed_s", "lookups_s"}`` (rates per second)."""
    ok = [s for s in samples if s.ok]
    out = []
    for a, b in zip(ok, ok[1:]):
        dt = b.t - a.t
        if dt <= 0:
            continue
        tok = (b.gen_tokens - a.gen_tokens) / dt if a.gen_tokens is not None and b.gen_tokens is not None else None
        out.append({"t": (a.t + b.t) / 2, "tok_s": tok,
                    "fallbacks_s": (_engram_total(b, "fallbacks") - _engram_total(a, "fallbacks")) / dt,
                    "lookups_s": (_engram_total(b, "lookups") - _engram_total(a, "lookups")) / dt,
                    "fail_closed_s": (b.drafter.get("fail_closed_rounds", 0.0) - a.drafter.get("fail_closed_rounds", 0.0)) / dt})
    return out


def healthy_interval(a: Sample, b: Sample, ranks: Sequence[str], drafter: bool) -> bool:
    """True when, between ``a`` and ``b``, every rank in ``ranks`` counted Engram lookups and no
    fallback and (``drafter``) rank 0 ran drafting rounds and no fail-closed round."""
    if not (a.ok and b.ok):
        return False
    for r in ranks:
        ca, cb = a.engram.get(r), b.engram.get(r)
        if ca is None or cb is None:
            return False
        if cb.get("lookups", 0.0) - ca.get("lookups", 0.0) <= 0 or cb.get("fallbacks", 0.0) - ca.get("fallbacks", 0.0) != 0:
            return False
    if drafter:
        if b.drafter.get("rounds", 0.0) - a.drafter.get("rounds", 0.0) <= 0:
            return False
        if b.drafter.get("fail_closed_rounds", 0.0) - a.drafter.get("fail_closed_rounds", 0.0) != 0:
            return False
    return True


def recovery_time(samples: Sequence[Sample], t_clear: float, ranks: Sequence[str], drafter: bool = True,
                  stable_s: float = 3.0) -> float | None:
    """Seconds from clearing the fault (``t_clear``, on the samples' clock) until the system is
    back: the start of the first run of consecutive :func:`healthy_interval` s lasting at least
    ``stable_s`` seconds, among intervals starting at or after ``t_clear``. ``0.0`` when healthy
    from the first sample after clearing (resolution: the sampling interval); None when it never
    recovered within the samples."""
    after = [s for s in samples if s.t >= t_clear]
    run_start: Sample | None = None
    for a, b in zip(after, after[1:]):
        if healthy_interval(a, b, ranks, drafter):
            if run_start is None:
                run_start = a
            if b.t - run_start.t >= stable_s:
                return max(0.0, run_start.t - t_clear)
        else:
            run_start = None
    return None


def throughput_recovery_time(samples: Sequence[Sample], t_inject: float, t_clear: float, frac: float = 0.5,
                             window_s: float = 3.0) -> float | None:
    """Seconds from ``t_clear`` until generation is back to at least ``frac`` of its pre-fault mean:
    the first interval (of :func:`timeline`, midpoint at or after ``t_clear``) from which the mean
    tok/s of the intervals within ``window_s`` seconds reaches ``frac`` x the mean before
    ``t_inject``. None without a baseline, or when it never gets there within the samples (or
    too few samples remain for a full window)."""
    rates = [r for r in timeline(samples) if r["tok_s"] is not None]
    before = [r["tok_s"] for r in rates if r["t"] < t_inject]
    if not before:
        return None
    want = frac * sum(before) / len(before)
    after = [r for r in rates if r["t"] >= t_clear]
    for i, r in enumerate(after):
        win = [x["tok_s"] for x in after[i:] if x["t"] <= r["t"] + window_s]
        if after[-1]["t"] < r["t"] + window_s - 1e-9:
            return None
        if sum(win) / len(win) >= want:
            return max(0.0, r["t"] - t_clear)
    return None


def counter_deltas(samples: Sequence[Sample], t0: float | None = None, t1: float | None = None) -> dict:
    """Counter deltas between the first and the last readable sample within ``[t0, t1]``:
    ``{"engram": {rank: {"lookups", "fallbacks", "remote_rows"}}, "drafter": {...}, "gen_tokens",
    "server_requests", "worker_rounds", "seconds"}``; empty dicts / None with fewer than two."""
    sel = [s for s in samples if s.ok and (t0 is None or s.t >= t0) and (t1 is None or s.t <= t1)]
    if len(sel) < 2:
        return {"engram": {}, "drafter": {}, "gen_tokens": None, "server_requests": None, "worker_rounds": None,
                "seconds": 0.0}
    a, b = sel[0], sel[-1]

    def d(x, y):
        return None if x is None or y is None else y - x

    return {"engram": {r: {k: v - a.engram.get(r, {}).get(k, 0.0) for k, v in c.items()} for r, c in b.engram.items()},
            "drafter": {k: v - a.drafter.get(k, 0.0) for k, v in b.drafter.items()
                        if k in ("rounds", "fail_closed_rounds", "proxy_respawns", "proxy_spawns", "watchdog_fires",
                                 "timeouts", "unavailable", "reconnects", "proxy_down", "proxy_gave_up")},
            "gen_tokens": d(a.gen_tokens, b.gen_tokens),
            "server_requests": d(a.server_requests, b.server_requests),
            "worker_rounds": d(a.worker_rounds, b.worker_rounds),
            "seconds": b.t - a.t}


def fault_result(name: str, samples: Sequence[Sample], requests: Sequence[dict], t_inject: float, t_clear: float,
                 ranks: Sequence[str], stable_s: float, inject: dict, clear: dict, refs: dict | None) -> dict:
    """Everything the report says about one fault (see docs/drills.md, "Report"): requests and
    failures, fallbacks / fail-closed rounds counted over the whole run of this fault, recovery
    seconds after clearing, the greedy references, and the samples and requests themselves."""
    deltas = counter_deltas(samples)
    failed = [r for r in requests if not r.get("ok")]
    recovery = recovery_time(samples, t_clear, ranks, True, stable_s)
    fallbacks = {r: int(c.get("fallbacks", 0)) for r, c in deltas["engram"].items()}
    rates = timeline(samples)

    def mean_tok(lo, hi):
        vals = [x["tok_s"] for x in rates if lo <= x["t"] <= hi and x["tok_s"] is not None]
        return sum(vals) / len(vals) if vals else None

    refs_ok = bool(refs and refs.get("ok"))
    return {"fault": name, "description": FAULTS[name], "inject": inject, "clear": clear,
            "t_inject": t_inject, "t_clear": t_clear,
            "requests": len(requests), "failed": len(failed),
            "failures": [{"prompt_id": r.get("prompt_id"), "error": r.get("error")} for r in failed[:10]],
            "requests_across_fault": sum(1 for r in requests if r["t_start"] < t_clear and r["t_end"] > t_inject),
            "fallbacks": fallbacks, "fallbacks_total": sum(fallbacks.values()),
            "fail_closed_rounds": int(deltas["drafter"].get("fail_closed_rounds", 0)),
            "proxy_respawns": int(deltas["drafter"].get("proxy_respawns", 0)),
            "recovered": recovery is not None, "recovery_s": recovery,
            "tok_s_recovery_s": throughput_recovery_time(samples, t_inject, t_clear),
            "tok_s_before": mean_tok(float("-inf"), t_inject), "tok_s_during": mean_tok(t_inject, t_clear),
            "refs": refs, "refs_ok": refs_ok,
            "ok": not failed and recovery is not None and refs_ok and len(requests) > 0,
            "deltas": deltas,
            "samples": [dataclasses.asdict(s) for s in samples],
            "request_log": list(requests)}


def build_report(drill_id: str, faults: Sequence[dict], params: dict, started_at: str, finished_at: str,
                 machine: str) -> dict:
    """The ``report.json`` document: ``format``, ``id``, times, machine, parameters, one
    :func:`fault_result` per fault, and ``ok`` (every fault: zero failed requests, recovered,
    references identical)."""
    return {"format": FORMAT, "id": drill_id, "started_at": started_at, "finished_at": finished_at,
            "machine": machine, "params": dict(params), "faults": list(faults),
            "ok": bool(faults) and all(f["ok"] for f in faults)}


def _fmt(v, spec=".1f", none="-"):
    return none if v is None else format(v, spec)


def summary_markdown(report: dict) -> str:
    """``summary.md``: one table row per fault (requests, failed, fallbacks per rank, fail-closed
    rounds, proxy respawns, recovery s, tok/s before and during, references) and the verdict."""
    p = report["params"]
    lines = [f"# Fault drill {report['id']}", "",
             f"{report['started_at']} -> {report['finished_at']} on {report['machine']}; load: {p.get('streams')} "
             f"concurrent streams of spec `{p.get('spec')}` (short, code and long prompts, "
             f"{p.get('max_tokens')} tokens each); per fault {p.get('baseline_s')} s baseline, "
             f"{p.get('duration_s')} s fault, recovery awaited up to {p.get('recover_timeout_s')} s "
             f"(healthy = {p.get('stable_s')} s of remote lookups on every rank with no fallback and "
             f"remote drafting rounds with no fail-closed round; the tok/s column: seconds after clearing "
             f"until 3 s of generation average at least half the pre-fault tok/s).", "",
             "| fault | requests | failed | fallbacks (per rank) | fail-closed rounds | proxy respawns "
             "| recovery s | tok/s before / during | tok/s at half of before after s | refs | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in report["faults"]:
        fb = ", ".join(f"r{r} {n}" for r, n in sorted(f["fallbacks"].items())) or "-"
        refs = (f["refs"] or {}).get("summary") or ("error: " + str((f["refs"] or {}).get("error")))
        rec = _fmt(f["recovery_s"]) if f["recovered"] else "not recovered"
        lines.append(f"| {f['fault']} | {f['requests']} | {f['failed']} | {fb} | {f['fail_closed_rounds']} | "
                     f"{f['proxy_respawns']} | {rec} | {_fmt(f['tok_s_before'])} / {_fmt(f['tok_s_during'])} | "
                     f"{_fmt(f.get('tok_s_recovery_s'))} | "
                     f"{refs} | {'yes' if f['ok'] else 'NO'} |")
    lines += ["", "What was done: " + "; ".join(f"{f['fault']}: {f['inject'].get('action')} on {f['inject'].get('host')}, "
                                              f"cleared by {f['clear'].get('action')}" for f in report["faults"]) + ".",
              "", f"Verdict: {'PASS' if report['ok'] else 'FAIL'}. Timeline: timeline.png.", ""]
    for f in report["faults"]:
        for x in f["failures"]:
            lines.append(f"- {f['fault']}: failed request {x['prompt_id']}: {x['error']}")
    return "\n".join(lines).rstrip() + "\n"


def plot_timeline(report: dict, path: str | Path) -> None:
    """``timeline.png``: per fault one panel of tok/s (left axis) and Engram fallbacks + fail-closed
    rounds per second (right axis) against seconds since the drill started, the fault window
    (inject -> clear) shaded and the recovery point marked. Matplotlib, Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = report["faults"]
    if not faults:
        fig = plt.figure(figsize=(6, 1.5))
        fig.text(0.5, 0.5, f"drill {report['id']}: no fault ran ({report.get('error') or 'nothing requested'})",
                 ha="center", va="center", fontsize=8)
        fileio.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=90), "drill timeline")
        plt.close(fig)
        return
    fig, axes = plt.subplots(len(faults), 1, figsize=(10, 2.6 * max(1, len(faults))), squeeze=False)
    for ax, f in zip(axes[:, 0], faults):
        rates = timeline([Sample(**s) for s in f["samples"]])
        t = [x["t"] for x in rates]
        ax.plot(t, [x["tok_s"] if x["tok_s"] is not None else math.nan for x in rates], color="tab:blue", label="tok/s")
        ax.set_ylabel("tok/s")
        ax2 = ax.twinx()
        ax2.plot(t, [x["fallbacks_s"] for x in rates], color="tab:red", label="Engram fallbacks/s")
        ax2.plot(t, [x["fail_closed_s"] for x in rates], color="tab:orange", linestyle="--", label="fail-closed rounds/s")
        ax2.set_ylabel("per s")
        ax.axvspan(f["t_inject"], f["t_clear"], color="grey", alpha=0.25, label="fault")
        if f["recovery_s"] is not None:
            ax.axvline(f["t_clear"] + f["recovery_s"], color="tab:green", linestyle=":", label="recovered")
        ax.set_title(f"{f['fault']}: {f['requests']} requests, {f['failed']} failed, {f['fallbacks_total']} fallbacks, "
                     f"{f['fail_closed_rounds']} fail-closed, recovery {_fmt(f['recovery_s'])} s", fontsize=9)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the drill started")
    fig.tight_layout()
    fileio.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=90), "drill timeline")
    plt.close(fig)


def write_report(report: dict, out_dir: str | Path) -> dict[str, str]:
    """Write ``report.json``, ``summary.md`` and ``timeline.png`` into ``out_dir`` (created);
    returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report": out / "report.json", "summary": out / "summary.md", "timeline": out / "timeline.png"}
    from dsv41 import fileio

    fileio.atomic_write_json(paths["report"], report, "drill report")
    fileio.atomic_write(paths["summary"], summary_markdown(report), "drill summary")
    plot_timeline(report, paths["timeline"])
    return {k: str(v) for k, v in paths.items()}


# ---- the drill ----------------------------------------------------------------------------------

@dataclasses.dataclass
class DrillParams:
    """What ``dsv41 drill run`` does: faults in order, seconds per phase, load, endpoints."""

    faults: list[str]
    endpoint: str
    refs_path: str
    server_metrics: str | None
    worker_metrics: str | None
    spec: dict
    streams: int = 4
    baseline_s: float = 8.0
    duration_s: float = 20.0
    recover_timeout_s: float = 60.0
    stable_s: float = 3.0
    interval_s: float = 1.0
    ranks: tuple[str, ...] = ("0", "1")


def new_id(now: _dt.datetime | None = None) -> str:
    """A drill id: UTC time ``YYYYmmddTHHMMSSZ``."""
    return (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")


def run_drill(params: DrillParams, hosts: LabHosts, topo: Topology, log: Callable[[str], None] = print,
              results: list[dict] | None = None) -> list[dict]:
    """Run every fault of ``params`` in turn (module docstring), appending each one's
    :func:`fault_result` to ``results`` (kept when a later fault raises) and returning it. A
    fault whose injection fails or is interrupted is cleared before the exception propagates
    (callers clear every fault once more: ``clear_all``); DrillError if a fault cannot be
    injected or the smoke start fails."""
    from dsv41.harness import bench, refs

    model = params.spec["model"] or bench.served_model(params.endpoint)
    refs_doc = refs.load_refs(params.refs_path)
    bench.smoke(params.endpoint, model, refs_doc, params.spec["timeout_s"])
    api_metrics = params.endpoint.rstrip("/") + "/metrics"
    t_origin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t_origin

    results = [] if results is None else results
    for name in params.faults:
        fault = FAULT_CLASSES[name](hosts, topo)
        sampler = Sampler(lambda: read_sample(clock(), api_metrics, params.server_metrics, params.worker_metrics),
                          params.interval_s).start()
        load = Load(params.endpoint, model, params.spec, params.streams, clock).start()
        inject: dict = {}
        t_inject = 0.0
        try:
            time.sleep(params.baseline_s)
            log(f"drill: {name}: injecting ({FAULTS[name]})")
            t_inject = clock()
            inject = fault.inject()
            time.sleep(params.duration_s)
        except BaseException:
            # A failed or interrupted injection may have half-happened: clear it, stop the load.
            try:
                fault.clear()
            finally:
                load.stop()
                sampler.stop()
            raise
        t_clear = clock()
        try:
            clear = fault.clear()
        except BaseException:
            load.stop()
            sampler.stop()
            raise
        log(f"drill: {name}: cleared ({clear.get('action')}); waiting for recovery")
        deadline = t_clear + params.recover_timeout_s
        while clock() < deadline:
            time.sleep(params.interval_s)
            if recovery_time(list(sampler.samples), t_clear, params.ranks, True, params.stable_s) is not None:
                break
        time.sleep(params.interval_s)
        requests = load.stop()
        samples = sampler.stop()
        if name == "async_proxy":
            clear = {**clear, **{k: v for k, v in fault.clear().items() if k in ("proxy_pid", "respawned")}}
        log(f"drill: {name}: {len(requests)} requests, verifying the greedy references")
        try:
            chk = refs.check(params.endpoint, params.refs_path, mode="verify", metrics_url=api_metrics,
                             require_ranks=list(params.ranks), require_drafter=True, attempts=5, delay_s=2.0)
            refs_rec = {"ok": chk.ok, "summary": chk.comparison.summary(), "identical": chk.comparison.identical,
                        "total": chk.comparison.total, "attempts": chk.attempts, "problem": chk.message()}
        except Dsv41Error as exc:
            refs_rec = {"ok": False, "error": str(exc)}
        res = fault_result(name, samples, requests, t_inject, t_clear, params.ranks, params.stable_s,
                           inject, clear, refs_rec)
        log(f"drill: {name}: {res['requests']} requests, {res['failed']} failed, {res['fallbacks_total']} fallbacks, "
            f"{res['fail_closed_rounds']} fail-closed rounds, recovery {_fmt(res['recovery_s'])} s, "
            f"refs {refs_rec.get('summary') or refs_rec.get('error')}")
        results.append(res)
    return results


def supervisorctl_argv(text: str) -> list[str]:
    """``--supervisorctl`` text (e.g. the inventory's ``dsv41_supervisorctl``) -> argv."""
    argv = shlex.split(text)
    if not argv:
        raise DrillError("drill: --supervisorctl is empty")
    return argv
