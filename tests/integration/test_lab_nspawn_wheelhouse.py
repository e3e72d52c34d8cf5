"""The offline install (roles/dsv41_package, install method wheelhouse) on the nspawn lab, whose
hosts have no route to any registry: the controller builds the wheelhouse (python/dsv41/wheelhouse.py),
each host pip installs with --no-index and builds both extensions (_fastrow, _core) itself; a second run is changed=0, a check
run with diff changes nothing; a wheel missing from the wheelhouse and a host without python3-venv
each fail with one line naming the requirement / the host.

Takes over the lab on this machine (like test_lab_nspawn); marked lab_long. Prints the wheelhouse
build (cold and warm) and install times.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from labutil import HOSTS, LAB, ROOT, needs_lab, play
from nspawnutil import INV, changed, down, enter, needs_hybrid_cgroups, up

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.lab_long, needs_lab, needs_hybrid_cgroups]

CACHE = LAB / "artifacts" / "wheelhouse"
PLAY = """---
- name: Install the dsv41 package offline
  hosts: all
  vars:
    dsv41_venv: /opt/dsv41/venv
  roles:
    - role: dsv41_package
"""


def _install(pb: Path, *args: str):
    t0 = time.monotonic()
    res = play(str(pb), "-i", INV, *args, env_extra={"ANSIBLE_ROLES_PATH": str(ROOT / "roles")}, timeout=1200)
    return res, time.monotonic() - t0


def _failed_lines(out: str) -> list[str]:
    """Ansible's one-line task failures (``[ERROR]: Task failed: Action failed: <msg>``)."""
    return [ln for ln in out.splitlines() if ln.startswith("[ERROR]: Task failed")]


def test_hosts_install_offline_from_the_wheelhouse(tmp_path):
    down()
    shutil.rmtree(CACHE, ignore_errors=True)
    pb = tmp_path / "package.yml"
    pb.write_text(PLAY)
    up()
    try:
        # no registry: nothing outside 198.18.0.0/15 is routable from a host
        for h in HOSTS:
            probe = enter(
                h, "python3", "-c", "import socket; socket.create_connection(('151.101.0.223', 443), 3)", check=False
            )
            assert probe.returncode != 0 and ("unreachable" in probe.stderr or "timed out" in probe.stderr), (
                probe.stderr
            )
        cold, t_cold = _install(pb)
        assert cold.returncode == 0, cold.stdout[-6000:] + cold.stderr[-2000:]
        keys = [p for p in CACHE.iterdir() if not p.name.startswith(".")]
        size = sum(f.stat().st_size for k in keys for f in k.iterdir())
        print(
            f"\nwheelhouse: {len(keys)} entries, {size / 1e6:.1f} MB; first deploy (cold build + copy + install) {t_cold:.1f} s"
        )
        for h in HOSTS:
            ver = enter(h, "/opt/dsv41/venv/bin/dsv41", "version", "--json")
            assert "transport" in json.loads(ver.stdout), ver.stdout
            for so_glob in ("transport/_fastrow*.so", "overlay/_core*.so"):  # setup.py's two extensions
                so = enter(h, "sh", "-c", f"ls /opt/dsv41/venv/lib/python3.11/site-packages/dsv41/{so_glob}")
                assert "x86_64-linux-gnu" in so.stdout, so.stdout
            assert enter(h, "/opt/dsv41/venv/bin/pip", "check").returncode == 0
        warm, t_warm = _install(pb)
        assert warm.returncode == 0 and changed(warm.stdout) == 0, warm.stdout[-6000:]
        check, _ = _install(pb, "--check", "--diff")
        assert check.returncode == 0 and changed(check.stdout) == 0, check.stdout[-6000:]
        print(f"wheelhouse: second deploy (warm, changed=0) {t_warm:.1f} s")

        # a wheel missing from the controller's wheelhouse: one failure naming the requirement
        entry = next(k for k in keys if list(k.glob("scipy-*.whl")))
        wheel = next(entry.glob("scipy-*.whl"))
        saved = tmp_path / wheel.name
        shutil.move(wheel, saved)
        miss, _ = _install(pb, "--limit", "sparkhead")
        assert miss.returncode != 0
        msgs = [m for m in _failed_lines(miss.stdout) if "wheelhouse" in m]
        assert len(msgs) == 1 and "sparkhead:" in msgs[0] and "requirement scipy" in msgs[0], miss.stdout[-4000:]
        shutil.move(saved, wheel)

        # a host without python3-venv: one line naming the host
        enter("sparkworker", "mv", "/usr/lib/python3.11/ensurepip", "/usr/lib/python3.11/ensurepip.off")
        try:
            novenv, _ = _install(pb, "--limit", "sparkworker")
        finally:
            enter("sparkworker", "mv", "/usr/lib/python3.11/ensurepip.off", "/usr/lib/python3.11/ensurepip")
        assert novenv.returncode != 0
        msgs = [m for m in _failed_lines(novenv.stdout) if "python3-venv" in m]
        assert len(msgs) == 1 and re.search(r"sparkworker: /usr/bin/python3 has no venv/ensurepip", msgs[0]), (
            novenv.stdout[-4000:]
        )
    finally:
        down()
