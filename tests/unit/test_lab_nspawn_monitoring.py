"""roles/monitoring on the nspawn lab (issue 22), without the lab: what roles/lab gives the hosts.

* The rootfs carries the Debian packages roles/monitoring starts (lab_nspawn_packages), and its
  setup hook (roles/lab/files/nspawn-rootfs-setup.sh) disables exactly the units those packages
  ship, which their postinst enabled: run on a fake root laid out as dpkg and deb-systemd-helper
  leave one (dpkg file lists, unit files, ``*.wants`` links), with this machine's
  ``systemctl --root``.
* The controller's promotion journal directory is bound read-only into the monitoring host only
  (lab_nspawn_binds_ro, read through Ansible on inventories/sim), the directory
  roles/monitoring's operations exporter reads, and ``nspawnhost.sh boot`` passes it to nspawn.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "roles" / "lab" / "files" / "nspawn-rootfs-setup.sh"
NSPAWNHOST = ROOT / "roles" / "lab" / "files" / "nspawnhost.sh"
LAB_DEFAULTS = yaml.safe_load((ROOT / "roles" / "lab" / "defaults" / "main.yml").read_text())
LAB_SPEC = yaml.safe_load((ROOT / "roles" / "lab" / "meta" / "argument_specs.yml").read_text())
MON_DEFAULTS = yaml.safe_load((ROOT / "roles" / "monitoring" / "defaults" / "main.yml").read_text())
# Debian's unit of each package roles/monitoring starts (its defaults name them).
MON_UNITS = {
    "prometheus": MON_DEFAULTS["monitoring_prometheus_service"] + ".service",
    "prometheus-alertmanager": MON_DEFAULTS["monitoring_alertmanager_service"] + ".service",
    "prometheus-node-exporter": MON_DEFAULTS["monitoring_node_exporter_service"] + ".service",
}
# Packages of the rootfs whose units must stay enabled (every host runs them).
KEPT_UNITS = {"openssh-server": "ssh.service", "docker.io": "docker.service"}

needs_systemctl = pytest.mark.skipif(
    shutil.which("systemctl") is None, reason="systemctl (systemd) is what the rootfs hook runs on the controller"
)


def _bash(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, text=True, timeout=60)


def _role_started() -> list[str]:
    r = _bash('source "$1"; printf "%s\\n" "${ROLE_STARTED_PACKAGES[@]}"', str(SETUP))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_the_rootfs_carries_what_roles_monitoring_starts():
    started = _role_started()
    wanted = (
        MON_DEFAULTS["monitoring_packages"]
        + MON_DEFAULTS["monitoring_alertmanager_packages"]
        + MON_DEFAULTS["monitoring_node_exporter_packages"]
    )
    assert sorted(started) == sorted(wanted) == sorted(MON_UNITS)
    assert set(started) <= set(LAB_DEFAULTS["lab_nspawn_packages"])
    spec = LAB_SPEC["argument_specs"]["main"]["options"]["lab_nspawn_packages"]["default"]
    assert spec == LAB_DEFAULTS["lab_nspawn_packages"], "the argument spec's default is the defaults' list"


def _fake_root(root: Path, packages: dict[str, str]) -> None:
    """What dpkg and deb-systemd-helper enable leave: each package's file list (its unit among
    other files), the unit file, and the enablement link its [Install] section asks for."""
    info, units = root / "var/lib/dpkg/info", root / "lib/systemd/system"
    wants = root / "etc/systemd/system/multi-user.target.wants"
    for d in (info, units, wants):
        d.mkdir(parents=True, exist_ok=True)
    for pkg, unit in packages.items():
        (info / f"{pkg}.list").write_text(
            f"/.\n/etc/default/{pkg}\n/lib/systemd\n/lib/systemd/system\n/lib/systemd/system/{unit}\n/usr/bin/{pkg}\n"
        )
        (units / unit).write_text(
            f"[Unit]\nDescription={pkg}\n[Service]\nExecStart=/usr/bin/{pkg}\n[Install]\nWantedBy=multi-user.target\n"
        )
        (wants / unit).symlink_to(f"/lib/systemd/system/{unit}")


def _is_enabled(root: Path, unit: str) -> str:
    r = subprocess.run(["systemctl", f"--root={root}", "is-enabled", unit], capture_output=True, text=True, timeout=60)
    return r.stdout.strip()


@needs_systemctl
def test_the_hook_disables_exactly_the_units_those_packages_enable(tmp_path):
    _fake_root(tmp_path, {**MON_UNITS, **KEPT_UNITS})
    assert all(_is_enabled(tmp_path, u) == "enabled" for u in [*MON_UNITS.values(), *KEPT_UNITS.values()])
    r = _bash('source "$1"; shift; disable_package_units "$@"', str(SETUP), str(tmp_path), *_role_started())
    assert r.returncode == 0, r.stderr
    assert {u: _is_enabled(tmp_path, u) for u in MON_UNITS.values()} == dict.fromkeys(MON_UNITS.values(), "disabled")
    assert {u: _is_enabled(tmp_path, u) for u in KEPT_UNITS.values()} == dict.fromkeys(KEPT_UNITS.values(), "enabled")
    # disabled, not masked: the unit files stay, no link to /dev/null anywhere (the role enables them)
    assert all((tmp_path / "lib/systemd/system" / u).is_file() for u in MON_UNITS.values())
    assert not [p for p in tmp_path.rglob("*") if p.is_symlink() and os.readlink(p) == "/dev/null"]
    # a second run (a rebuilt rootfs runs the hook once, but it must not depend on that)
    r = _bash('source "$1"; shift; disable_package_units "$@"', str(SETUP), str(tmp_path), *_role_started())
    assert r.returncode == 0, r.stderr


@needs_systemctl
def test_a_package_missing_from_the_rootfs_fails_the_build(tmp_path):
    _fake_root(tmp_path, {k: v for k, v in MON_UNITS.items() if k != "prometheus-alertmanager"})
    r = _bash('source "$1"; shift; disable_package_units "$@"', str(SETUP), str(tmp_path), *_role_started())
    assert r.returncode != 0
    assert "package prometheus-alertmanager is not in the rootfs (lab_nspawn_packages)" in r.stderr


def _lab_vars(with_monitoring_defaults: bool, tmp_path: Path, *extra: str) -> dict[str, dict]:
    """Per host of inventories/sim: lab_nspawn_binds_ro and lab_nspawn_monitoring_host as
    roles/dsv41's and roles/lab's defaults compute them (lab_up's play: roles/monitoring's defaults not loaded), or
    with roles/monitoring's defaults loaded too (then also its monitoring_host and journal). The play
    lies in ``<out>/playbooks/`` as the project's plays do (dsv41_packages_dir is playbook_dir's
    parent's packages/); ``extra``: more ``-e`` values."""
    files = [
        ROOT / "roles/dsv41/defaults/main.yml",
        ROOT / "roles/lab/defaults/main.yml",
    ]  # every play lists dsv41 first
    if with_monitoring_defaults:
        files.append(ROOT / "roles/monitoring/defaults/main.yml")
    out = tmp_path / ("with-monitoring" if with_monitoring_defaults else "lab") / "playbooks"
    out.mkdir(parents=True, exist_ok=True)
    expr = (
        "{{ {'binds': lab_nspawn_binds_ro, 'host': lab_nspawn_monitoring_host,"
        " 'journal': monitoring_ops_journal | default(''), 'monitoring_host': monitoring_host | default('')}"
        " | to_json }}"
    )
    play = [
        {
            "hosts": "spark:offload",
            "gather_facts": False,
            "tasks": [{"ansible.builtin.include_vars": {"file": str(f)}} for f in files]
            + [
                {
                    "ansible.builtin.copy": {
                        "content": expr,
                        "dest": f"{out}/{{{{ inventory_hostname }}}}.json",
                        "mode": "0644",
                    }
                }
            ],
        }
    ]
    pb = out / "lab_vars.yml"
    pb.write_text(yaml.safe_dump(play))
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    )
    # run here, as this user: the values only (no host is reached)
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            "inventories/sim",
            str(pb),
            "-e",
            "ansible_connection=local",
            "-e",
            "ansible_become=false",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return {h: json.loads((out / f"{h}.json").read_text()) for h in ("sparkhead", "sparkworker", "x86host")}


