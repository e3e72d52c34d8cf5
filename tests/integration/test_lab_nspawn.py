"""The lab's nspawn machines (roles/lab, tasks/nspawn.yml; docs/lab.md): three production-
shaped hosts (systemd as PID 1 in their own cgroups, sshd on the lab addresses, dockerd) reached
through inventories/sim exactly as real hosts are (ssh, the ops user, become via sudo,
pipelining, the lab's known_hosts); a host reboot (poweroff + start) brings sshd back; lab_down
leaves nothing behind (machines, cgroups, mounts, netns, processes) and ends only lab processes.

Takes over the lab on this machine, before the shared lab exists (tests/integration/conftest.py);
make lab-long (every shared-lab deploy of make test reaches the hosts the same way, and
test_lab_faults reboots a host mid-window):
the first run builds the rootfs (~70 s, cached under /var/lib/dsv41-lab/nspawn-cache). Prints the
time from nothing to three hosts answering Ansible, for docs/lab.md.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from labutil import HOSTS, LAB, ROOT, needs_lab, play
from nspawnutil import INV, MGMT, SPARKS, ansible, changed, down, enter, needs_hybrid_cgroups, per_host, pid

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.lab_long, needs_lab, needs_hybrid_cgroups]


def _up() -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    up = play("playbooks/lab_up.yml", "-i", INV, timeout=1800)
    assert up.returncode == 0, up.stdout[-5000:] + up.stderr[-2000:]
    ping = ansible("all", "ansible.builtin.ping", None, "-b", "-o")
    assert ping.returncode == 0 and ping.stdout.count("SUCCESS") == 3, ping.stdout + ping.stderr
    return up, time.monotonic() - t0


def _lab_processes(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists()]


def _assert_nothing_left() -> None:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "dsv41-" not in netns, netns
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(LAB) not in mounts, [m for m in mounts.splitlines() if str(LAB) in m]
    for hier in ("unified", "systemd"):
        assert not list(Path(f"/sys/fs/cgroup/{hier}").glob("dsv41-*")), hier
    assert not any(Path(f"/run/systemd/nspawn/propagate/{h}").exists() for h in HOSTS)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "dsv41-mgmt" not in links and not re.search(r"\bmg-", links), links
    assert not subprocess.run(
        ["ip", "route", "show", "type", "blackhole", "198.18.0.0/15"], capture_output=True, text=True
    ).stdout.strip()
    assert not any(
        (LAB / f"{h}.pid").exists() or (LAB / f"{h}.nspawn.pid").exists() or (LAB / h).exists() for h in HOSTS
    )
    assert not list(LAB.glob("nspawn-base-*")) and not (LAB / "ssh").exists()
    assert list((LAB / "nspawn-cache").glob("rootfs-*.tar.zst")), "the rootfs cache must survive lab_down"


def test_nspawn_hosts_production_connection_docker_reboot_and_nothing_left():
    # Take the lab over: whatever runs on this machine goes down first.
    down()
    t_start = time.time()

    up, t_first = _up()
    # built now (a changed package list is a new key: an older tarball does not make it warm)
    cold = any(p.stat().st_mtime >= t_start for p in (LAB / "nspawn-cache").glob("rootfs-*.tar.zst"))
    print(
        f"\nnspawn lab: nothing -> three hosts answering Ansible over ssh in {t_first:.1f} s "
        f"({'cold: rootfs built' if cold else 'rootfs from the cache'})"
    )
    again = play("playbooks/lab_up.yml", "-i", INV)
    assert again.returncode == 0 and changed(again.stdout) == 0, again.stdout[-4000:]

    # The production connection: ssh as ops, become root through sudo.
    who = per_host(ansible("all", "ansible.builtin.command", "whoami", "-b", "-o").stdout)
    assert who == {h: "root" for h in HOSTS}, who
    who = per_host(ansible("all", "ansible.builtin.command", "whoami", "-e", "ansible_become=false", "-o").stdout)
    assert who == {h: "ops" for h in HOSTS}, who
    names = per_host(ansible("all", "ansible.builtin.command", "hostname", "-o").stdout)
    assert names == {h: h for h in HOSTS}, names

    # systemd is PID 1 of each host, each host in its own cgroup, no host sees another's processes.
    leaders = {h: pid(h) for h in HOSTS}
    lab_pids = list(leaders.values()) + [pid(h, ".nspawn") for h in HOSTS]
    assert len(set(leaders.values())) == 3
    for h in HOSTS:
        assert enter(h, "ps", "-p", "1", "-o", "comm=").stdout.strip() == "systemd"
        cg = Path(f"/proc/{leaders[h]}/cgroup").read_text()
        assert re.search(rf"^0::/dsv41-{h}(/|$)", cg, re.M), cg
        state = enter(h, "systemctl", "is-system-running", check=False).stdout.strip()
        assert state == "running", (h, state, enter(h, "systemctl", "--failed", check=False).stdout)
        # Debian's postinst enabled these; the rootfs hook disabled them (not masked): no host runs
        # them until roles/monitoring enables and starts them on the monitoring host.
        mon = enter(
            h,
            "systemctl",
            "is-enabled",
            "prometheus",
            "prometheus-alertmanager",
            "prometheus-node-exporter",
            check=False,
        ).stdout.split()
        assert mon == ["disabled"] * 3, (h, mon)
        # The controller's promotion journal directory, read-only, on the monitoring host only.
        seen = enter(h, "test", "-d", str(ROOT / "packages"), check=False).returncode == 0
        assert seen == (h == "x86host"), h
    assert enter("x86host", "touch", str(ROOT / "packages" / ".dsv41-probe"), check=False).returncode != 0
    probe = ansible("x86host", "ansible.builtin.command", "systemd-run --unit dsv41-probe sleep 4242", "-b")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    for h in HOSTS:
        seen = "sleep 4242" in enter(h, "ps", "-e", "-o", "args=").stdout
        assert seen == (h == "x86host"), h

    # Over the lab links: sparkhead reaches x86host's sshd on x86host's end of their direct link.
    tcp = ansible(
        "sparkhead",
        "ansible.builtin.command",
        "python3 -c \"import socket; s=socket.create_connection(('198.18.1.1', 22), 5); print(s.recv(64).decode().strip())\"",
        "-o",
    )
    assert per_host(tcp.stdout).get("sparkhead", "").startswith("SSH-2.0-OpenSSH"), tcp.stdout + tcp.stderr
    route = enter("sparkhead", "ip", "-o", "route", "get", "198.18.1.1").stdout
    assert " dev ofl0 " in route, route
    assert " mtu 9000 " in enter("sparkhead", "ip", "-o", "link", "show", "ofl0").stdout

    # docker inside each Spark: an image made by `docker import` of a tiny tarball runs with the
    # host's network (its netns address and hostname).
    make_image = (
        "set -e; tar -ch -C / -f /tmp/probe.tar usr/bin/cat lib/x86_64-linux-gnu/libc.so.6 lib64/ld-linux-x86-64.so.2;"
        " /usr/bin/docker import /tmp/probe.tar dsv41-lab-probe:1 >/dev/null;"
        " /usr/bin/docker images --no-trunc -q dsv41-lab-probe:1"
    )
    made = per_host(ansible("spark", "ansible.builtin.shell", make_image, "-b", "-o", timeout=300).stdout)
    assert set(made) == set(SPARKS) and all(v.startswith("sha256:") for v in made.values()), made
    for h in SPARKS:
        run = ansible(
            h,
            "ansible.builtin.command",
            f"/usr/bin/docker run --rm --network host {made[h]} /usr/bin/cat /proc/sys/kernel/hostname /proc/net/fib_trie",
            "-b",
            timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"\n{h}\n" in run.stdout and MGMT[h] in run.stdout, run.stdout
    info = ansible("sparkhead", "ansible.builtin.command", "/usr/bin/docker info", "-b")
    assert "Storage Driver: overlay2" in info.stdout and "Cgroup Driver: systemd" in info.stdout, info.stdout

    # A reboot: poweroff through the host's own systemd, then lab_up starts it again; sshd comes
    # back and /var/lib/docker (a bind-mounted directory) kept the image.
    old_leader = leaders["sparkworker"]
    nspawn_pid = pid("sparkworker", ".nspawn")
    enter("sparkworker", "systemctl", "poweroff")
    deadline = time.monotonic() + 30
    while Path(f"/proc/{nspawn_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{nspawn_pid}").exists(), "the machine did not power off within 30 s"
    t0 = time.monotonic()
    back = play("playbooks/lab_up.yml", "-i", INV)
    assert back.returncode == 0 and changed(back.stdout) == 1, back.stdout[-4000:]
    ping = ansible("sparkworker", "ansible.builtin.ping", None, "-b")
    assert ping.returncode == 0, ping.stdout + ping.stderr
    print(f"nspawn lab: sparkworker powered off and started again, answering ssh after {time.monotonic() - t0:.1f} s")
    assert pid("sparkworker") != old_leader
    lab_pids += [pid("sparkworker"), pid("sparkworker", ".nspawn")]
    kept = ansible(
        "sparkworker",
        "ansible.builtin.command",
        f"/usr/bin/docker image inspect -f ok {made['sparkworker']}",
        "-b",
        "-o",
    )
    assert per_host(kept.stdout).get("sparkworker") == "ok", kept.stdout

    # lab_down: nothing left, and only lab processes ended (an outsider of the same shape lives).
    outsider = subprocess.Popen(["sleep", "4242"])
    try:
        down()
        assert outsider.poll() is None, "lab_down killed a process outside the lab"
    finally:
        outsider.kill()
        outsider.wait()
    assert not _lab_processes(lab_pids), _lab_processes(lab_pids)
    _assert_nothing_left()

    # From nothing again, with the cached rootfs.
    _up_cached, t_cached = _up()
    print(f"nspawn lab: nothing -> three hosts answering Ansible over ssh in {t_cached:.1f} s (rootfs from the cache)")
    lab_pids = [pid(h) for h in HOSTS] + [pid(h, ".nspawn") for h in HOSTS]
    down()
    assert not _lab_processes(lab_pids)
    _assert_nothing_left()
