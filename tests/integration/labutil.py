"""What the lab tests share: the checkout, the venv's tools, the skip rule, running a playbook and
entering a simulated host. The lab is one per machine: callers take /tmp/dsv41-lab.lock around it
(see the Makefile's lab targets) when several checkouts share the machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LAB = Path("/var/lib/dsv41-lab")
HOSTS = ("sparkhead", "sparkworker", "x86host")
#: The lab's serving API (sparkhead's engine, inventories/sim).
API = "http://198.18.0.11:8000"

needs_lab = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "nsenter", "unshare")),
    reason="needs root, iproute2 and util-linux for the lab's network namespaces",
)


#: The controller's operator credential (roles/dsv41 tasks/credential.yml writes it once, the deploy
#: gives it to rank 0): the lab's engine and vLLM fence refuse /pause and /resume without it.
#: conftest.py makes it before anything starts (a fresh checkout has none) and points
#: DSV41_OPERATOR_CREDENTIAL_FILE at it, so every engine a test starts and every project client
#: a test runs use the same one.
CREDENTIAL = ROOT / "state" / "operator.credential"


def ensure_credential() -> Path:
    """The operator credential at :data:`CREDENTIAL`, written (random, mode 0600, its directory
    0700) when missing; the deploy keeps an existing one."""
    from dsv41 import authz

    if not CREDENTIAL.exists():
        CREDENTIAL.parent.mkdir(mode=0o700, exist_ok=True)
        authz.write_secret(CREDENTIAL, authz.new_secret())
    return CREDENTIAL


def operator_headers() -> dict[str, str]:
    """The header a control request (/pause, /resume) carries: the operator credential."""
    from dsv41 import authz

    return {"X-DSV41-Operator": authz.load_secret(ensure_credential())}


def post(url: str, **kw):
    """``httpx.post`` with the operator credential among its headers (a control request)."""
    import httpx

    kw["headers"] = {**operator_headers(), **(kw.get("headers") or {})}
    return httpx.post(url, **kw)


def env(extra: dict | None = None) -> dict:
    """The environment for the project's tools: the venv first on PATH, no colours."""
    return dict(
        os.environ, ANSIBLE_FORCE_COLOR="0", NO_COLOR="1", PATH=f"{BIN}:{os.environ.get('PATH', '')}", **(extra or {})
    )


