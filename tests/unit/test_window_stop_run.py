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

from dsv41.harness import bench, procident, window, window_pid
from dsv41.harness.procident import ProcessGone, ProcessIdentity

SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "candidates", "specs", "drill.json")

# A stand-in run: records itself like `dsv41 window run`, starts a child (like an arm switch's
# ansible-playbook) and waits; IGNORE_TERM makes it ignore SIGTERM.
RUN = """
import signal, subprocess, sys, time
from dsv41.harness import window_pid
if sys.argv[2] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
window_pid.write_run_pid(sys.argv[1])
print(child.pid, flush=True)
time.sleep(300)
"""


def _start_run(wdir, ignore_term=False):
    wdir.mkdir(parents=True)
    p = subprocess.Popen(
        [sys.executable, "-c", RUN, str(wdir), "1" if ignore_term else "0"], stdout=subprocess.PIPE, text=True
    )
    child = int(p.stdout.readline())
    deadline = time.monotonic() + 30
    while not (wdir / window_pid.RUN_PID_NAME).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return p, child


def _gone(pid):
    try:
        return window_pid.run_process(ProcessIdentity.of(pid).as_record()) is None
    except ProcessGone:
        return True


def test_stop_runs_terminates_the_run_and_its_children(tmp_path):
    p, child = _start_run(tmp_path / "W1-slow-rows")
    try:
        assert window_pid.stop_runs(tmp_path, "W1") == [p.pid]
        p.wait(10)
        assert _gone(p.pid) and _gone(child)
        assert not (tmp_path / "W1-slow-rows" / window_pid.RUN_PID_NAME).exists()
        assert window_pid.stop_runs(tmp_path, "W1") == []  # nothing left: a no-op
    finally:
        p.kill()


def test_a_run_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path):
    p, child = _start_run(tmp_path / "W2-aa", ignore_term=True)
    try:
        t0 = time.monotonic()
        assert window_pid.stop_runs(tmp_path, "W2", timeout_s=1.0) == [p.pid]
        # it ignores SIGTERM: only the SIGKILL after the 1 s timeout ends it (stop_runs reaps it)
        p.wait(10)
        assert time.monotonic() - t0 >= 1.0 and _gone(p.pid) and _gone(child)
    finally:
        p.kill()


def test_only_the_named_window_is_stopped(tmp_path):
    p, _ = _start_run(tmp_path / "W3-aa")
    try:
        assert window_pid.stop_runs(tmp_path, "W4") == []
        assert p.poll() is None and (tmp_path / "W3-aa" / window_pid.RUN_PID_NAME).exists()
    finally:
        window_pid.stop_runs(tmp_path, "W3")
        p.kill()


def test_a_reused_pid_is_never_signalled(tmp_path):
    """run.pid names this test's own pid with another creation time (the run died, the pid came back)."""
    d = tmp_path / "W5-aa"
    d.mkdir()
    (d / window_pid.RUN_PID_NAME).write_text(json.dumps({"pid": os.getpid(), "create_time": 1.0}))
    assert window_pid.stop_runs(tmp_path, "W5") == []
    assert not (d / window_pid.RUN_PID_NAME).exists()


def test_a_dead_run_leaves_a_stale_file_that_is_removed(tmp_path):
    d = tmp_path / "W6-aa"
    d.mkdir()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(p.pid).create_time()
    p.wait()
    (d / window_pid.RUN_PID_NAME).write_text(json.dumps({"pid": p.pid, "create_time": created}))
    assert window_pid.stop_runs(tmp_path, "W6") == []
    assert not (d / window_pid.RUN_PID_NAME).exists()


