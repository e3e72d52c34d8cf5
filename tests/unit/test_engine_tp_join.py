"""Issue 25 item 2, unit level: ``DistComm`` joins nothing until ``join()``, and a join that
blocks past its bound (a peer frozen while holding the rendezvous store) ends the process with
one ``dsv41: error:`` line and exit 1 (the live-process matrix: tests/integration/
test_engine_frozen_peer.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dsv41.engine.tp import JOIN_GRACE_S, DistComm
from dsv41.errors import Dsv41Error


def test_construction_checks_arguments_and_joins_nothing():
    c = DistComm(1, 2, "127.0.0.1:1", "cpu", timeout_s=5, peer_timeout_s=2)
    assert not c.joined and c.live_ctrl is None
    c.close()  # never joined: nothing to tear down, returns at once
    with pytest.raises(Dsv41Error, match="outside"):
        DistComm(2, 2, "127.0.0.1:1")
    with pytest.raises(Dsv41Error, match="ADDR:PORT"):
        DistComm(0, 2, "nohost")


BLOCKED_JOIN = """
import time
from dsv41.engine import tp
tp.DistComm._join = lambda self: time.sleep(600)  # the C++ rendezvous that never returns
tp.DistComm(1, 2, "127.0.0.1:9", "cpu", timeout_s=0.5, peer_timeout_s=0.5).join()
print("joined?!")
"""


def test_a_join_blocked_past_its_bound_exits_with_one_line():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", BLOCKED_JOIN], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    bound = 0.5 + 0.5 + JOIN_GRACE_S
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv41: error: rank 1: cannot join the TP group at 127.0.0.1:9"), (
        lines
    )
    assert "joined?!" not in r.stdout and "Traceback" not in r.stderr
    assert bound <= took < bound + 20, took
