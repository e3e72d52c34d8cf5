"""The async proxy's memory locking: locked where the limit allows it, the exact refusal where it
does not (errno and RLIMIT_MEMLOCK), published in the ring, exported by the speculator, and the
self-test's report and exit status. Each lock runs in a child process: locking pytest itself
(MCL_FUTURE) would pin everything the test run maps afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dsv41.drafter.memlock import MemlockState
from dsv41.drafter.shm import Ring

# A child that lowers RLIMIT_MEMLOCK to 0 and drops CAP_IPC_LOCK (capability 14, which bypasses
# the limit; a root test run has it) from its effective and permitted sets (capset(2), version 3)
# before the code under test runs.
_REFUSE = textwrap.dedent(
    """
    import ctypes, resource
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    class _H(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class _D(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    _libc = ctypes.CDLL(None, use_errno=True)
    _h, _d = _H(0x20080522, 0), (_D * 2)()
    assert _libc.capget(ctypes.byref(_h), _d) == 0
    _d[0].effective &= ~(1 << 14)
    _d[0].permitted &= ~(1 << 14)
    assert _libc.capset(ctypes.byref(_h), _d) == 0, ctypes.get_errno()
    """
)


def _child(prelude: str, body: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd="/",
    )


def _can_lock() -> bool:
    r = _child("", "from dsv41.drafter.memlock import lock_all; print(lock_all().state.name)")
    return r.stdout.strip() == "LOCKED"


def test_refused_lock_names_errno_and_limits():
    r = _child(
        _REFUSE, "import json; from dsv41.drafter.memlock import lock_all; print(json.dumps(lock_all().as_dict()))"
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["state"] == "refused" and rep["limit_soft"] == 0 and rep["limit_hard"] == 0
    assert rep["detail"].startswith("mlockall(MCL_CURRENT|MCL_FUTURE) failed: E"), rep
    assert "RLIMIT_MEMLOCK soft 0 B, hard 0 B" in rep["detail"]


def test_lock_where_the_limit_allows_it():
    if not _can_lock():
        pytest.skip("this test process may not lock its memory here (no CAP_IPC_LOCK, RLIMIT_MEMLOCK too low)")
    r = _child("", "import json; from dsv41.drafter.memlock import lock_all; print(json.dumps(lock_all().as_dict()))")
    rep = json.loads(r.stdout)
    assert rep["state"] == "locked" and rep["detail"] == "" and rep["locked_kib"] > 0, rep


def test_self_test_reports_refusal_and_require_memlock_exits_1():
    main = "import sys; from dsv41.drafter.proxy_cli import main; sys.exit(main(sys.argv[1:]))"
    r = _child(_REFUSE, main, "self-test", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["ring"] == "ok" and rep["torch_loaded"] is False
    assert rep["mlock"].startswith("mlockall(MCL_CURRENT|MCL_FUTURE) failed: E"), rep
    assert rep["mlock_report"]["state"] == "refused"
    r = _child(_REFUSE, main, "self-test", "--require-memlock")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("dsv41: error: proxy self-test: memory locking refused: mlockall(")
    r = _child(_REFUSE, main, "self-test", "--no-memlock", "--json")
    assert r.returncode == 0 and "mlock" not in json.loads(r.stdout)


def test_the_proxy_publishes_its_lock_result_in_the_ring():
    """The proxy process (CLI ``run``) writes MemlockState into the ring's host flags at start:
    REFUSED under a zero limit, OFF with --no-memlock; it then serves (stopped via the flag)."""
    for flag, want in (("--memlock", MemlockState.REFUSED), ("--no-memlock", MemlockState.OFF)):
        ring = Ring.create(2, 4096)
        try:
            ring.stop = True  # serve nothing: report, see the stop flag, exit
            body = (
                "import sys; from dsv41.drafter.proxy_cli import main; "
                "sys.exit(main(['run', '--shm', sys.argv[1], '--remote', 'tcp://127.0.0.1:1', sys.argv[2]]))"
            )
            r = _child(_REFUSE, body, ring.name, flag)
            assert r.returncode == 0, r.stderr
            assert ring.proxy_memlock == want, (flag, ring.proxy_memlock)
            if want == MemlockState.REFUSED:
                assert "memory not locked: mlockall(" in r.stderr
        finally:
            ring.close()