@pytest.mark.parametrize(
    "content,why",
    [
        (b"not json", "not JSON"),
        (b"", "it is empty"),
        (b'{"pid": 12, "start_ti', "not JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2]", "a JSON list, not an object"),
        (b"x" * 5000, "larger than"),
    ],
)
def test_an_unreadable_pid_file_is_one_clear_error(tmp_path, capsys, content, why):
    """Empty (killed while writing, before fileio.atomic_write), torn, undecodable, not an object,
    too long: one line from the strict reader, the file kept."""
    from dsv41.cli import main

    d = tmp_path / "W7-aa"
    d.mkdir()
    (d / window_pid.RUN_PID_NAME).write_bytes(content)
    with pytest.raises(window.WindowError, match="not a run pid file") as e:
        window_pid.stop_runs(tmp_path, "W7")
    assert why in str(e.value) and "\n" not in str(e.value)
    window_pid.clear_run_pid(d)  # a run's own exit path ignores it
    rc = main(["window", "stop-run", "--window", "W7", "--windows-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "not a run pid file" in err[0] and "Traceback" not in err[0]
    assert (d / window_pid.RUN_PID_NAME).exists()  # kept: the restore stops with admission held


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
    (tmp_path / window_pid.RUN_PID_NAME).write_text(json.dumps({"pid": os.getpid() + 1, "create_time": 1.0}))
    window_pid.clear_run_pid(tmp_path)
    assert (tmp_path / window_pid.RUN_PID_NAME).exists()
    window_pid.write_run_pid(tmp_path)
    window_pid.clear_run_pid(tmp_path)
    assert not (tmp_path / window_pid.RUN_PID_NAME).exists()


def test_window_run_names_itself_while_it_runs_and_clears_at_the_end(tmp_path, monkeypatch):
    from dsv41.cli import main

    seen = []

    def stream(client, url, body, prompt_id, category):
        seen.append(json.loads((tmp_path / "w-pid" / window_pid.RUN_PID_NAME).read_text())["pid"])
        return bench.RequestResult(
            prompt_id,
            category,
            body.get("seed", 0),
            8,
            ok=True,
            ttft_ms=50.0,
            step_ms_p50=20.0,
            tok_s=50.0,
            tokens_per_step=1.0,
            steps=8,
            step_ms=[20.0] * 7,
            finish_reason="length",
            completion_tokens=8,
        )

    monkeypatch.setattr(bench, "stream_one", stream)
    monkeypatch.setattr(bench, "snapshot_metrics", lambda urls, timeout_s=10.0: {u: {} for u in urls})
    monkeypatch.setattr(bench, "served_model", lambda url, **kw: "dsv41-lab")
    monkeypatch.setattr(bench, "smoke", lambda *a, **kw: {"canary": {"ok": True}, "greedy": {"ok": True}})
    rc = main(
        [
            "window",
            "run",
            "--control",
            "http://x",
            "--candidate",
            "http://x",
            "--spec",
            SPEC,
            "--name",
            "aa",
            "--seed",
            "3",
            "--windows-dir",
            str(tmp_path),
            "--id",
            "w-pid",
            "--no-metrics",
        ]
    )
    assert rc == 0 and seen and set(seen) == {os.getpid()}
    assert not (tmp_path / "w-pid" / window_pid.RUN_PID_NAME).exists()


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
        rec = json.loads((tmp_path / "W9-aa" / window_pid.RUN_PID_NAME).read_text())
        assert rec["pid"] == p.pid and rec["start_ticks"] == procident.start_ticks(p.pid)
        real = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + step_s)
        monkeypatch.setattr(psutil, "boot_time", lambda: psutil._psplatform.boot_time() + step_s)
        # the old rule (pid + create_time within 0.01 s) would skip it: the test has teeth
        legacy = {"pid": rec["pid"], "create_time": rec["create_time"]}
        assert window_pid.run_process(legacy) is None
        assert window_pid.run_process(rec) is not None
        assert window_pid.stop_runs(tmp_path, "W9") == [p.pid]
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
        for i, rec in enumerate(
            [
                dict(me.as_record(), start_ticks=me.start_ticks - 1),
                dict(me.as_record(), start_ticks=me.start_ticks + 100),
                dict(me.as_record(), boot_id="00000000-0000-0000-0000-000000000000"),
            ]
        ):
            d = tmp_path / f"W10-{i}"
            d.mkdir()
            (d / window_pid.RUN_PID_NAME).write_text(
                json.dumps(dict(rec, create_time=real(psutil.Process(victim.pid))))
            )
            assert window_pid.run_process(rec) is None
        assert window_pid.stop_runs(tmp_path, "W10") == []
        assert victim.poll() is None  # still alive: nothing was signalled
        assert not list(tmp_path.glob("W10-*/" + window_pid.RUN_PID_NAME))  # stale records removed
    finally:
        victim.kill()
        victim.wait()


def test_a_legacy_record_of_a_live_run_is_still_read(tmp_path):
    """run.pid of an older dsv41 window run (pid + create_time only) is matched by the old rule."""
    victim = _sleeper()
    try:
        d = tmp_path / "W11-aa"
        d.mkdir()
        (d / window_pid.RUN_PID_NAME).write_text(
            json.dumps({"pid": victim.pid, "create_time": psutil.Process(victim.pid).create_time()})
        )
        assert window_pid.stop_runs(tmp_path, "W11", timeout_s=5) == [victim.pid]
        victim.wait(10)  # psutil reaped it already (we are its parent): returncode 0 or -15
        assert _gone(victim.pid)
    finally:
        victim.kill()


@pytest.mark.parametrize(
    "rec",
    [
        {"pid": 5, "start_ticks": "x", "boot_id": "b"},
        {"pid": 5, "start_ticks": 1},
        {"pid": True, "start_ticks": 1, "boot_id": "b"},
        {"pid": -1, "start_ticks": 1, "boot_id": "b"},
        {"pid": 5, "start_ticks": 1, "boot_id": 7},
    ],
)
def test_a_malformed_identity_record_is_one_clear_error(tmp_path, rec):
    d = tmp_path / "W12-aa"
    d.mkdir()
    (d / window_pid.RUN_PID_NAME).write_text(json.dumps(rec))
    with pytest.raises(window.WindowError, match="not a run pid file"):
        window_pid.stop_runs(tmp_path, "W12")
    assert (d / window_pid.RUN_PID_NAME).exists()


def test_a_fifo_as_pid_file_is_refused_without_blocking_and_a_vanished_one_skipped(tmp_path):
    d = tmp_path / "W13-aa"
    d.mkdir()
    os.mkfifo(d / window_pid.RUN_PID_NAME)
    with pytest.raises(window.WindowError, match="not a run pid file .*is a FIFO"):
        window_pid.stop_runs(tmp_path, "W13")
    os.unlink(d / window_pid.RUN_PID_NAME)
    assert window_pid.read_run_pid(d / window_pid.RUN_PID_NAME) is None  # the run ended and removed it


# ------------------------------------------- a SIGKILLed window.yml's Ansible worker (issue 22)
# ansible-core's WorkerProcess calls setsid(), so killpg of ansible-playbook's group misses the
# worker running the `dsv41 window run` task; found on the lab (2026-12-04): such a worker was
# still alive 30 min after the killed-run drill. The stand-in below is a script named
# ansible-playbook that forks a worker the way ansible does (fork, setsid), which runs the run.

PLAYBOOK = """
import os, signal, subprocess, sys, time
wdir, mode = sys.argv[1], sys.argv[2]
pid = os.fork()
if pid == 0:
    os.setsid()  # ansible/executor/process/worker.py WorkerProcess._detach
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run = subprocess.Popen([sys.executable, "-c", RUN_STANDIN, wdir, mode])
    run.wait()
    time.sleep(300)  # a worker handing its result to a dead parent blocks for ever
    os._exit(0)
print(pid, flush=True)
time.sleep(300)
"""

RUN_STANDIN = """
import os, sys, time
from dsv41.harness import window_pid
window_pid.write_run_pid(sys.argv[1])
if sys.argv[2] == "ends":  # the run finishes on its own once the test says so
    while not os.path.exists(os.path.join(sys.argv[1], "go")):
        time.sleep(0.05)
    window_pid.clear_run_pid(sys.argv[1])
    sys.exit(0)
time.sleep(300)
"""


def _start_playbook(tmp_path, wdir, mode="plain"):
    """(playbook Popen, worker pid, run.pid record) of the stand-in playbook running a window run."""
    script = tmp_path / "bin" / "ansible-playbook"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"RUN_STANDIN = {RUN_STANDIN!r}\n" + PLAYBOOK)
    wdir.mkdir(parents=True)
    p = subprocess.Popen([sys.executable, str(script), str(wdir), mode], stdout=subprocess.PIPE, text=True)
    worker = int(p.stdout.readline())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rec = (
            window_pid.read_run_pid(wdir / window_pid.RUN_PID_NAME)
            if (wdir / window_pid.RUN_PID_NAME).exists()
            else None
        )
        if rec:
            return p, worker, rec
        time.sleep(0.05)
    raise AssertionError("the stand-in run wrote no run.pid")