def test_the_journal_directory_is_bound_into_the_monitoring_host_only(tmp_path):
    got = _lab_vars(False, tmp_path)
    packages = str(tmp_path / "lab" / "packages")  # playbooks/lab_up.yml binds <project>/packages
    assert got["x86host"]["binds"] == [packages]
    assert got["sparkhead"]["binds"] == got["sparkworker"]["binds"] == []
    assert {v["host"] for v in got.values()} == {"x86host"}
    # the same host and directory roles/monitoring computes for Prometheus and the ops exporter
    mon = _lab_vars(True, tmp_path)
    assert {v["monitoring_host"] for v in mon.values()} == {"x86host"}
    assert mon["x86host"]["binds"] == [str(Path(mon["x86host"]["journal"]).parent)]
    assert mon["x86host"]["binds"] == [str(tmp_path / "with-monitoring" / "packages")]
    assert all(bool(mon[h]["binds"]) == bool(got[h]["binds"]) for h in got)


@pytest.mark.parametrize("override", ["monitoring_ops_journal=/srv/ops/journal.jsonl", "dsv41_packages_dir=/srv/ops"])
def test_an_inventory_journal_or_packages_dir_moves_the_bind(tmp_path, override):
    """The bind follows the one variable an operator sets (no copied path in roles/lab): the
    exporter's journal, or the packages directory roles/promotion and roles/monitoring share."""
    for with_monitoring in (False, True):
        got = _lab_vars(with_monitoring, tmp_path, "-e", override)
        assert got["x86host"]["binds"] == ["/srv/ops"], (with_monitoring, got)
        if with_monitoring:
            assert got["x86host"]["journal"] == "/srv/ops/journal.jsonl"