def play(
    playbook: str, *args: str, env_extra: dict | None = None, user: int | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """``ansible-playbook PLAYBOOK ARGS`` from the checkout; ``user`` runs it in a new user
    namespace without a uid map (the overflow uid, no capabilities)."""
    cmd = [str(BIN / "ansible-playbook"), playbook, *args]
    if user is not None:
        # A new user namespace without a uid map: `id -u` is the overflow uid (65534) and every
        # capability of the initial namespace is gone, while files owned by the caller stay
        # readable, so the check runs from a checkout in a 0700 directory too.
        cmd = ["unshare", "--user", "--", *cmd]
    # Its own session, so a timeout ends ansible-playbook's whole process group (its forks and the
    # commands they run), not only the main process: a forked worker left behind would go on
    # changing the lab under the next test.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env(env_extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group still holds our pipes
            out, err = "", ""
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


#: Processes of playbooks a test SIGKILLed that outlived the kill (ansible's workers call setsid,
#: so killpg misses them), by identity; ``end_leftovers`` ends them after the test.
LEFTOVERS: list = []


def sigkill_group(proc: subprocess.Popen) -> list:
    """SIGKILL the process group ``proc`` leads, as an operator's ``kill -9`` of the job would,
    and remember (``LEFTOVERS``) every descendant outside that group: ansible-core's
    WorkerProcess calls ``setsid()`` (ansible/executor/process/worker.py), so a worker running a
    task survives and, its parent gone, blocks for ever after the task. Returns the identities
    (``ProcessIdentity``) of the descendants that outlived the kill (they are ours: ``end_leftovers``
    ends any still alive after the test, by pid and start ticks)."""
    import psutil

    from dsv41.harness.procident import ProcessGone, ProcessIdentity

    tree = []
    try:
        for c in psutil.Process(proc.pid).children(recursive=True):
            try:
                tree.append(ProcessIdentity.of(c.pid))
            except ProcessGone:
                pass
    except psutil.NoSuchProcess:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    left = [i for i in tree if i.alive()]
    LEFTOVERS.extend(left)
    return left


def end_leftovers() -> list[int]:
    """SIGKILL the still-alive processes ``sigkill_group`` remembered (each by pid + start ticks,
    never a reused pid); returns their pids."""
    ended = []
    while LEFTOVERS:
        ident = LEFTOVERS.pop()
        if ident.alive():
            try:
                os.kill(ident.pid, signal.SIGKILL)
                ended.append(ident.pid)
            except ProcessLookupError:
                pass
    return ended


def _end_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group ``proc`` leads (the pid we started: ansible-playbook passes
    SIGTERM on to its workers' sessions), then ``sigkill_group`` after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if sig == signal.SIGKILL:
            sigkill_group(proc)
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def inside(host: str, *cmd: str, check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run ``cmd`` inside a lab host: every namespace of its systemd (``nsenter -a``; the machine's
    pid 1, whose pid the lab writes to ``LAB/<host>.pid``), as a process started by that systemd
    would see the host."""
    pid = (LAB / f"{host}.pid").read_text().strip()
    return subprocess.run(
        ["nsenter", "-t", pid, "-a", "--", *cmd], capture_output=True, text=True, check=check, timeout=timeout
    )


def host_path(host: str, path: str) -> Path:
    """``path`` (absolute) in lab host ``host``'s own file system, seen from the controller through
    its systemd's root (``/proc/<pid 1 of the machine>/root``). The nspawn hosts have no host
    directory under ``LAB`` that mirrors their tree (the supervisord lab had ``LAB/<host>/...``)."""
    pid = (LAB / f"{host}.pid").read_text().strip()
    return Path(f"/proc/{pid}/root") / path.lstrip("/")


def extra_inventory(tmp_path: Path, hosts: dict[str, dict]) -> str:
    """A second inventory source naming the same hosts, its variables in host_vars/ (inventory
    host_vars of a later source override inventories/sim's, which inline host vars would not);
    pass it as ``-i inventories/sim -i <it>``."""
    d = tmp_path / "extra"
    (d / "host_vars").mkdir(parents=True)
    (d / "hosts.yml").write_text(json.dumps({"all": {"hosts": {h: None for h in hosts}}}))
    for h, v in hosts.items():
        (d / "host_vars" / f"{h}.yml").write_text(json.dumps(v))
    return str(d)


def admission_state() -> str:
    """The admission state of the lab's engine (``open`` / ``held``; dsv41.harness.admission)."""
    from dsv41.harness import admission

    return admission.status(API)


def refused_without_credential() -> dict[str, int]:
    """``{"POST /pause (anonymous)": status, ...}``: the lab rank 0's admission routes asked with
    no credential and with a wrong one (a JSON body, as the operator's client sends). The caller
    asserts 401 for each and that the admission state did not move."""
    import httpx

    from dsv41.authz import OPERATOR_HEADER

    out = {}
    for path in ("/pause", "/resume"):
        for label, headers in (("anonymous", {}), ("wrong credential", {OPERATOR_HEADER: "x" * 48})):
            r = httpx.post(f"{API}{path}?mode=wait", headers=headers, json={}, timeout=30)
            out[f"POST {path} ({label})"] = r.status_code
    return out


def host_sha256(host: str, paths: list[str]) -> dict[str, str]:
    """``{path: sha256 hex}`` of files on ``host`` (``sha256sum`` inside it; raises when one is missing)."""
    out = inside(host, "sha256sum", *paths).stdout
    return {line.split(None, 1)[1].strip(): line.split(None, 1)[0] for line in out.splitlines()}