def _cleanup(p, *pids):
    p.kill()
    p.wait()
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _wait_gone(pid, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not procident.is_zombie(pid):
        time.sleep(0.05)
    return procident.is_zombie(pid)


def test_the_run_records_its_ansible_worker_and_the_playbook(tmp_path):
    p, worker, rec = _start_playbook(tmp_path, tmp_path / "W20-aa")
    try:
        assert rec["session"]["leader"] == ProcessIdentity.of(worker).as_record()
        assert rec["session"]["parent"] == ProcessIdentity.of(p.pid).as_record()
    finally:
        _cleanup(p, worker, rec["pid"])


def test_a_run_started_outside_ansible_records_no_session(tmp_path):
    p, _ = _start_run(tmp_path / "W21-aa")  # its session leader is this test's, not ansible-playbook
    try:
        assert "session" not in window_pid.read_run_pid(tmp_path / "W21-aa" / window_pid.RUN_PID_NAME)
    finally:
        window_pid.stop_runs(tmp_path, "W21")
        p.kill()


def test_the_orphaned_worker_of_a_killed_playbook_is_stopped_after_its_run(tmp_path, capsys):
    from dsv41.cli import main

    p, worker, rec = _start_playbook(tmp_path, tmp_path / "W22-aa")
    try:
        p.kill()  # SIGKILL: ansible-playbook cannot pass it on; the worker (own session) lives on
        p.wait()
        assert not _gone(worker)
        assert main(["window", "stop-run", "--window", "W22", "--windows-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out.strip()
        assert out == (
            f"stopped {rec['pid']} (the killed run of window W22), and {worker} "
            "(the killed window.yml's Ansible worker that waited on it)"
        )
        assert _wait_gone(worker) and _gone(rec["pid"])
        assert not (tmp_path / "W22-aa" / window_pid.RUN_PID_NAME).exists()
    finally:
        _cleanup(p, worker, rec["pid"])


def test_the_worker_of_a_live_playbook_is_never_signalled(tmp_path):
    """restore_only while the playbook that started the run still runs: the run is stopped (it
    would switch arms during the restore), its worker, whose playbook waits for it, is not."""
    p, worker, rec = _start_playbook(tmp_path, tmp_path / "W23-aa")
    try:
        got = window_pid.stop_runs(tmp_path, "W23")
        assert got == [rec["pid"]] and got.workers == []
        assert not _gone(worker) and p.poll() is None
    finally:
        _cleanup(p, worker, rec["pid"])


def test_an_orphaned_worker_that_ignores_sigterm_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(window_pid, "WORKER_TERM_TIMEOUT_S", 1.0)
    p, worker, rec = _start_playbook(tmp_path, tmp_path / "W24-aa", mode="ignore_term")
    try:
        p.kill()
        p.wait()
        t0 = time.monotonic()
        got = window_pid.stop_runs(tmp_path, "W24", timeout_s=5.0)
        assert got == [rec["pid"]] and got.workers == [worker]
        assert time.monotonic() - t0 >= 1.0 and _wait_gone(worker)
    finally:
        _cleanup(p, worker, rec["pid"])


def test_a_run_that_ended_leaves_its_orphaned_worker_to_the_next_stop_run(tmp_path):
    """The playbook was killed, then the run finished its cells and exited: it keeps run.pid
    (clear_run_pid) because its worker is orphaned, and the next stop-run ends that worker."""
    wdir = tmp_path / "W25-aa"
    p, worker, rec = _start_playbook(tmp_path, wdir, mode="ends")
    try:
        p.kill()
        p.wait()
        (wdir / "go").touch()
        assert _wait_gone(rec["pid"]) or _gone(rec["pid"])
        assert (wdir / window_pid.RUN_PID_NAME).exists()
        got = window_pid.stop_runs(tmp_path, "W25")
        assert got == [] and got.workers == [worker] and _wait_gone(worker)
        assert not (wdir / window_pid.RUN_PID_NAME).exists()
    finally:
        _cleanup(p, worker, rec["pid"])


def test_a_run_that_ended_under_a_live_playbook_removes_its_record(tmp_path):
    wdir = tmp_path / "W26-aa"
    p, worker, rec = _start_playbook(tmp_path, wdir, mode="ends")
    try:
        (wdir / "go").touch()
        deadline = time.monotonic() + 10
        while (wdir / window_pid.RUN_PID_NAME).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (wdir / window_pid.RUN_PID_NAME).exists()
    finally:
        _cleanup(p, worker, rec["pid"])


def test_a_reused_worker_pid_is_never_signalled(tmp_path):
    """The session names a live process by its pid but another start time (the worker ended and
    the pid came back), with its playbook gone: nothing is signalled."""
    victim = _sleeper()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_rec = ProcessIdentity.of(dead.pid).as_record()
    dead.wait()
    try:
        me = ProcessIdentity.of(victim.pid)
        d = tmp_path / "W27-aa"
        d.mkdir()
        session = {"leader": dict(me.as_record(), start_ticks=me.start_ticks - 1), "parent": dead_rec}
        (d / window_pid.RUN_PID_NAME).write_text(json.dumps(dict(dead_rec, session=session)))
        got = window_pid.stop_runs(tmp_path, "W27")
        assert got == [] and got.workers == [] and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize(
    "session",
    [
        [1, 2],
        "x",
        {"leader": {"pid": 5, "start_ticks": 1, "boot_id": "b"}},
        {"leader": {"pid": 5}, "parent": {"pid": 6, "start_ticks": 1, "boot_id": "b"}},
        {
            "leader": {"pid": 5, "start_ticks": 1, "boot_id": "b"},
            "parent": {"pid": "x", "start_ticks": 1, "boot_id": "b"},
        },
    ],
)
def test_a_malformed_session_is_one_clear_error_and_nothing_is_signalled(tmp_path, session):
    victim = _sleeper()
    try:
        d = tmp_path / "W28-aa"
        d.mkdir()
        rec = dict(ProcessIdentity.of(victim.pid).as_record(), session=session)
        (d / window_pid.RUN_PID_NAME).write_text(json.dumps(rec))
        with pytest.raises(window.WindowError, match="not a run pid file"):
            window_pid.stop_runs(tmp_path, "W28")
        assert victim.poll() is None and (d / window_pid.RUN_PID_NAME).exists()
    finally:
        victim.kill()
        victim.wait()
