"""The deployed three-host lab, shared by every lab test module of one pytest session.

A deploy costs about 200 s on the 2-core CI machine, so modules do not deploy their own lab:
``deployed_lab`` deploys once and hands every later requester the same lab, after checking that
it is still what deploy.yml left (``dsv41 status`` exit 0: all services up, admission open, zero
fallbacks). A module that leaves the lab changed or down (test_lab_updown, molecule, a drill that
failed to restore) costs the next requester a re-deploy, which is deploy.yml's own promise: it
converges any state back to production. The lab comes down once, at the end of the session.

Order: the tests that use ``deployed_lab`` run after every other test of the session (stable
order among themselves), so a test that brings its own lab up and down (test_lab_updown, the
molecule scenario under ``make lab-long``) runs before the shared lab exists instead of taking it
down between two of its users (each such gap cost a full re-deploy, ~175 s, in the combined CI run).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from labutil import BIN, LAB, ROOT, end_leftovers, ensure_credential, env, play

_STATE: dict = {"deploy_out": None, "used": False}


def pytest_configure(config):
    """One operator credential for the session: the engines the tests start, the lab's rank 0 (the
    deploy keeps an existing one) and every client (labutil.operator_headers, the harness)."""
    os.environ["DSV41_OPERATOR_CREDENTIAL_FILE"] = str(ensure_credential())


def pytest_collection_modifyitems(session, config, items):
    """Move the shared-lab tests to the end, keeping the order within each group, and the ones
    that add monitoring to the shared lab (``monitored``: Prometheus and exporters as programs on
    x86host, so in its managed files and service list) after every other shared-lab test, which
    compare the lab with the package and the service set that deploy.yml alone gives; the ones on
    the vLLM lab (``vllm_lab``: the Sparks switched to real vLLM) last of all."""

    def key(item) -> tuple[bool, bool, bool]:
        names = getattr(item, "fixturenames", ())
        vllm = "vllm_lab" in names  # asks for deployed_lab itself, at the switch
        return "deployed_lab" in names or vllm, vllm, "monitored" in names

    items.sort(key=key)


@pytest.fixture(autouse=True)
def _no_killed_playbook_left():
    """After each test: end what outlived a playbook the test SIGKILLed (``labutil.sigkill_group``)."""
    yield
    ended = end_leftovers()
    if ended:
        print(f"\n[lab] ended {len(ended)} process(es) of a SIGKILLed playbook left alive: {ended}", flush=True)


def lab_is_production() -> bool:
    """True when the lab's three hosts are up and ``dsv41 status`` calls them healthy (exit 0)."""
    if not all((LAB / f"{h}.pid").exists() for h in ("sparkhead", "sparkworker", "x86host")):
        return False
    r = subprocess.run(
        [str(BIN / "dsv41"), "status", "--window", "2"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return r.returncode == 0


def _deploy() -> subprocess.CompletedProcess:
    _STATE["used"] = True
    r = play("deploy.yml", timeout=1800)
    if r.returncode == 0:
        _STATE["deploy_out"] = r.stdout
    return r


@pytest.fixture
def deployed_lab() -> str:
    """A healthy deployed lab; the value is the stdout of the deploy.yml run that made it (the last
    one, possibly from an earlier module: later modules may have moved the lab since, e.g. the
    promotion pointer; a test that compares with what runs now deploys afresh via ``deploy_again``).
    Deploys (again) when the lab is down or not healthy."""
    _STATE["used"] = True
    if _STATE["deploy_out"] is None or not lab_is_production():
        r = _deploy()
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    return _STATE["deploy_out"]


@pytest.fixture
def deploy_again(deployed_lab):
    """``deploy_again()`` runs deploy.yml once more on the shared lab and returns the completed
    process (stdout: its task log, recap and status summary); a successful run becomes the
    shared fixture's deploy output."""
    return _deploy


@pytest.fixture(scope="session", autouse=True)
def _lab_down_at_the_end():
    yield
    if _STATE["used"]:
        play("playbooks/lab_down.yml")
