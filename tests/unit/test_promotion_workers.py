"""A SIGKILLed promote.yml / rollback.yml leaves its Ansible workers running; the next run ends them.

ansible-core's ``WorkerProcess`` calls ``setsid()``, so a SIGKILL of ``ansible-playbook``'s process
group misses the worker of each in-flight task (the lab: 2 outlived promote.yml killed at
``applied``, 1 rollback.yml killed at ``held``). ``dsv41.promotion.workers`` records the playbook
and each worker by identity (pid + kernel start ticks + boot id) and ends the orphans of a dead
playbook, never a process whose identity does not match (a reused pid, another boot), never the
workers of a playbook that still runs. The class enumerated here: the record written and cleared,
the record of a stale process (gone, pid reused with other start ticks, another boot), unreadable
records (empty, torn, undecodable, not an object, oversized, malformed identity), and that only
matched processes are signalled; then the callback plugin end to end with a real
``ansible-playbook`` killed mid-task.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv41.harness import orphans
from dsv41.harness.procident import ProcessIdentity
from dsv41.promotion import workers

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# A stand-in worker: starts a child (the module it runs) and waits; "1" makes it ignore SIGTERM.
WORKER = """
import signal, subprocess, sys, time
if sys.argv[1] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.fixture(autouse=True)
def _never_left_recording():
    """Whatever a test does, this pytest process stops recording its forks afterwards."""
    yield
    workers.stop()


def _worker(ignore_term: bool = False) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", WORKER, "1" if ignore_term else "0"], stdout=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline())


