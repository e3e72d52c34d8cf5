"""`make window-drills`: window.yml's fault drills and verdict windows on the three-host lab.

Each test prints what it saw (seconds, verdicts, effects) for docs/windows.md. Run under the
lab lock; deploys when the lab is not production (``dsv41 status``), leaves it production.
Order matters (a later drill uses the state an earlier one left on purpose: the restore drill
leaves a held window that ``-e restore_only=true`` restores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from dsv41.harness.procident import ProcessIdentity  # noqa: E402
from dsv41.harness.window_pid import RUN_PID_NAME, run_process  # noqa: E402
from labutil import BIN, ROOT, env, inside, needs_lab, play  # noqa: E402

pytestmark = [needs_lab]
API = "http://198.18.0.11:8000"
DRILL = str(ROOT / "candidates" / "specs" / "drill.json")
LAB_SPEC = str(ROOT / "candidates" / "specs" / "lab-window.json")
# One directory per run of this module: the tests glob their window's files (decision.json,
# cells.jsonl), and an earlier run's files in the same place made the killed-run drill kill
# before the HOLD (it saw the old run's cells) and ``verdict`` find two decisions.
WDIR = Path(os.environ.get("WINDOW_DRILLS_DIR", "/tmp/dsv41-window-drills")) / time.strftime("%Y%m%dT%H%M%S")


def flat(out: str) -> str:
    """Ansible's YAML callback wraps long messages and doubles quotes: one line, plain quotes."""
    return " ".join(out.split()).replace("''", "'")


def status_ok() -> bool:
    return (
        subprocess.run(
            [str(BIN / "dsv41"), "status", "--window", "1"],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            timeout=300,
            check=False,
        ).returncode
        == 0
    )


def paused() -> bool:
    from dsv41.harness import admission

    return admission.status(API) == "held"


def window(name: str, *args: str, timeout: int = 1800) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    r = play("window.yml", "-e", f"windows_dir={WDIR / name}", *args, timeout=timeout)
    dt = time.monotonic() - t
    print(f"\n== {name}: rc {r.returncode}, {dt:.0f} s")
    return r, dt


