"""`dsv41 status` and `ansible-playbook status.yml` on the deployed three-host lab, and README's
"Try it" snippets run straight from README.md (so the docs cannot drift):

- deploy.yml again on the deployed lab changes nothing on any host (deploy's idempotence, proved
  here in ``make test``; the full molecule scenario runs under ``make lab-long``), the lab is
  healthy, that deploy's summary is status's (same lines), status.yml --check changes nothing;
  the README's curl (streaming), openai client and /metrics snippets work as printed;
- admission held: exit 1, "admission held since <UTC time> (N s)";
- the table server stopped, with traffic: exit 1 naming the fallbacks growing on both ranks and the
  stopped service; the test starts it again so the lab it leaves is production (no re-deploy for
  the next module).

Uses the session's shared deployed lab (conftest.py: one deploy of about 200 s). Takes over the lab on this machine
like the molecule test; skipped unless root + iproute2.
"""

from __future__ import annotations

import calendar
import json
import re
import subprocess
import sys
import threading
import time

import pytest

from labutil import (
    API,
    BIN,
    ROOT,
    admission_state,
    env,
    inside,
    needs_lab,
    play,
    post as lab_post,
    refused_without_credential,
)

pytestmark = [pytest.mark.lab, pytest.mark.slow, needs_lab]


@pytest.fixture
def deployed(deployed_lab):
    """The shared deployed lab (conftest.py); the value is its deploy.yml output."""
    return deployed_lab


def _status(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "dsv41"), "status", *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout
    )


def _readme_snippets() -> dict[str, tuple[str, str]]:
    """``{name: (language, code)}`` of the blocks marked ``<!-- try-it: NAME -->`` in README.md."""
    text = (ROOT / "README.md").read_text()
    return {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"<!-- try-it: (\S+) -->\n```(\w+)\n(.*?)```", text, re.S)
    }


def _recap_changed(stdout: str) -> dict[str, int]:
    """``{host: changed}`` from the last PLAY RECAP of an ansible-playbook run."""
    recap = stdout.split("PLAY RECAP")[-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s*:\s*ok=\d+\s+changed=(\d+)", recap, re.M)}


def test_healthy_after_deploy_and_the_deploy_summary_is_status(deploy_again):
    """deploy.yml on the shared lab, fresh (earlier modules may have moved it, e.g. the promotion
    pointer): a run on what deploy.yml left changes nothing on any host, and its summary is what
    ``dsv41 status`` says now. When an earlier module left the lab healthy but not byte-for-byte
    deploy's (the first run reports changes), that run converges it and the second must change
    nothing; either way the asserted run follows a deploy.yml run."""
    t0 = time.monotonic()
    dep = deploy_again()
    assert dep.returncode == 0, dep.stdout[-6000:] + dep.stderr[-2000:]
    if any(_recap_changed(dep.stdout).values()):
        print(f"\nfirst deploy.yml converged an earlier module's changes: {_recap_changed(dep.stdout)}")
        dep = deploy_again()
        assert dep.returncode == 0, dep.stdout[-6000:] + dep.stderr[-2000:]
    changed = _recap_changed(dep.stdout)
    assert set(changed) == {"localhost", "sparkhead", "sparkworker", "x86host"}, dep.stdout[-3000:]
    assert set(changed.values()) == {0}, dep.stdout.split("PLAY RECAP")[-1]
    print(f"\ndeploy.yml, idempotent re-run: {time.monotonic() - t0:.1f} s, changed=0 on every host")
    deployed = dep.stdout

    r = _status("--json", "--window", "2")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    rep = json.loads(r.stdout)
    assert rep["healthy"] and rep["reasons"] == []
    hosts = rep["hosts"]
    assert all(h["reachable"] for h in hosts.values())
    # systemd units (systemctl list-units' ACTIVE column), as production
    assert hosts["sparkhead"]["services"] == {"dsv41-serve": "active"}
    assert hosts["x86host"]["services"] == {"dsv41-drafter": "active", "dsv41-engram-server": "active"}
    tables = {json.dumps(h["manifest"]["tables"], sort_keys=True) for h in hosts.values()}
    assert len(tables) == 1 and len(json.loads(tables.pop())) == 2  # layers 1 and 14, same everywhere
    assert rep["drafter_worker"]["identities"]["target"] == hosts["sparkhead"]["drafter"]["target"] != ""
    assert rep["api"]["admission"] == "open" and set(rep["engine"]["engram"]) == {"0", "1"}
    assert all(c["lookups"] > 0 and c["fallbacks"] == 0 for c in rep["engine"]["engram"].values())
    assert rep["engine"]["drafter"]["rounds"] > 0

    # the deploy ended with the same summary (one implementation)
    assert "status: HEALTHY" in deployed and f"API: {API} (model dsv41-lab; health ok)" in deployed
    text = _status("--window", "0")
    assert text.returncode == 0 and text.stdout.startswith("status: HEALTHY\n"), text.stdout
    for line in text.stdout.splitlines():
        if line.startswith(("sparkhead (", "sparkworker (", "x86host (")):
            assert line in deployed, line

    chk = play("status.yml", "--check", "-e", "status_window_s=1")
    assert chk.returncode == 0, chk.stdout[-4000:]
    assert "status: HEALTHY" in chk.stdout
    assert re.findall(r"changed=(\d+)", chk.stdout.split("PLAY RECAP")[-1]) == ["0"] * 4, chk.stdout[-2000:]


def test_readme_try_it_snippets_run_against_the_lab(deployed):
    snippets = _readme_snippets()
    assert set(snippets) == {"curl", "openai", "metrics"}
    assert f"API: {API}" in deployed and API in (ROOT / "README.md").read_text()

    lang, code = snippets["curl"]
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=120)
    assert lang == "bash" and r.returncode == 0, r.stderr
    events = [ln[6:] for ln in r.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2  # streamed: several chunks, then [DONE]
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])

    lang, code = snippets["openai"]
    assert lang == "python" and len(code.strip().splitlines()) == 5
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env())
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]

    lang, code = snippets["metrics"]
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=60)
    assert lang == "bash" and r.returncode == 0, r.stderr
    assert re.search(r'^dsv41_engram_lookups_total\{rank="0"\} [1-9]', r.stdout, re.M), r.stdout
    assert re.search(r'^dsv41_engram_fallbacks_total\{rank="1"\} ', r.stdout, re.M), r.stdout