def _dead_playbook() -> ProcessIdentity:
    """The identity of a process that has ended (the SIGKILLed ansible-playbook)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    ident = ProcessIdentity.of(p.pid)
    p.kill()
    p.wait()
    return ident


def _record(root: Path, playbook: ProcessIdentity, *procs: dict, name: str = "promote.yml") -> Path:
    d = workers.run_dir(root, playbook)
    d.mkdir(parents=True)
    (d / workers.PLAYBOOK_NAME).write_text(json.dumps({"playbook": playbook.as_record(), "name": name}))
    for i, rec in enumerate(procs):
        (d / f"{workers.WORKER_PREFIX}{rec.get('pid', i)}.json").write_text(json.dumps(rec))
    return d


def _alive(pid: int) -> bool:
    try:
        return ProcessIdentity.of(pid).alive()
    except Exception:  # noqa: BLE001 - gone in any way
        return False


def _end(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.kill()
        p.wait()


# -- the record: written and cleared -------------------------------------------------------------


def _child_writes_nothing() -> None:
    os._exit(0)


def _child_forks_a_grandchild(q) -> None:
    p = multiprocessing.get_context("fork").Process(target=_child_writes_nothing)
    p.start()
    q.put(p.pid)
    p.join()


def test_the_playbook_and_each_fork_are_recorded_and_cleared_at_the_end(tmp_path):
    rec = workers.start(tmp_path, "promote.yml")
    d = workers.run_dir(tmp_path, ProcessIdentity.of())
    assert rec.dir == d
    assert json.loads((d / workers.PLAYBOOK_NAME).read_text()) == {
        "playbook": ProcessIdentity.of().as_record(),
        "name": "promote.yml",
    }
    ctx = multiprocessing.get_context("fork")  # ansible-core's context (ansible/utils/multiprocessing.py)
    q = ctx.Queue()
    p = ctx.Process(target=_child_forks_a_grandchild, args=(q,))
    p.start()
    grandchild = q.get(timeout=30)
    p.join(30)
    # the worker wrote its own record in the child, before anything else ran there
    assert json.loads((d / f"{workers.WORKER_PREFIX}{p.pid}.json").read_text())["pid"] == p.pid
    # a fork of the worker is not a worker of the playbook
    assert not (d / f"{workers.WORKER_PREFIX}{grandchild}.json").exists()
    assert rec.prune() == 1  # the worker returned: its record goes at the next task
    assert not list(d.glob(f"{workers.WORKER_PREFIX}*"))
    workers.stop()
    assert not d.exists()  # the playbook ended by itself: no record left
    p2 = ctx.Process(target=_child_writes_nothing)
    p2.start()
    p2.join(30)
    assert not d.exists()  # no longer recording


def test_an_unwritable_record_directory_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(workers.WorkersError) as e:
        workers.start(tmp_path / "file" / "sub", "rollback.yml")
    assert "cannot record the playbook's workers" in str(e.value) and "\n" not in str(e.value)


# -- the ender: only matched processes ----------------------------------------------------------


def test_the_orphaned_workers_of_a_dead_playbook_and_what_they_ran_are_ended(tmp_path):
    (w1, c1), (w2, c2) = _worker(), _worker()
    pb = _dead_playbook()
    try:
        d = _record(tmp_path, pb, ProcessIdentity.of(w1.pid).as_record(), ProcessIdentity.of(w2.pid).as_record())
        ended, problems = workers.end_leftovers(tmp_path)
        assert problems == [] and len(ended) == 1
        assert ended[0].playbook == pb.pid and ended[0].name == "promote.yml"
        assert sorted(ended[0].workers) == sorted([w1.pid, w2.pid]) and sorted(ended[0].descendants) == sorted([c1, c2])
        assert "ended 2 Ansible worker(s) of the SIGKILLed ansible-playbook" in ended[0].line()
        w1.wait(10), w2.wait(10)  # end_leftovers reaped them (psutil): the status is not kept
        assert not _alive(w1.pid) and not _alive(w2.pid) and not _alive(c1) and not _alive(c2) and not d.exists()
        assert workers.end_leftovers(tmp_path) == ([], [])  # nothing left: a no-op
    finally:
        _end(w1, w2)


def test_a_worker_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path):
    w, c = _worker(ignore_term=True)
    try:
        _record(tmp_path, _dead_playbook(), ProcessIdentity.of(w.pid).as_record())
        t0 = time.monotonic()
        ended, _ = workers.end_leftovers(tmp_path, timeout_s=1.0)
        assert ended[0].workers == [w.pid] and not _alive(w.pid)
        # it ignores SIGTERM: only the SIGKILL after the 1 s timeout ended it
        assert time.monotonic() - t0 >= 1.0 and not _alive(c)
    finally:
        _end(w)


def test_the_workers_of_a_live_playbook_are_never_signalled(tmp_path):
    w, c = _worker()
    try:
        d = _record(tmp_path, ProcessIdentity.of(), ProcessIdentity.of(w.pid).as_record())  # this process runs
        assert workers.end_leftovers(tmp_path) == ([], [])
        assert w.poll() is None and _alive(c) and d.exists()
    finally:
        _end(w)


@pytest.mark.parametrize("change", ["start_ticks", "boot_id"])
def test_a_pid_that_names_another_process_is_never_signalled(tmp_path, change):
    """The record's pid is alive but with other start ticks (the worker ended and the pid came
    back) or from another boot: nothing is signalled, the stale record goes."""
    victim, c = _worker()
    try:
        rec = ProcessIdentity.of(victim.pid).as_record()
        rec[change] = rec["start_ticks"] - 1 if change == "start_ticks" else "00000000-0000-0000-0000-000000000000"
        d = _record(tmp_path, _dead_playbook(), rec)
        assert workers.end_leftovers(tmp_path) == ([], [])
        assert victim.poll() is None and _alive(c) and not d.exists()
    finally:
        _end(victim)


def test_a_worker_that_ended_leaves_a_stale_record_that_is_removed(tmp_path):
    gone = _dead_playbook()  # any process that has ended
    d = _record(tmp_path, _dead_playbook(), gone.as_record())
    assert workers.end_leftovers(tmp_path) == ([], []) and not d.exists()


def test_a_playbook_of_an_earlier_boot_is_dead_and_its_live_pids_untouched(tmp_path):
    """After a reboot every recorded identity is stale: the playbook's boot id differs, so it is
    not alive, and a worker pid that names a process of this boot is not matched."""
    victim, c = _worker()
    try:
        me = ProcessIdentity.of(victim.pid)
        old = ProcessIdentity(os.getpid(), ProcessIdentity.of().start_ticks, "11111111-1111-1111-1111-111111111111")
        other = dict(me.as_record(), boot_id=old.boot_id)
        d = _record(tmp_path, old, other)
        assert workers.end_leftovers(tmp_path) == ([], []) and victim.poll() is None and not d.exists()
    finally:
        _end(victim)


BAD = [
    (b"not json", "not JSON"),
    (b"", "it is empty"),
    (b'{"pid": 12, "start_ti', "not JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[1, 2]", "a JSON list, not an object"),
    (b"x" * 5000, "larger than"),
    (b'{"pid": 5}', "KeyError"),
    (b'{"pid": "x", "start_ticks": 1, "boot_id": "b"}', "ValueError"),
    (b'{"pid": true, "start_ticks": 1, "boot_id": "b"}', "TypeError"),
]


@pytest.mark.parametrize("content,why", BAD)
def test_an_unreadable_worker_record_is_one_line_and_signals_nothing(tmp_path, content, why):
    victim, c = _worker()
    try:
        d = _record(tmp_path, _dead_playbook(), ProcessIdentity.of(victim.pid).as_record())
        # the only record naming the victim is made unreadable: it names no process any more
        (d / f"{workers.WORKER_PREFIX}{victim.pid}.json").write_bytes(content)
        ended, problems = workers.end_leftovers(tmp_path)
        assert ended == [] and len(problems) == 1 and why in problems[0] and "\n" not in problems[0]
        assert "not a worker record" in problems[0] and "no process signalled" in problems[0]
        assert victim.poll() is None and not d.exists()
    finally:
        _end(victim)


@pytest.mark.parametrize("content,why", BAD)
def test_an_unreadable_playbook_record_leaves_its_run_alone(tmp_path, content, why):
    """Whose workers they are is unknown (the playbook may run): nothing is signalled, the
    directory stays, one line says so (each run, until an operator looks)."""
    w, c = _worker()
    try:
        d = _record(tmp_path, _dead_playbook(), ProcessIdentity.of(w.pid).as_record())
        (d / workers.PLAYBOOK_NAME).write_bytes(content)
        ended, problems = workers.end_leftovers(tmp_path)
        assert ended == [] and len(problems) == 1 and "left alone" in problems[0] and "\n" not in problems[0]
        assert w.poll() is None and d.exists()
    finally:
        _end(w)


def test_no_record_directory_yet_is_nothing_to_do(tmp_path):
    assert workers.end_leftovers(tmp_path / "none") == ([], [])


def test_window_pid_shares_the_reader_and_the_orphan_rule():
    """One copy of each: window.yml's run.pid and these records (harness.orphans)."""
    from dsv41.harness import window_pid

    src = Path(window_pid.__file__).read_text()
    assert "orphans.read_record(" in src and "orphans.orphan(" in src and "orphans.end_processes(" in src
    assert window_pid.WORKER_TERM_TIMEOUT_S == orphans.WORKER_TERM_TIMEOUT_S