def window_open() -> bool:
    """The promotion journal's last operation is a window that owes its restore."""
    r = subprocess.run(
        [str(BIN / "dsv41"), "package", "journal", "--path", str(ROOT / "packages" / "journal.jsonl"), "--json"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    d = json.loads(r.stdout)
    return d["kind"] == "window" and d["action"] != "none"


def restored(wdir: Path) -> None:
    """Every host's managed files equal the window's package (its snapshot), the journal has
    nothing owed, admission is open and status is healthy."""
    (pkg_path,) = sorted(wdir.glob("*/package"))[-1:]
    pid = pkg_path.read_text().strip()
    doc = json.loads((ROOT / "packages" / pid / "package.json").read_text())
    for host, h in doc["hosts"].items():
        want = {p: f["sha256"] for p, f in h["files"].items()}
        out = inside(host, "sha256sum", *sorted(want)).stdout
        assert {ln.split()[1]: ln.split()[0] for ln in out.splitlines()} == want, host
    assert not window_open() and not paused() and status_ok()


@pytest.fixture(scope="module", autouse=True)
def lab():
    if not status_ok():
        r = play("deploy.yml", timeout=1800)
        assert r.returncode == 0, r.stdout[-4000:]
    yield
    if not status_ok():
        play("window.yml", "-e", "restore_only=true", "-e", f"windows_dir={WDIR / 'killed'}")


def verdict(wdir: Path, cand: str) -> dict:
    (p,) = wdir.glob(f"*-{cand}/decision.json")
    d = json.loads(p.read_text())["decision"]
    print(f"   {cand}: {d['verdict']} effect {d['effect']} CI {d['ci']} pairs {d['n_pairs']}")
    return d


def test_arm_start_fault():
    r, _ = window("armstart", "-e", "candidate=slow-rows", "-e", f"window_spec={DRILL}", "-e", "window_fault=arm_start")
    assert r.returncode != 0 and "switching to the candidate arm failed" in flat(r.stdout)
    restored(WDIR / "armstart")


def test_mid_cell_fault():
    r, _ = window("midcell", "-e", "candidate=slow-rows", "-e", f"window_spec={DRILL}", "-e", "window_fault=mid_cell")
    (dec,) = (WDIR / "midcell").glob("*-slow-rows/decision.json")
    fault = json.loads(dec.read_text()).get("fault")
    print(f"   fault drill: {fault}")
    assert fault and fault["triggered"] and fault["rc"] == 0, (
        dec.with_name("fault.log").read_text()[-3000:] if dec.with_name("fault.log").exists() else fault
    )
    assert r.returncode != 0
    assert "a window was INVALID" in flat(r.stdout), r.stdout[-4000:]
    assert verdict(WDIR / "midcell", "slow-rows")["verdict"] == "INVALID"  # decision.json written
    restored(WDIR / "midcell")


def test_restore_fault_holds_then_restore_only_reopens():
    r, _ = window("restorefault", "-e", "candidate=aa", "-e", f"window_spec={DRILL}", "-e", "window_fault=restore")
    assert r.returncode != 0
    assert "sparkworker: 1 managed file(s) differ from package" in flat(r.stdout), r.stdout[-4000:]
    assert "/etc/dsv41/serve.env; restore check FAILED, admission stays HELD" in flat(r.stdout)
    assert paused() and window_open()
    r, dt = window("restorefault", "-e", "restore_only=true")
    assert r.returncode == 0, r.stdout[-4000:]
    restored(WDIR / "restorefault")


def test_killed_run_is_restored_by_the_next():
    wdir = WDIR / "killed"
    wdir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(BIN / "ansible-playbook"),
        "window.yml",
        "-e",
        "candidate=slow-rows",
        "-e",
        f"window_spec={DRILL}",
        "-e",
        f"windows_dir={wdir}",
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        cells = list(wdir.glob("*-slow-rows/cells.jsonl"))
        if window_open() and cells and len(cells[0].read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    # every process of the killed run, by identity: ansible's workers setsid(), so the killpg
    # below (an operator's kill -9 of the job) misses them; the next window.yml must end them
    tree = [ProcessIdentity.of(c.pid) for c in psutil.Process(p.pid).children(recursive=True)]
    os.killpg(p.pid, signal.SIGKILL)  # the group we started: ansible-playbook and its non-worker children
    p.wait()
    print(f"   left after the kill: {sum(i.alive() for i in tree)} of the run's {len(tree)} processes")
    assert window_open() and paused()
    # the window's `dsv41 window run` is not in that group: it survives the kill (run.pid names it)
    (pidfile,) = wdir.glob(f"*-slow-rows/{RUN_PID_NAME}")
    orphan = json.loads(pidfile.read_text())
    print(f"   orphaned run after the kill: pid {orphan['pid']} alive {run_process(orphan) is not None}")
    r, _ = window("killed", "-e", "candidate=aa", "-e", f"window_spec={DRILL}")
    assert r.returncode == 0, r.stdout[-4000:]
    assert "stopped after" in flat(r.stdout) and "finishing it: production becomes" in flat(r.stdout)
    assert run_process(orphan) is None  # the restore stopped it first (dsv41 window stop-run)
    assert "Ansible worker that waited on it" in flat(r.stdout), r.stdout[-4000:]
    left = [i.pid for i in tree if i.alive()]
    for pid in left:  # ours (started by this test): ended so that a failure leaks nothing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed window.yml still alive after the next run: {left}"
    restored(wdir)


@pytest.mark.parametrize(
    "name,args,expect",
    [
        ("aa", ["-e", "candidate=aa"], {"NO-CHANGE", "UNRESOLVED"}),
        ("loss", ["-e", "candidate=slow-rows"], {"LOSS"}),
        ("win", ["-e", "candidate=aa", "-e", "control=slow-rows"], {"WIN"}),
    ],
)
def test_verdicts(name, args, expect):
    r, dt = window(name, *args, "-e", f"window_spec={LAB_SPEC}", timeout=3600)
    assert r.returncode == 0, r.stdout[-4000:]
    d = verdict(WDIR / name, args[1].split("=")[1])
    assert d["verdict"] in expect
    restored(WDIR / name)


def test_async_vs_sync_drafter():
    r, dt = window(
        "async",
        "-e",
        "candidate=async-drafter",
        "-e",
        "control=sync-drafter",
        "-e",
        f"window_spec={LAB_SPEC}",
        timeout=3600,
    )
    assert r.returncode == 0, r.stdout[-4000:]
    verdict(WDIR / "async", "async-drafter")
    restored(WDIR / "async")


def test_chain_one_hold_one_restore():
    """Chain mode: two candidates in one HOLD (the A/A and the delayed rows, each against
    production), one snapshot and one restore at the end, a decision per candidate."""
    r, dt = window("chain", "-e", "candidates=aa,slow-rows", "-e", f"window_spec={DRILL}")
    assert r.returncode == 0, r.stdout[-4000:]
    wdir = WDIR / "chain"
    assert len(list(wdir.glob("*/package"))) == 1
    for cand in ("aa", "slow-rows"):
        assert verdict(wdir, cand)["verdict"] in {"NO-CHANGE", "UNRESOLVED", "WIN", "LOSS"}
    restored(wdir)
