"""A killed window.yml leaves its ``dsv41 window run`` running; the next run's restore stops it.

Found on the lab (2026-12-01, ``make window-drills`` killed run): after SIGKILL to
ansible-playbook's process group, the window's run was still alive (it is not in that group), ran
its next arm switch while the following window.yml restored production, and wrote a failed cell
17 s after the kill. ``run.pid`` (pid + kernel start ticks + boot id) names the run; ``dsv41 window stop-run``
(the restore's first step) stops it and whatever it started, and never signals another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from dsv41.harness import bench, procident, window
from dsv41.harness.procident import ProcessGone, ProcessIdentity

SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "candidates", "specs", "drill.json")

# A stand-in run: records itself like `dsv41 window run`, starts a child (like an arm switch's
# ansible-playbook) and waits; IGNORE_TERM makes it ignore SIGTERM.
RUN = """
import signal, subprocess, sys, time
from dsv41.harness import window
if sys.argv[2] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
window.write_run_pid(sys.argv[1])
print(child.pid, flush=True)
time.sleep(300)
"""


def _start_run(wdir, ignore_term=False):
    wdir.mkdir(parents=True)
    p = subprocess.Popen([sys.executable, "-c", RUN, str(wdir), "1" if ignore_term else "0"],
                         stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    deadline = time.monotonic() + 30
    while not (wdir / window.RUN_PID_NAME).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return p, child


def _gone(pid):
    try:
        return window.run_process(ProcessIdentity.of(pid).as_record()) is None
    except ProcessGone:
        return True


def test_stop_runs_terminates_the_run_and_its_children(tmp_path):
    p, child = _start_run(tmp_path / "W1-slow-rows")
    try:
        assert window.stop_runs(tmp_path, "W1") == [p.pid]
        p.wait(10)
        assert _gone(p.pid) and _gone(child)
        assert not (tmp_path / "W1-slow-rows" / window.RUN_PID_NAME).exists()
        assert window.stop_runs(tmp_path, "W1") == []  # nothing left: a no-op
    finally:
        p.kill()


def test_a_run_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path):
    p, child = _start_run(tmp_path / "W2-aa", ignore_term=True)
    try:
        t0 = time.monotonic()
        assert window.stop_runs(tmp_path, "W2", timeout_s=1.0) == [p.pid]
        # it ignores SIGTERM: only the SIGKILL after the 1 s timeout ends it (stop_runs reaps it)
        p.wait(10)
        assert time.monotonic() - t0 >= 1.0 and _gone(p.pid) and _gone(child)
    finally:
        p.kill()


def test_only_the_named_window_is_stopped(tmp_path):
    p, _ = _start_run(tmp_path / "W3-aa")
    try:
        assert window.stop_runs(tmp_path, "W4") == []
        assert p.poll() is None and (tmp_path / "W3-aa" / window.RUN_PID_NAME).exists()
    finally:
        window.stop_runs(tmp_path, "W3")
        p.kill()


def test_a_reused_pid_is_never_signalled(tmp_path):
    """run.pid names this test's own pid with another creation time (the run died, the pid came back)."""
    d = tmp_path / "W5-aa"
    d.mkdir()
    (d / window.RUN_PID_NAME).write_text(json.dumps({"pid": os.getpid(), "create_time": 1.0}))
    assert window.stop_runs(tmp_path, "W5") == []
    assert not (d / window.RUN_PID_NAME).exists()


def test_a_dead_run_leaves_a_stale_file_that_is_removed(tmp_path):
    d = tmp_path / "W6-aa"
    d.mkdir()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(p.pid).create_time()
    p.wait()
    (d / window.RUN_PID_NAME).write_text(json.dumps({"pid": p.pid, "create_time": created}))
    assert window.stop_runs(tmp_path, "W6") == []
    assert not (d / window.RUN_PID_NAME).exists()


@pytest.mark.parametrize("content,why", [(b"not json", "not JSON"), (b"", "it is empty"),
                                         (b'{"pid": 12, "start_ti', "not JSON"), (b"\xff\xfe{}", "not UTF-8"),
                                         (b"[1, 2]", "a JSON list, not an object"), (b"x" * 5000, "larger than")])
