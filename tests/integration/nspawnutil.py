"""What the lab tests share (docs/lab.md): the inventory,
bringing the lab up and down, entering a host's systemd namespaces, ad-hoc Ansible over ssh and
reading a play's recap. The lab is one per machine: callers hold /tmp/dsv41-lab.lock."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from labutil import API, BIN, LAB, ROOT, admission_state, env, inside, play

INV = "inventories/sim"
SPARKS = ("sparkhead", "sparkworker")
MGMT = {"sparkhead": "198.18.0.11", "sparkworker": "198.18.0.12", "x86host": "198.18.0.13"}
#: The systemd units deploy.yml runs on each host of the lab.
UNITS = {
    "x86host": ("dsv41-engram-server", "dsv41-drafter"),
    "sparkhead": ("dsv41-serve",),
    "sparkworker": ("dsv41-serve",),
}

#: The skip rule of every nspawn test: the machine kind's hybrid cgroup layout (docs/lab.md).
needs_hybrid_cgroups = pytest.mark.skipif(
    not Path("/sys/fs/cgroup/unified/cgroup.procs").exists()
    or not Path("/sys/fs/cgroup/systemd/cgroup.procs").exists(),
    reason="the nspawn lab needs the hybrid cgroup layout of the CI machine kind",
)


def changed(out: str) -> int:
    """The sum of ``changed=N`` over the last PLAY RECAP of an ansible-playbook run."""
    return sum(int(m) for m in re.findall(r"changed=(\d+)", out.split("PLAY RECAP")[-1]))


def recap(out: str) -> dict[str, dict[str, int]]:
    """``{host: {"ok": N, "changed": N, "failed": N, ...}}`` from the last PLAY RECAP."""
    res = {}
    for m in re.finditer(r"^(\S+)\s*:\s*(ok=.*)$", out.split("PLAY RECAP")[-1], re.M):
        res[m[1]] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m[2])}
    return res


def ansible(
    pattern: str, module: str, args: str | None = None, *extra: str, timeout: int = 300
) -> subprocess.CompletedProcess:
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


def deploy(*args: str, timeout: int = 1500) -> tuple[subprocess.CompletedProcess, float]:
    """``deploy.yml -i inventories/sim ARGS`` (not asserted); returns the run and its seconds."""
    t0 = time.monotonic()
    res = play("deploy.yml", "-i", INV, *args, timeout=timeout)
    return res, time.monotonic() - t0


def status_json(window: float = 2) -> tuple[int, dict]:
    """``dsv41 status --json`` on the lab: its exit code and report (``{"reasons": [stdout, stderr]}``
    when the output is not JSON)."""
    r = subprocess.run(
        [str(BIN / "dsv41"), "status", "-i", INV, "--json", "--window", str(window)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        return r.returncode, json.loads(r.stdout)
    except json.JSONDecodeError:
        return r.returncode, {"reasons": [r.stdout[-2000:], r.stderr[-2000:]]}


def engram_counts() -> dict[str, dict[str, int]]:
    """``{rank: {"lookups": N, "fallbacks": N}}`` from rank 0's /metrics (both ranks' counters)."""
    text = httpx.get(f"{API}/metrics", timeout=30, trust_env=False).text
    out: dict[str, dict[str, int]] = {}
    for key in ("lookups", "fallbacks"):
        for m in re.finditer(rf'^dsv41_engram_{key}_total\{{rank="(\d+)"\}} (\S+)$', text, re.M):
            out.setdefault(m[1], {})[key] = int(float(m[2]))
    return out


def complete(i: int, client: httpx.Client) -> None:
    """One 4-token completion on rank 0's API (asserted 200)."""
    r = client.post(
        f"{API}/v1/completions", json={"model": "dsv41-lab", "prompt": f"systemd probe {i} ", "max_tokens": 4}
    )
    assert r.status_code == 200, r.text


def all_units() -> dict[str, dict[str, str]]:
    """``{"host/unit": unit(host, unit)}`` for every unit of ``UNITS``."""
    return {f"{h}/{u}": unit(h, u) for h, names in UNITS.items() for u in names}


def admission_within(timeout_s: float) -> tuple[str, float]:
    """Rank 0's admission state (``open``/``held``) once its API answers, and the seconds waited;
    the last error's text when it did not answer within ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        try:
            return admission_state(), time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001 - the API is down while the unit restarts
            if time.monotonic() - t0 > timeout_s:
                return str(exc), time.monotonic() - t0
        time.sleep(3)


def wait_healthy(timeout_s: float) -> tuple[float, dict]:
    """Poll ``dsv41 status`` every 3 s until it exits 0 or ``timeout_s`` passed; returns the seconds
    and the last report (``report["healthy"]`` says which)."""
    t0 = time.monotonic()
    while True:
        rc, rep = status_json(window=2)
        if rc == 0 or time.monotonic() - t0 > timeout_s:
            return time.monotonic() - t0, rep
        time.sleep(3)


def serve_container(host: str) -> dict:
    """The rank's container: image ID, start time, state (docker inspect)."""
    out = enter(host, "/usr/bin/docker", "inspect", "dsv41-serve").stdout
    c = json.loads(out)[0]
    return {"image": c["Image"], "started": c["State"]["StartedAt"], "running": c["State"]["Running"]}


def serve_unit_state(host: str) -> dict:
    """The rank's dsv41-serve unit: MainPID, ActiveEnterTimestamp, ActiveState and the unit file's sha256."""
    out = enter(host, "systemctl", "show", "dsv41-serve", "-p", "MainPID,ActiveEnterTimestamp,ActiveState").stdout
    state = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    state["unit_sha"] = enter(host, "sha256sum", "/etc/systemd/system/dsv41-serve.service").stdout.split()[0]
    return state


def failed_lines(out: str) -> list[str]:
    """Ansible's one-line task failures."""
    return [ln for ln in out.splitlines() if ln.startswith("[ERROR]: Task failed")]


def health() -> int:
    """The HTTP status of rank 0's ``/health``."""
    return httpx.get(f"{API}/health", timeout=5, trust_env=False).status_code
