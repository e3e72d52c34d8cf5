"""The lab without root: lab_up stops with one clear line before it touches anything. (The lab's
hosts themselves, up idempotently, isolated, rebooted and down with nothing left:
test_lab_nspawn.py.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from labutil import needs_lab, play

pytestmark = [pytest.mark.lab]


def _play(playbook: str, *args: str, env: dict | None = None, user: int | None = None) -> subprocess.CompletedProcess:
    return play(playbook, *args, env_extra=env, user=user)


@needs_lab
def test_not_root_is_one_clear_line():
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="dsv41-nonroot-"))
    try:
        r = _play("playbooks/lab_up.yml", env={"HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "tmp")}, user=65534)
        out = r.stdout + r.stderr
        assert r.returncode != 0
        assert "dsv41 lab: needs root (network namespaces, nspawn machines)" in out, out[-3000:]
    finally:
        shutil.rmtree(home, ignore_errors=True)