def test_an_unreadable_pid_file_is_one_clear_error(tmp_path, capsys, content, why):
    """Empty (killed while writing, before fileio.atomic_write), torn, undecodable, not an object,
    too long: one line from the strict reader, the file kept."""
    from dsv41.cli import main

    d = tmp_path / "W7-aa"
    d.mkdir()
    (d / window.RUN_PID_NAME).write_bytes(content)
    with pytest.raises(window.WindowError, match="not a run pid file") as e:
        window.stop_runs(tmp_path, "W7")
    assert why in str(e.value) and "\n" not in str(e.value)
    window.clear_run_pid(d)  # a run's own exit path ignores it
    rc = main(["window", "stop-run", "--window", "W7", "--windows-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "not a run pid file" in err[0] and "Traceback" not in err[0]
    assert (d / window.RUN_PID_NAME).exists()  # kept: the restore stops with admission held


def test_cli_stop_run_says_what_it_did(tmp_path, capsys):
    from dsv41.cli import main

    assert main(["window", "stop-run", "--window", "W8", "--windows-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "no run left of window W8"
    p, _ = _start_run(tmp_path / "W8-aa")
    try:
        assert main(["window", "stop-run", "--window", "W8", "--windows-dir", str(tmp_path)]) == 0
        assert capsys.readouterr().out.strip() == f"stopped {p.pid} (the killed run of window W8)"
    finally:
        p.kill()


def test_clear_run_pid_removes_only_its_own_file(tmp_path):
    (tmp_path / window.RUN_PID_NAME).write_text(json.dumps({"pid": os.getpid() + 1, "create_time": 1.0}))
    window.clear_run_pid(tmp_path)
    assert (tmp_path / window.RUN_PID_NAME).exists()
    window.write_run_pid(tmp_path)
    window.clear_run_pid(tmp_path)
    assert not (tmp_path / window.RUN_PID_NAME).exists()


def test_window_run_names_itself_while_it_runs_and_clears_at_the_end(tmp_path, monkeypatch):
    from dsv41.cli import main

    seen = []

    def stream(client, url, body, prompt_id, category):
        seen.append(json.loads((tmp_path / "w-pid" / window.RUN_PID_NAME).read_text())["pid"])
        return bench.RequestResult(prompt_id, category, body.get("seed", 0), 8, ok=True, ttft_ms=50.0,
                                   step_ms_p50=20.0, tok_s=50.0, tokens_per_step=1.0, steps=8, step_ms=[20.0] * 7,
                                   finish_reason="length", completion_tokens=8)

    monkeypatch.setattr(bench, "stream_one", stream)
    monkeypatch.setattr(bench, "snapshot_metrics", lambda urls, timeout_s=10.0: {u: {} for u in urls})
    monkeypatch.setattr(bench, "served_model", lambda url, **kw: "dsv41-lab")
    monkeypatch.setattr(bench, "smoke", lambda *a, **kw: {"canary": {"ok": True}, "greedy": {"ok": True}})
    rc = main(["window", "run", "--control", "http://x", "--candidate", "http://x", "--spec", SPEC,
               "--name", "aa", "--seed", "3", "--windows-dir", str(tmp_path), "--id", "w-pid", "--no-metrics"])
    assert rc == 0 and seen and set(seen) == {os.getpid()}
    assert not (tmp_path / "w-pid" / window.RUN_PID_NAME).exists()


# ---------------------------------------------------------------- issue 25 item 8: clock steps


def _sleeper(comm=None):
    code = "import sys, time\n"
    if comm:
        code += f"open('/proc/self/comm', 'w').write({comm!r})\n"
    code += "print('up', flush=True); time.sleep(300)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


@pytest.mark.parametrize("comm", ["plain", "a b", "x) (y", ")) S 1 2 (", "("])
def test_start_ticks_parse_a_comm_with_spaces_and_parentheses(comm):
    """Field 22 after the last ')' equals psutil's own monotonic start (ticks / CLK_TCK)."""
    p = _sleeper(comm)
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            assert f.read().startswith(f"{p.pid} ({comm[:15]})")
        ticks = procident.start_ticks(p.pid)
        hz = os.sysconf("SC_CLK_TCK")
        assert round(psutil.Process(p.pid)._proc.create_time(monotonic=True) * hz) == ticks
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("line", ["", "123", "123 (x", "123 (x) S 1 2", "123 x) S" + " 0" * 30])
def test_malformed_stat_lines_are_refused(line):
    with pytest.raises(ValueError):
        procident.parse_start_ticks(line)


@pytest.mark.parametrize("step_s", [1.0, -1.0, 3600.0])
def test_a_clock_step_still_matches_the_live_orphan(tmp_path, monkeypatch, step_s):
    """run.pid was written before the clock stepped; psutil's wall-clock creation time of the
    same process now differs by ``step_s``, yet stop-run still finds and stops the orphan."""
    p, child = _start_run(tmp_path / "W9-aa")
    try:
        rec = json.loads((tmp_path / "W9-aa" / window.RUN_PID_NAME).read_text())
        assert rec["pid"] == p.pid and rec["start_ticks"] == procident.start_ticks(p.pid)
        real = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + step_s)
        monkeypatch.setattr(psutil, "boot_time", lambda: psutil._psplatform.boot_time() + step_s)
        # the old rule (pid + create_time within 0.01 s) would skip it: the test has teeth
        legacy = {"pid": rec["pid"], "create_time": rec["create_time"]}
        assert window.run_process(legacy) is None
        assert window.run_process(rec) is not None
        assert window.stop_runs(tmp_path, "W9") == [p.pid]
        p.wait(10)
        assert _gone(child)
    finally:
        p.kill()


def test_a_reused_pid_is_never_signalled_whatever_the_clock(tmp_path, monkeypatch):
    """The pid is live but started at another tick, or in another boot: never signalled, even
    with wall-clock creation times that would match."""
    victim = _sleeper()
    try:
        me = ProcessIdentity.of(victim.pid)
        real = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 1.0)
        for i, rec in enumerate([dict(me.as_record(), start_ticks=me.start_ticks - 1),
                                 dict(me.as_record(), start_ticks=me.start_ticks + 100),
                                 dict(me.as_record(), boot_id="00000000-0000-0000-0000-000000000000")]):
            d = tmp_path / f"W10-{i}"
            d.mkdir()
            (d / window.RUN_PID_NAME).write_text(json.dumps(dict(rec, create_time=real(psutil.Process(victim.pid)))))
            assert window.run_process(rec) is None
        assert window.stop_runs(tmp_path, "W10") == []
        assert victim.poll() is None  # still alive: nothing was signalled
        assert not list(tmp_path.glob("W10-*/" + window.RUN_PID_NAME))  # stale records removed
    finally:
        victim.kill()
        victim.wait()


def test_a_legacy_record_of_a_live_run_is_still_read(tmp_path):
    """run.pid of an older dsv41 window run (pid + create_time only) is matched by the old rule."""
    victim = _sleeper()
    try:
        d = tmp_path / "W11-aa"
        d.mkdir()
        (d / window.RUN_PID_NAME).write_text(json.dumps({"pid": victim.pid,
                                                         "create_time": psutil.Process(victim.pid).create_time()}))
        assert window.stop_runs(tmp_path, "W11", timeout_s=5) == [victim.pid]
        victim.wait(10)  # psutil reaped it already (we are its parent): returncode 0 or -15
        assert _gone(victim.pid)
    finally:
        victim.kill()


@pytest.mark.parametrize("rec", [{"pid": 5, "start_ticks": "x", "boot_id": "b"}, {"pid": 5, "start_ticks": 1},
                                 {"pid": True, "start_ticks": 1, "boot_id": "b"},
                                 {"pid": -1, "start_ticks": 1, "boot_id": "b"},
                                 {"pid": 5, "start_ticks": 1, "boot_id": 7}])
def test_a_malformed_identity_record_is_one_clear_error(tmp_path, rec):
    d = tmp_path / "W12-aa"
    d.mkdir()
    (d / window.RUN_PID_NAME).write_text(json.dumps(rec))
    with pytest.raises(window.WindowError, match="not a run pid file"):
        window.stop_runs(tmp_path, "W12")
    assert (d / window.RUN_PID_NAME).exists()


def test_a_fifo_as_pid_file_is_refused_without_blocking_and_a_vanished_one_skipped(tmp_path):
    d = tmp_path / "W13-aa"
    d.mkdir()
    os.mkfifo(d / window.RUN_PID_NAME)
    with pytest.raises(window.WindowError, match="not a run pid file .*is a FIFO"):
        window.stop_runs(tmp_path, "W13")
    os.unlink(d / window.RUN_PID_NAME)
    assert window.read_run_pid(d / window.RUN_PID_NAME) is None  # the run ended and removed it
