"""deploy.yml on the nspawn lab (inventories/sim, docs/lab.md): the engram server, the
drafter worker and both engine ranks as systemd units (roles/dsv41_service), the package installed
offline from the wheelhouse, over ssh + become. One module, in order, on one deployed lab:

a) deploy from nothing (the cached rootfs when there is one): greedy references identical, zero
   fallbacks; a second deploy is changed=0 on every host; both times printed;
b) status.yml passes on it; every service is an enabled, active unit;
d) a host reboot (poweroff the nspawn machine through its systemd, then lab_up) of x86host and of
   sparkworker: every enabled service comes back and the stack is healthy without Ansible (a rank
   that kept running may fall back on its first lookups, until it reconnects: bounded, counted).

The faults (c: ``systemctl kill`` of the table server and ``docker kill`` of rank 0's container;
e: a unit that fails to start; f: a host rebooted mid-window; a wrong serving image pin) run on
make test's shared lab: tests/integration/test_lab_faults.py.

Takes over the lab on this machine (like test_lab_nspawn); marked lab_long.
"""

from __future__ import annotations

import time

import httpx
import pytest

from labutil import needs_lab, play
from nspawnutil import (
    INV,
    UNITS,
    changed,
    complete,
    deploy,
    down,
    engram_counts,
    enter,
    needs_hybrid_cgroups,
    poweroff,
    recap,
    status_json,
    unit,
    up,
    wait_healthy,
)

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.lab_long, needs_lab, needs_hybrid_cgroups]


@pytest.fixture(scope="module")
def deployed():
    """Nothing -> deploy.yml -> deploy.yml again; the lab comes down after the module."""
    down()
    res, t_cold = deploy()
    print(f"\nnspawn deploy.yml from nothing: rc {res.returncode}, {t_cold:.1f} s, {recap(res.stdout)}", flush=True)
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-2000:]
    again, t_warm = deploy()
    print(f"nspawn deploy.yml again: rc {again.returncode}, {t_warm:.1f} s, {recap(again.stdout)}", flush=True)
    assert again.returncode == 0, again.stdout[-8000:] + again.stderr[-2000:]
    yield {"first": res, "t_first": t_cold, "again": again, "t_again": t_warm}
    down()


def test_a_deploy_then_deploy_again_changes_nothing(deployed):
    first, again = deployed["first"].stdout, deployed["again"].stdout
    print(
        f"\nnspawn deploy.yml: nothing -> deployed {deployed['t_first']:.1f} s; again {deployed['t_again']:.1f} s"
        f" (changed={changed(again)})"
    )
    for out in (first, again):
        assert "status: HEALTHY" in out, out[-4000:]
    assert "6/6 identical" in again, again[-6000:]
    rc = recap(again)
    assert set(rc) >= {"localhost", "sparkhead", "sparkworker", "x86host"}, again[-3000:]
    assert {h: v["changed"] for h, v in rc.items()} == {h: 0 for h in rc}, again.split("PLAY RECAP")[-1]
    # the units are systemd's, the package is the host's own venv (no link onto the controller)
    for h, names in UNITS.items():
        for u in names:
            st = unit(h, u)
            assert st["ActiveState"] == "active" and st["UnitFileState"] == "enabled", (h, u, st)
        assert not enter(h, "test", "-L", "/opt/dsv41/venv", check=False).returncode == 0
    eng = engram_counts()
    assert set(eng) == {"0", "1"} and all(c["lookups"] > 0 and c["fallbacks"] == 0 for c in eng.values()), eng


def test_b_status_playbook_passes(deployed):
    t0 = time.monotonic()
    st = play("status.yml", "-i", INV, "-e", "status_window_s=2")
    assert st.returncode == 0 and "status: HEALTHY" in st.stdout, st.stdout[-5000:]
    assert changed(st.stdout) == 0
    rc, rep = status_json()
    assert rc == 0 and rep["healthy"], rep.get("reasons")
    assert rep["hosts"]["x86host"]["services"] == {"dsv41-drafter": "active", "dsv41-engram-server": "active"}
    assert rep["hosts"]["sparkhead"]["services"] == {"dsv41-serve": "active"}
    print(f"\nstatus.yml on the nspawn lab: {time.monotonic() - t0:.1f} s (with dsv41 status --json)")


@pytest.mark.parametrize("host", ["x86host", "sparkworker"])
def test_d_reboot_brings_every_service_back_without_ansible(deployed, host):
    old = {u: unit(host, u)["MainPID"] for u in UNITS[host]}
    poweroff(host, timeout_s=90)  # TimeoutStopSec of the units bounds it
    t0 = time.monotonic()
    back, _ = up()
    assert changed(back.stdout) == 1, back.stdout[-4000:]
    for u in UNITS[host]:
        st = unit(host, u)
        assert st["UnitFileState"] == "enabled", (u, st)
    t_ok, rep = wait_healthy(240)
    assert rep.get("healthy"), rep.get("reasons")
    for u in UNITS[host]:
        st = unit(host, u)
        assert st["ActiveState"] == "active" and st["MainPID"] != old[u], (u, st)
    eng0 = engram_counts()
    with httpx.Client(timeout=60, trust_env=False) as c:
        # A rank that kept running finds its connection to the old table server dead on first use:
        # that lookup falls back (exact local rows) and the reconnect thread connects to the new
        # server, so the first requests after an x86host reboot may count fallbacks; they must stop.
        warm, deadline = 0, time.monotonic() + 60
        while True:
            before = engram_counts()
            complete(1000 + warm, c)
            warm += 1
            after = engram_counts()
            if all(
                after[r]["lookups"] > before[r]["lookups"] and after[r]["fallbacks"] == before[r]["fallbacks"]
                for r in ("0", "1")
            ):
                break
            assert time.monotonic() < deadline, ("rows never remote again after the reboot", eng0, after)
        c2 = engram_counts()
        for i in range(3):
            complete(2000 + i, c)
    eng = engram_counts()
    assert all(
        eng[r]["lookups"] > c2[r]["lookups"] and eng[r]["fallbacks"] == c2[r]["fallbacks"] for r in ("0", "1")
    ), (c2, eng)
    cost = {r: c2[r]["fallbacks"] - eng0[r]["fallbacks"] for r in ("0", "1")}
    print(
        f"\n{host} rebooted: lab_up + healthy (no Ansible) {time.monotonic() - t0:.1f} s (healthy {t_ok:.1f} s after "
        f"lab_up); remote again after {warm} request(s), fallbacks on the way {cost}"
    )
