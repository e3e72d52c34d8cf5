"""labutil.play's timeout ends ansible-playbook's whole process group (no lab needed)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

import labutil


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_timeout_ends_the_forked_children(tmp_path, monkeypatch):
    fake = tmp_path / "ansible-playbook"
    pidfile = tmp_path / "child.pid"
    # a stand-in that forks a long-running worker, as ansible-playbook forks per host
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nsleep 300\n")
    fake.chmod(0o755)
    monkeypatch.setattr(labutil, "BIN", tmp_path)
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        labutil.play("none.yml", timeout=1)
    assert time.monotonic() - t0 < 20
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the forked worker outlived play()'s timeout"


def test_a_finished_playbook_returns_its_output(tmp_path, monkeypatch):
    fake = tmp_path / "ansible-playbook"
    fake.write_text('#!/bin/sh\necho ran "$@"\necho warn >&2\nexit 3\n')
    fake.chmod(0o755)
    monkeypatch.setattr(labutil, "BIN", tmp_path)
    r = labutil.play("x.yml", "-e", "a=b")
    assert (r.returncode, r.stdout, r.stderr) == (3, "ran x.yml -e a=b\n", "warn\n")
