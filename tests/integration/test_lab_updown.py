"""The lab itself: lab_up builds three hosts with their own hostname, addresses, MTUs and process
table, idempotently, with the blackhole route first; lab_down kills only processes inside the
lab's namespaces; without root the playbooks stop with one clear line.

Takes over the lab on this machine (like the molecule test); skipped unless root + iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from labutil import HOSTS, LAB, inside, needs_lab, play

pytestmark = [pytest.mark.lab]


def _play(playbook: str, *args: str, env: dict | None = None, user: int | None = None) -> subprocess.CompletedProcess:
    return play(playbook, *args, env_extra=env, user=user)


def _changed(out: str) -> int:
    return sum(int(m) for m in re.findall(r"changed=(\d+)", out.split("PLAY RECAP")[-1]))


def _in(host: str, *cmd: str) -> str:
    return inside(host, *cmd).stdout


@needs_lab
def test_lab_up_idempotent_isolated_then_down_kills_only_its_processes():
    up = _play("playbooks/lab_up.yml")
    assert up.returncode == 0, up.stdout[-3000:]
    again = _play("playbooks/lab_up.yml")
    assert again.returncode == 0 and _changed(again.stdout) == 0, again.stdout[-3000:]

    assert subprocess.run(["ip", "route", "show", "type", "blackhole", "198.18.0.0/15"],
                          capture_output=True, text=True).stdout.strip()
    for h in HOSTS:
        assert _in(h, "hostname").strip() == h
        links = _in(h, "ip", "-o", "link")
        assert re.search(r"mgmt0@\S+ <[^>]*UP[^>]*> mtu 1500 ", links)
        ps = _in(h, "ps", "-e", "-o", "pid=,comm=")
        assert re.search(r"^\s*1 supervisord$", ps, re.M), ps  # own pid namespace, supervisord is init
        # own /dev/shm (tmpfs of the host's mount namespace): rings die with the host
        _in(h, "sh", "-c", f"echo {h} > /dev/shm/dsv41-lab-probe")
        assert _in(h, "cat", "/dev/shm/dsv41-lab-probe").strip() == h
    assert not os.path.exists("/dev/shm/dsv41-lab-probe")
    assert "mtu 9000" in _in("sparkhead", "ip", "-o", "link", "show", "fab0")
    assert "198.18.2.1/30" in _in("x86host", "ip", "-o", "-4", "addr", "show", "ofl-worker")
    # direct links only: the Sparks reach x86host over their own link, not each other's
    ping = subprocess.run(["nsenter", "--target", (LAB / "sparkworker.pid").read_text().strip(), "--net", "--",
                           "ping", "-c1", "-W1", "198.18.1.1"], capture_output=True, text=True)
    assert ping.returncode != 0
    # bind mounts: each host has its own /etc/dsv41
    _in("sparkhead", "sh", "-c", "echo head > /etc/dsv41/whoami")
    assert not (LAB / "sparkworker/etc/dsv41/whoami").exists()
    assert (LAB / "sparkhead/etc/dsv41/whoami").read_text() == "head\n"

    outsider = subprocess.Popen(["sleep", "300"])  # same command as nothing in the lab, outside it
    try:
        down = _play("playbooks/lab_down.yml")
        assert down.returncode == 0, down.stdout[-3000:]
        assert outsider.poll() is None, "lab_down killed a process outside the lab"
    finally:
        outsider.kill()
        outsider.wait()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(f"dsv41-{h}" in netns for h in HOSTS)
    assert not subprocess.run(["ip", "route", "show", "type", "blackhole", "198.18.0.0/15"],
                              capture_output=True, text=True).stdout.strip()
    assert not any((LAB / f"{h}.pid").exists() for h in HOSTS)


@needs_lab
def test_not_root_is_one_clear_line():
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="dsv41-nonroot-"))
    try:
        r = _play("playbooks/lab_up.yml", env={"HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "tmp")}, user=65534)
        out = r.stdout + r.stderr
        assert r.returncode != 0
        assert "dsv41 lab: needs root (network namespaces, bind mounts)" in out, out[-3000:]
    finally:
        shutil.rmtree(home, ignore_errors=True)