def test_admission_held_says_held_and_since_when(deployed):

    t0 = time.time()
    assert lab_post(f"{API}/pause", timeout=60).json()["paused"] is True
    try:
        time.sleep(1.5)
        r = _status("--window", "0")
        assert r.returncode == 1, r.stdout
        m = re.search(r"^unhealthy: admission held since (\S+Z) \((\d+) s\)$", r.stdout, re.M)
        assert m, r.stdout
        since = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%SZ"))
        assert t0 - 2 <= since <= t0 + 2 and int(m.group(2)) >= 1
        rep = json.loads(_status("--window", "0", "--json").stdout)
        assert rep["api"]["admission"] == "held" and abs(rep["api"]["since"] - t0) < 2
        assert [x for x in rep["reasons"] if not x.startswith("admission held")] == []
        # status.yml says the same and fails
        pb = play("status.yml", "-e", "status_window_s=0")
        assert pb.returncode != 0 and "unhealthy: admission held since" in pb.stdout
    finally:
        lab_post(f"{API}/resume", timeout=30)
    assert _status("--window", "0").returncode == 0


def test_table_server_stopped_names_the_fallbacks_on_both_ranks(deployed):
    import httpx

    ctl = ["systemctl"]
    inside("x86host", *ctl, "stop", "dsv41-engram-server.service")
    stop = threading.Event()
    sent = []

    def traffic():
        i = 0
        with httpx.Client(timeout=60, trust_env=False) as c:
            while not stop.is_set():
                c.post(
                    f"{API}/v1/completions", json={"model": "dsv41-lab", "prompt": f"fault probe {i} ", "max_tokens": 4}
                )
                sent.append(i)
                i += 1

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        time.sleep(2)
        r = _status("--window", "5")
    finally:
        stop.set()
        t.join(60)
        # production again for the next module (else its deployed_lab re-deploys, ~3 min)
        inside("x86host", *ctl, "start", "dsv41-engram-server.service", check=False)
    assert sent, "no request completed while the table server was stopped"
    assert r.returncode == 1, r.stdout
    out = r.stdout
    for rank in (0, 1):
        assert re.search(
            rf"^unhealthy: rank {rank}: Engram fallbacks growing \(\+[1-9]\d* in 5 s, [1-9]\d* since start\)$",
            out,
            re.M,
        ), out
    # systemctl list-units' ACTIVE column of a stopped unit
    assert "unhealthy: x86host: dsv41-engram-server is inactive" in out, out
    assert "unhealthy: Engram table server http://198.18.0.13:9441: unreachable" in out


def test_an_anonymous_pause_is_refused_on_the_lab(deployed_lab):
    """Rank 0 of the deployed lab (the stand-in engine) refuses admission commands without the
    operator credential, and nothing moves."""
    before = admission_state()
    codes = refused_without_credential()
    assert set(codes.values()) == {401}, codes
    assert admission_state() == before
