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
from labutil import API, BIN, ROOT, env, inside, play, sigkill_group

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
        r = inside(h, "sh", "-c", "find " + " ".join(s["path"] for s in spec)
                   + " -type f -exec sha256sum {} + 2>/dev/null", check=False)
        files = {}
        for line in r.stdout.splitlines():
            sha, path = line.split(None, 1)
            for s in spec:
                if path.startswith(s["path"] + "/") and any(fnmatch.fnmatch(os.path.basename(path), p) for p in s["patterns"]):
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
    tail = out[out.rindex("PLAY RECAP"):]
    return {line.split()[0]: int(line.split("changed=")[1].split()[0]) for line in tail.splitlines() if "changed=" in line}


def assert_verified_production() -> str:
    """Every host points at one package, the package verifies, and every managed file equals it.
    Prints the id and the verify line (``-s`` shows them: the numbers docs/records.md records)."""
    pid = production()
    r = dsv41("package", "verify", pid, "--root", str(PACKAGES))
    assert r.returncode == 0, r.stderr
    files = listing()
    assert files == package_listing(pid)
    print(f"\n[promotion] production {pid}: {r.stdout.strip()}; sha256 listing equals the record "
          f"({', '.join(f'{h} {len(files[h])} files' for h in HOSTS)})", flush=True)
    return pid


def timed_play(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``play(*args, timeout=timeout)``, printing its wall time."""
    t0 = time.monotonic()
    r = play(*args, timeout=timeout)
    print(f"\n[promotion] ansible-playbook {' '.join(args)}: rc {r.returncode}, {time.monotonic() - t0:.1f} s", flush=True)
    return r


def switch_running() -> dict | None:
    """``{"step": "switch", "pid": N}`` while a window's arm switch (playbooks/window_switch.yml,
    started by ``dsv41 window run``) is running on this machine, else None."""
    import psutil

    for p in psutil.process_iter(["pid", "cmdline"]):
        if any("window_switch.yml" in a for a in (p.info["cmdline"] or [])):
            return {"step": "switch", "pid": p.info["pid"]}
    return None


def run_until_step(playbook_args: list[str], step: str, timeout: float = 600) -> dict:
    """Start ``ansible-playbook ARGS``, SIGKILL its whole process group as soon as a journal entry
    of a new operation with ``step`` appears (``step="switch"``: as soon as a window's arm switch
    is running, see :func:`switch_running`), and return that entry."""
    n0 = len(JOURNAL.read_text().splitlines()) if JOURNAL.exists() else 0
    t0 = time.monotonic()
    proc = subprocess.Popen([str(BIN / "ansible-playbook"), *playbook_args], cwd=ROOT, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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
                    left = sigkill_group(proc)
                    print(f"\n[promotion] SIGKILL ansible-playbook {' '.join(playbook_args)} at journal step "
                          f"{step} ({e['op']}) after {time.monotonic() - t0:.1f} s; {left} of its processes "
                          "outlived the kill (ansible workers, own sessions; ended after the test)", flush=True)
                    return e
            assert proc.poll() is None, f"{playbook_args} ended (rc {proc.returncode}) before journal step {step}"
            time.sleep(0.2)
        raise AssertionError(f"no journal step {step} within {timeout} s")
    finally:
        if proc.poll() is None:
            sigkill_group(proc)
