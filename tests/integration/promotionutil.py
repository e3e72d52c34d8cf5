"""Promotion lab helpers shared by tests/integration/test_promotion_lab.py and the kill matrix
(kill_promotion_matrix.py, ``make promotion-kill``): the three hosts' package pointers, the
sha256 listing of every managed file, the `dsv41` CLI, and ansible-playbook runs (timed, or
SIGKILLed at a journal step). Every helper needs the lab up (``deployed_lab``)."""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import time

import yaml

from labutil import (
    API as API,  # re-exported: the promotion tests take the lab's API URL from here
    BIN,
    ROOT,
    env,
    inside,
    play,
    sigkill_group,
)

HOSTS = ("x86host", "sparkworker", "sparkhead")
PACKAGES = ROOT / "packages"
JOURNAL = PACKAGES / "journal.jsonl"
CANDIDATE = ["-e", "candidate=sync-drafter", "-e", "force=true", "-e", "reason=lab-promotion-test"]


def pointer(host: str) -> str:
    """The package id ``host`` runs (/opt/dsv41/packages/current)."""
    return inside(host, "cat", "/opt/dsv41/packages/current").stdout.strip()


def production() -> str:
    """The one package every host points at (asserts they agree)."""
    ids = {h: pointer(h) for h in HOSTS}
    assert len(set(ids.values())) == 1, ids
    return ids["sparkhead"]


def listing() -> dict[str, dict[str, str]]:
    """``{host: {path: sha256}}`` of every managed file, by the same paths and patterns as
    roles/dsv41 (dsv41_managed_paths), read inside each simulated host."""
    spec = yaml.safe_load((ROOT / "roles/dsv41/defaults/main.yml").read_text())["dsv41_managed_paths"]
    out = {}
    for h in HOSTS:
        r = inside(
            h,
            "sh",
            "-c",
            "find " + " ".join(s["path"] for s in spec) + " -type f -exec sha256sum {} + 2>/dev/null",
            check=False,
        )
        files = {}
        for line in r.stdout.splitlines():
            sha, path = line.split(None, 1)
            for s in spec:
                if path.startswith(s["path"] + "/") and any(
                    fnmatch.fnmatch(os.path.basename(path), p) for p in s["patterns"]
                ):
                    files[path] = sha
        out[h] = files
    return out


def package_listing(pid: str) -> dict[str, dict[str, str]]:
    """``{host: {path: sha256}}`` as package ``pid`` records it."""
    doc = json.loads((PACKAGES / pid / "package.json").read_text())
    return {h: {p: f["sha256"] for p, f in doc["hosts"][h]["files"].items()} for h in HOSTS}