def _boot_check(tmp_path: Path, *binds: str) -> subprocess.CompletedProcess:
    """``nspawnhost.sh --check boot`` for a machine that is not up (no pid files): says what it would do."""
    args = [
        "m1",
        "dsv41-m1",
        str(tmp_path / "hd"),
        str(tmp_path / "m1.pid"),
        str(tmp_path / "m1.nspawn.pid"),
        "dsv41-m1",
        str(tmp_path / "images"),
        str(tmp_path / "log"),
    ]
    return subprocess.run(
        ["bash", str(NSPAWNHOST), "--check", "boot", *args, *binds], capture_output=True, text=True, timeout=60
    )


def test_boot_passes_each_bind_read_only_at_the_same_path(tmp_path):
    r = _boot_check(tmp_path)
    assert r.returncode == 0 and r.stdout == "changed: boot m1 (systemd-nspawn in dsv41-m1, cgroup dsv41-m1)\n", r
    r = _boot_check(tmp_path, "/srv/a/packages", "/srv/b")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        "changed: boot m1 (systemd-nspawn in dsv41-m1, cgroup dsv41-m1; --bind-ro=/srv/a/packages --bind-ro=/srv/b)\n"
    )


@pytest.mark.parametrize("bad", ["relative/packages", "/srv/a:b"])
def test_boot_refuses_a_bind_nspawn_would_misread(tmp_path, bad):
    r = _boot_check(tmp_path, bad)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"nspawnhost: m1: bind {bad}: not an absolute path without ':'\n"
