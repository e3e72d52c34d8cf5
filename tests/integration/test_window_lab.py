"""window.yml on the deployed three-host lab: a bad input is refused before any HOLD, --check
stops at the plan, and a short window (2 blocks: UNRESOLVED at most by rule) whose engine is
killed mid-cell ends as a decided INVALID window (the failed cell recorded, decision.json
written) and restored (sha256 of every managed file equal to the snapshot, 6/6 greedy
references, zero fallbacks) with admission open. An outside client polls through the whole
window (admitted before, refused under the HOLD, admitted after; with the engine's kept fenced
HOLD, never admitted in between). The full drills are `make window-drills`."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import subprocess
import threading
import time

import pytest

from dsv41 import envs
from labutil import API, BIN, ROOT, admission_state, env, host_sha256, inside, needs_lab, play

pytestmark = [pytest.mark.lab, pytest.mark.slow, needs_lab]
DRILL_SPEC = str(ROOT / "candidates" / "specs" / "drill.json")


def flat(out: str) -> str:
    """Ansible's YAML callback wraps long messages and doubles quotes: one line, plain quotes."""
    return " ".join(out.split()).replace("''", "'")


def status_ok() -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "dsv41"), "status", "--window", "2"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_bad_input_and_check_mode_never_hold(deployed_lab, tmp_path):
    wdir = tmp_path / "windows"
    r = play("window.yml", "-e", "candidate=nope", "-e", f"windows_dir={wdir}")
    assert r.returncode != 0
    assert "window refused, nothing held or changed: dsv41: error: unknown candidate 'nope'" in flat(r.stdout)
    assert "Snapshot |" not in r.stdout and "Set admission to held" not in r.stdout
    bad = tmp_path / "spec.json"
    bad.write_text("{not json")
    r = play("window.yml", "-e", "candidate=aa", "-e", f"window_spec={bad}", "-e", f"windows_dir={wdir}")
    assert r.returncode != 0 and "is not JSON" in flat(r.stdout)
    r = play(
        "window.yml", "-e", "candidate=aa", "-e", f"windows_dir={wdir}", "-e", "dsv41_api_url=http://198.18.0.99:8000"
    )
    assert r.returncode != 0 and "cannot read admission state at http://198.18.0.99:8000" in flat(r.stdout)
    r = play("window.yml", "--check", "-e", "candidate=aa", "-e", f"windows_dir={wdir}")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "what would run" in r.stdout and "Snapshot |" not in r.stdout
    assert admission_state() == "open"
    assert not any(wdir.glob("*/package"))


class OutsidePoller(threading.Thread):
    """An outside client (no window token): one 1-token completion every ``every_s`` seconds;
    ``statuses`` is the HTTP status of each answer (connection errors, e.g. while the engine is
    down, are skipped: nothing was admitted)."""

    def __init__(self, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every_s, self.statuses, self.stop = every_s, [], threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=30.0, trust_env=False) as c:
            while not self.stop.is_set():
                try:
                    r = c.post(API + "/v1/completions", json={"prompt": "outside", "max_tokens": 1})
                    self.statuses.append(r.status_code)
                except httpx.HTTPError:
                    pass
                time.sleep(self.every_s)


def test_mid_cell_fault_ends_restored_and_open(deployed_lab, tmp_path):
    wdir = tmp_path / "windows"
    poller = OutsidePoller()
    poller.start()
    try:
        r = play(
            "window.yml",
            "-e",
            "candidate=aa",
            "-e",
            f"window_spec={DRILL_SPEC}",
            "-e",
            f"windows_dir={wdir}",
            "-e",
            "window_fault=mid_cell",
            timeout=900,
        )
        time.sleep(2)
    finally:
        poller.stop.set()
        poller.join(60)
    out = r.stdout
    # the engine died mid-window: the cell in flight, or the next cell whose /metrics snapshot is
    # refused, is recorded failed; the window is decided INVALID, then production is restored
    assert r.returncode != 0, out[-4000:]
    assert "a window was INVALID (production restored, admission open)" in flat(out), out[-4000:]
    (dec_path,) = wdir.glob("*-aa/decision.json")
    assert json.loads(dec_path.read_text())["decision"]["verdict"] == "INVALID"
    cells = [json.loads(x) for x in (dec_path.parent / "cells.jsonl").read_text().splitlines()]
    assert not cells[-1]["ok"] and cells[-1]["error"], cells[-1]
    # restored through the change steps every operation shares: the sha256 listing, then the reopen
    assert "Change | reopen admission" in out and re.search(r"ok [0-9a-f]{64}  /", out), out[-4000:]
    # the snapshot is a promotion package: an undrifted production keeps its id (production's own)
    (pkg_path,) = wdir.glob("*/package")
    pid = pkg_path.read_text().strip()
    assert pid == inside("sparkhead", "cat", "/opt/dsv41/packages/current").stdout.strip()
    doc = json.loads((ROOT / "packages" / pid / "package.json").read_text())
    for host, h in doc["hosts"].items():
        want = {p: f["sha256"] for p, f in h["files"].items()}
        assert host_sha256(host, sorted(want)) == want, host
        for path, digest in want.items():  # the stored package holds the same bytes
            data = (ROOT / "packages" / pid / "files" / host / path.lstrip("/")).read_bytes()
            assert hashlib.sha256(data).hexdigest() == digest
    journal = [json.loads(x) for x in (ROOT / "packages" / "journal.jsonl").read_text().splitlines()]
    assert [e["step"] for e in journal if e["op"] == pkg_path.parent.name][-1] == "done"
    assert admission_state() == "open"
    runs = [k for k, _ in itertools.groupby(poller.statuses)]
    assert runs[:2] == [200, 503] and runs[-1] == 200, poller.statuses
    if "DSV41_ADMISSION_HOLD_FILE" in envs.ENV_VARS:
        # with the engine's kept fenced HOLD (the promote branch's DSV41_ADMISSION_HOLD_FILE), the
        # rank 0 restarted inside the window (systemd after the kill, then the restore) comes
        # up held: outside traffic is never admitted between two refusals
        assert runs == [200, 503, 200], poller.statuses
    st = status_ok()
    assert st.returncode == 0, st.stdout + st.stderr