def dsv41(*args: str) -> subprocess.CompletedProcess:
    """The project venv's `dsv41 ARGS` in the repository (120 s limit), output captured."""
    return subprocess.run([str(BIN / "dsv41"), *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)


def recap_changed(out: str) -> dict[str, int]:
    """``{host: changed}`` from the PLAY RECAP of an ansible-playbook run."""
    tail = out[out.rindex("PLAY RECAP") :]
    return {
        line.split()[0]: int(line.split("changed=")[1].split()[0]) for line in tail.splitlines() if "changed=" in line
    }


def assert_verified_production() -> str:
    """Every host points at one package, the package verifies, and every managed file equals it.
    Prints the id and the verify line (``-s`` shows them: the numbers docs/records.md records)."""
    pid = production()
    r = dsv41("package", "verify", pid, "--root", str(PACKAGES))
    assert r.returncode == 0, r.stderr
    files = listing()
    assert files == package_listing(pid)
    print(
        f"\n[promotion] production {pid}: {r.stdout.strip()}; sha256 listing equals the record "
        f"({', '.join(f'{h} {len(files[h])} files' for h in HOSTS)})",
        flush=True,
    )
    return pid


def timed_play(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``play(*args, timeout=timeout)``, printing its wall time."""
    t0 = time.monotonic()
    r = play(*args, timeout=timeout)
    print(
        f"\n[promotion] ansible-playbook {' '.join(args)}: rc {r.returncode}, {time.monotonic() - t0:.1f} s", flush=True
    )
    return r


def switch_running() -> dict | None:
    """``{"step": "switch", "pid": N}`` while a window's arm switch (playbooks/window_switch.yml,
    started by ``dsv41 window run``) is running on this machine, else None."""
    import psutil

    for p in psutil.process_iter(["pid", "cmdline"]):
        if any("window_switch.yml" in a for a in (p.info["cmdline"] or [])):
            return {"step": "switch", "pid": p.info["pid"]}
    return None


def run_until_step(playbook_args: list[str], step: str, timeout: float = 600) -> tuple[dict, list]:
    """Start ``ansible-playbook ARGS``, SIGKILL its whole process group as soon as a journal entry
    of a new operation with ``step`` appears (``step="switch"``: as soon as a window's arm switch
    is running, see :func:`switch_running`) and a task runs (:func:`_await_a_task`), and return
    that entry and the identities (``ProcessIdentity``) of the playbook's processes that outlived
    the kill (its Ansible workers, which call ``setsid()``, and what they run; ``labutil.sigkill_group``)."""
    n0 = len(JOURNAL.read_text().splitlines()) if JOURNAL.exists() else 0
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(BIN / "ansible-playbook"), *playbook_args],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            lines = JOURNAL.read_text().splitlines()[n0:] if JOURNAL.exists() else []
            hits = [json.loads(line) for line in lines]
            if step == "switch":
                sw = switch_running()
                hits = [dict(sw, op=hits[0]["op"])] if sw and hits else []
            for e in hits:
                if e["step"] == step:
                    _await_a_task(proc, n0 + len(lines))
                    left = sigkill_group(proc)
                    print(
                        f"\n[promotion] SIGKILL ansible-playbook {' '.join(playbook_args)} at journal step "
                        f"{step} ({e['op']}) after {time.monotonic() - t0:.1f} s; {len(left)} of its processes "
                        f"outlived the kill: {_described(left)}",
                        flush=True,
                    )
                    return e, left
            assert proc.poll() is None, f"{playbook_args} ended (rc {proc.returncode}) before journal step {step}"
            time.sleep(0.2)
        raise AssertionError(f"no journal step {step} within {timeout} s")
    finally:
        if proc.poll() is None:
            sigkill_group(proc)


#: A kill at a journal step waits at most this long (seconds) for an Ansible worker to be running a
#: task. Longer changes what the kill tests: a rollback killed 20 s after its ``held`` had already
#: restarted rank 0 (lab, 2026-12-06), so its re-run's HOLD saw no restart.
TASK_WAIT_S = 5.0


def _await_a_task(proc: subprocess.Popen, journal_lines: int) -> None:
    """Wait (at most ``TASK_WAIT_S``) until ``proc``'s playbook runs a task, i.e. one of its
    descendants leads a session of its own (an Ansible worker after its ``setsid()``), so that the
    SIGKILL that follows finds a worker in flight; return at once when the journal has moved past
    ``journal_lines`` lines (the kill stays at the step it was asked for)."""
    import psutil

    deadline = time.monotonic() + TASK_WAIT_S
    while time.monotonic() < deadline:
        if len(JOURNAL.read_text().splitlines()) > journal_lines:
            return
        try:
            if any(os.getsid(c.pid) == c.pid for c in psutil.Process(proc.pid).children(recursive=True)):
                return
        except (psutil.Error, OSError):
            pass
        time.sleep(0.05)


def _described(idents: list) -> str:
    """``pid (name, session leader or not)`` of each live process in ``idents``, for the log only
    (nothing is ever selected or signalled by name)."""
    import psutil

    out = []
    for i in idents:
        try:
            p = psutil.Process(i.pid)
            out.append(f"{i.pid} ({p.name()}{', own session' if os.getsid(i.pid) == i.pid else ''})")
        except (psutil.Error, OSError):
            out.append(f"{i.pid} (gone)")
    return ", ".join(out) or "none"


#: How long a process of a SIGKILLed playbook may stay after the re-run ends: OpenSSH's
#: ControlPersist (ansible-core's default ssh_args: 60 s idle) keeps a connection master the killed
#: run started, which the re-run reuses, for 60 s after its last use; an orphaned Ansible worker
#: blocked on its dead parent never ends by itself (the defect), so waiting does not hide one.
OUTLIVE_GRACE_S = 75.0


def alive(idents: list) -> list:
    """The identities in ``idents`` whose process still lives (pid, start ticks and boot id match)."""
    return [i for i in idents if i.alive()]


def assert_none_outlived(left: list, rerun: subprocess.CompletedProcess, killed: str, at_start: list) -> None:
    """After the re-run of a SIGKILLed playbook ``killed``: none of the processes that outlived the
    kill (``left``, identities from :func:`run_until_step`) is alive, within ``OUTLIVE_GRACE_S``
    seconds of the re-run's end; the re-run's own report (plugins/callback/dsv41_workers.py, one
    line per killed playbook) is printed with ``at_start``, those alive when the re-run started
    (:func:`alive`). Raises AssertionError naming the survivors."""
    ended = [line.strip() for line in rerun.stdout.splitlines() if line.startswith("dsv41_workers: ")]
    t0 = time.monotonic()
    survivors = alive(left)
    at_end = len(survivors)
    while survivors and time.monotonic() - t0 < OUTLIVE_GRACE_S:
        time.sleep(1)
        survivors = alive(survivors)
    print(
        f"\n[promotion] after the re-run of the killed {killed}: {len(left)} process(es) had outlived the kill, "
        f"{len(at_start)} alive when the re-run started ({_described(at_start)}), {at_end} alive when it ended, "
        f"{len(survivors)} after {time.monotonic() - t0:.0f} s more; the re-run said: "
        f"{' | '.join(ended) or 'nothing ended'}",
        flush=True,
    )
    assert not survivors, (
        f"{len(survivors)} process(es) of the SIGKILLed {killed} outlived its re-run: {_described(survivors)}"
    )