# -- the callback plugin, end to end ------------------------------------------------------------

PLAYBOOK = """- name: Stand-in
  hosts: localhost
  gather_facts: false
  tasks:
    - name: A long task
      ansible.builtin.command: sleep {{ s }}
      changed_when: false
"""


def _play(tmp_path: Path, name: str, *args: str) -> list[str]:
    """The command line of ``ansible-playbook`` on the stand-in ``PLAYBOOK`` saved as ``name``, on
    localhost, with the repository's ansible.cfg (which enables the callback)."""
    (tmp_path / name).write_text(PLAYBOOK)
    (tmp_path / "hosts.ini").write_text(
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
    )
    return [str(BIN / "ansible-playbook"), "-i", str(tmp_path / "hosts.ini"), str(tmp_path / name), *args]


def _play_env(records: Path) -> dict:
    return dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        DSV41_WORKERS_DIR=str(records),
        NO_COLOR="1",
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )


@pytest.mark.parametrize("name", ["promote.yml", "rollback.yml"])
def test_a_sigkilled_playbook_leaves_a_worker_that_the_next_run_ends(tmp_path, name):
    import psutil

    records = tmp_path / "records"
    cmd = _play(tmp_path, name)
    killed = subprocess.Popen(
        [*cmd, "-e", "s=300"],
        cwd=ROOT,
        env=_play_env(records),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        sleeper = None
        while sleeper is None and time.monotonic() < deadline:
            kids = psutil.Process(killed.pid).children(recursive=True)
            sleeper = next((k for k in kids if k.cmdline()[:2] == ["sleep", "300"]), None) if kids else None
            time.sleep(0.1)
        assert sleeper is not None, "the long task never started"
        tree = [ProcessIdentity.of(k.pid) for k in psutil.Process(killed.pid).children(recursive=True)]
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(30)
    left = [i for i in tree if i.alive()]
    assert left, "nothing outlived the SIGKILL: the defect this guards against did not show"
    try:
        r = subprocess.run(
            [*cmd, "-e", "s=0"], cwd=ROOT, env=_play_env(records), capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"of the SIGKILLed ansible-playbook {killed.pid} ({name}) still running" in r.stdout
        assert [i.pid for i in left if i.alive()] == []  # nothing of the killed run outlived the re-run
        assert not list(records.iterdir())  # the re-run ended by itself: no record left
    finally:
        for i in left:
            if i.alive():
                os.kill(i.pid, signal.SIGKILL)


def test_other_playbooks_are_not_recorded(tmp_path):
    records = tmp_path / "records"
    r = subprocess.run(
        _play(tmp_path, "deploy.yml", "-e", "s=0"),
        cwd=ROOT,
        env=_play_env(records),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and not records.exists() and "dsv41_workers" not in r.stdout + r.stderr
