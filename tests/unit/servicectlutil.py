"""Fake service managers and a fake lab for the unit tests that drive dsv41 services (the drill
faults, ``dsv41 status --local``, the roles' control body): the stand-in ``fake_systemd.py``
(systemctl, journalctl) runs as a real process with its state in a JSON file, so the argv that
:mod:`dsv41.service_control` builds are executed, not compared.

* :func:`fake_bin`: a directory with ``systemctl`` and ``journalctl`` running fake_systemd.py;
* :class:`FakeManager`: one manager of :data:`dsv41.service_control.MANAGERS` with services in
  manager-neutral states (``up``, ``down``, ``failed``), its :class:`ServiceControl`, the states
  and mutating calls it saw;
* :class:`FakeLab`: the ``runner`` of :class:`dsv41.harness.drill_faults.LabHosts`: strips the
  ``nsenter`` entry (recorded), runs service-manager argv through the FakeManager, ``kill`` and
  the children probe for real (only on processes the test started), and keeps a fake offload link
  (``ip link``, ``tc qdisc``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dsv41 import service_control
from dsv41.harness import drill_faults

HERE = Path(__file__).resolve().parent
FAKE_SYSTEMD = HERE / "fake_systemd.py"
HOSTS = ("x86host", "sparkhead", "sparkworker")
#: Manager-neutral states -> each manager's word for it.
STATES = {"systemd": {"up": "active", "down": "inactive", "failed": "failed"}}
MUTATING = ("start", "stop", "restart", "kill", "reset-failed", "daemon-reload")


def fake_bin(d: Path) -> Path:
    """``d/bin`` with ``systemctl`` and ``journalctl`` that run fake_systemd.py (state in
    ``$FAKE_SYSTEMD_STATE``)."""
    b = d / "bin"
    b.mkdir(parents=True, exist_ok=True)
    for tool in ("systemctl", "journalctl"):
        p = b / tool
        p.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_SYSTEMD} {tool} "$@"\n')
        p.chmod(0o755)
    return b


class FakeManager:
    """A fake ``manager`` under ``d`` knowing ``services`` ({name: "up"|"down"|"failed"}) with main
    pids ``pids`` ({name: pid}, for the running ones)."""

    def __init__(self, d: Path, manager: str, services: dict[str, str], pids: dict[str, int] | None = None) -> None:
        self.manager, self.dir = manager, d
        d.mkdir(parents=True, exist_ok=True)
        self.state = d / f"{manager}.json"
        words = STATES[manager]
        pids = pids or {}
        doc = {
            "units": {
                n: {"ActiveState": words[s], "NeedDaemonReload": "no", "MainPID": pids.get(n, 4242) if s == "up" else 0}
                for n, s in services.items()
            }
        }
        self.ctl = service_control.for_manager(manager)
        self.state.write_text(json.dumps(doc))
        Path(str(self.state) + ".log").write_text("")
        self.env = dict(os.environ, PATH=f"{fake_bin(d)}:{os.environ['PATH']}", FAKE_SYSTEMD_STATE=str(self.state))

    def run(self, argv, **kw) -> subprocess.CompletedProcess:
        """``argv`` run with the fake tools first on PATH (``kw``: subprocess.run's)."""
        kw = {"capture_output": True, "text": True, "timeout": 60, "check": False, **kw}
        return subprocess.run(list(argv), env=self.env, **kw)

    def states(self) -> dict[str, str]:
        """``{service: manager-neutral state}`` as the fake holds it now (``other:<word>`` for a
        word without a neutral name, e.g. systemd's ``activating``)."""
        doc = json.loads(self.state.read_text())
        raw = {n: u["ActiveState"] for n, u in doc["units"].items()}
        back = {w: k for k, w in STATES[self.manager].items()}
        return {n: back.get(w, f"other:{w}") for n, w in raw.items()}

    def calls(self) -> list[str]:
        """The mutating calls the fake saw, in order, as ``VERB ARGS`` (unit names without
        ``.service``)."""
        out = []
        for line in Path(str(self.state) + ".log").read_text().splitlines():
            words = line.split()[1:]  # "systemctl ..."
            if words and words[0] in MUTATING:
                out.append(" ".join(words))
        return out


class FakeLab:
    """The lab as :class:`~dsv41.harness.drill_faults.LabHosts` sees it, for ``manager``:
    ``<d>/<host>.pid`` name this test process (a live pid), ``self.hosts`` runs through
    :meth:`__call__`. ``entries``: every nsenter entry (the flags before ``--``)."""

    def __init__(self, d: Path, mgr: FakeManager, iface: str = "ofl0") -> None:
        for h in HOSTS:
            (d / f"{h}.pid").write_text(f"{os.getpid()}\n")
        self.mgr, self.iface = mgr, iface
        self.link_up, self.qdisc = True, "noqueue"
        self.entries: list[tuple[str, ...]] = []
        self.argvs: list[tuple[str, ...]] = []
        self.hosts = drill_faults.LabHosts(d, mgr.ctl, self)

    def _reply(self, cmd, rc: int = 0, out: str = "", err: str = "") -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, rc, out, err)

    def __call__(self, cmd, **kw) -> subprocess.CompletedProcess:
        cut = cmd.index("--")
        assert cmd[0] == "nsenter" and cmd[1] == "--target", cmd
        self.entries.append(tuple(cmd[3:cut]))
        argv = list(cmd[cut + 1 :])
        self.argvs.append(tuple(argv))
        prefix = list(self.mgr.ctl.prefix)
        if argv[: len(prefix)] == prefix:
            return self.mgr.run(argv, timeout=kw.get("timeout", 60))
        if argv[0] == "python3":  # the children probe: read our own /proc
            return subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=60, check=False)
        if argv[0] == "kill":
            return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        if argv[:3] == ["ip", "-o", "link"]:
            flags = "BROADCAST,MULTICAST,UP,LOWER_UP" if self.link_up else "BROADCAST,MULTICAST"
            return self._reply(
                cmd, out=f"7: {self.iface}@if6: <{flags}> mtu 9000 state {'UP' if self.link_up else 'DOWN'}\n"
            )
        if argv[:3] == ["ip", "link", "set"]:
            self.link_up = argv[-1] == "up"
            return self._reply(cmd)
        if argv[:3] == ["tc", "qdisc", "replace"]:
            self.qdisc = argv[6]
            return self._reply(cmd)
        if argv[:3] == ["tc", "qdisc", "show"]:
            return self._reply(cmd, out=f"qdisc {self.qdisc} 8001: root refcnt 2\n")
        if argv[:3] == ["tc", "qdisc", "del"]:
            self.qdisc = "noqueue"
            return self._reply(cmd)
        return self._reply(cmd, 127, "", f"fake lab: no stand-in for {argv[0]}")


def spawn_engine() -> tuple[subprocess.Popen, int]:
    """A stand-in engine (this test's child, killed by the caller) whose own child has the async
    proxy's argv (``-m dsv41.drafter.proxy_cli run --parent-pid <engine pid>``); returns the
    engine process and the proxy's pid, once the proxy runs."""
    code = (
        "import os,subprocess,sys,time\n"
        "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(120)','-m','dsv41.drafter.proxy_cli',"
        "'run','--parent-pid',str(os.getpid())])\n"
        "print(p.pid,flush=True)\n"
        "p.wait(); time.sleep(120)\n"
    )
    eng = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    proxy = int(eng.stdout.readline())
    return eng, proxy
