"""What the lab tests share (docs/lab.md): the inventory,
bringing the lab up and down, entering a host's systemd namespaces, ad-hoc Ansible over ssh and
reading a play's recap. The lab is one per machine: callers hold /tmp/dsv41-lab.lock."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from labutil import BIN, LAB, ROOT, env, inside, play

INV = "inventories/sim"
SPARKS = ("sparkhead", "sparkworker")
MGMT = {"sparkhead": "198.18.0.11", "sparkworker": "198.18.0.12", "x86host": "198.18.0.13"}

#: The skip rule of every nspawn test: the machine kind's hybrid cgroup layout (docs/lab.md).
needs_hybrid_cgroups = pytest.mark.skipif(
    not Path("/sys/fs/cgroup/unified/cgroup.procs").exists()
    or not Path("/sys/fs/cgroup/systemd/cgroup.procs").exists(),
    reason="the nspawn lab needs the hybrid cgroup layout of the CI machine kind")


def changed(out: str) -> int:
    """The sum of ``changed=N`` over the last PLAY RECAP of an ansible-playbook run."""
    return sum(int(m) for m in re.findall(r"changed=(\d+)", out.split("PLAY RECAP")[-1]))


def recap(out: str) -> dict[str, dict[str, int]]:
    """``{host: {"ok": N, "changed": N, "failed": N, ...}}`` from the last PLAY RECAP."""
    res = {}
    for m in re.finditer(r"^(\S+)\s*:\s*(ok=.*)$", out.split("PLAY RECAP")[-1], re.M):
        res[m[1]] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m[2])}
    return res


def ansible(pattern: str, module: str, args: str | None = None, *extra: str,
            timeout: int = 300) -> subprocess.CompletedProcess:
    """``ansible PATTERN -i inventories/sim -m MODULE [-a ARGS] EXTRA`` (over ssh)."""
    cmd = [str(BIN / "ansible"), pattern, "-i", INV, "-m", module, *(["-a", args] if args else []), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def per_host(out: str) -> dict[str, str]:
    """Ansible's one-line output (``-o``) by host: ``host | CHANGED | rc=0 | (stdout) text``."""
    res = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+) \| (\S+) \| rc=(\d+) \| \(stdout\) (.*)$", line)
        if m:
            res[m[1]] = m[4].replace("\\n", "\n") if m[3] == "0" else f"RC{m[3]}"
    return res


def pid(host: str, kind: str = "") -> int:
    """The host's systemd (``kind=""``, pid 1 of the machine) or its nspawn (``kind=".nspawn"``)."""
    return int((LAB / f"{host}{kind}.pid").read_text().strip())


#: Run a command in every namespace of the host's systemd (labutil.inside, under the name these tests use).
enter = inside


def up(timeout: int = 1800) -> tuple[subprocess.CompletedProcess, float]:
    """lab_up.yml on the nspawn inventory (asserted); returns the run and its seconds."""
    t0 = time.monotonic()
    res = play("playbooks/lab_up.yml", "-i", INV, timeout=timeout)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]
    return res, time.monotonic() - t0


def down(timeout: int = 600) -> None:
    """lab_down.yml (asserted): removes the lab of either backend."""
    res = play("playbooks/lab_down.yml", "-i", INV, timeout=timeout)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]


def poweroff(host: str, timeout_s: float = 30.0) -> None:
    """A host's power button: ``systemctl poweroff`` through its own systemd, then wait until its
    nspawn process is gone (asserted within ``timeout_s``)."""
    nspawn = pid(host, ".nspawn")
    enter(host, "systemctl", "poweroff")
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{nspawn}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{nspawn}").exists(), f"{host} did not power off within {timeout_s} s"


def unit(host: str, name: str) -> dict[str, str]:
    """``systemctl show`` of ``name``.service on ``host``: ActiveState, SubState, MainPID, NRestarts,
    ActiveEnterTimestampMonotonic, UnitFileState."""
    props = "ActiveState,SubState,MainPID,NRestarts,ActiveEnterTimestampMonotonic,UnitFileState,Result"
    out = enter(host, "systemctl", "show", f"--property={props}", "--", f"{name}.service").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
