"""The GPU-join's C++ fallback reads its table's shard with pread, never through a MAP_SHARED
mapping: a shard truncated (or rewritten) under the running worker makes the fallback's pieces
count as bad (``gj_bad_pieces``) instead of a SIGBUS that would kill the vLLM worker. Runs the
fallback in a child process, so a regression shows as the child's death by SIGBUS, not as the
test runner's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.overlay import core as overlay_core
from dsv41.transport import native

pytestmark = pytest.mark.skipif(
    overlay_core._core is None or native._fastrow is None, reason="the C++ extensions are not built"
)

CHILD = r"""
import os, sys, time
import numpy as np
from dsv41.overlay import core as overlay_core

path, how = sys.argv[1], sys.argv[2]
rows, kW, kS = 4096, 256, 8
woff, soff = 0, rows * kW
slot = overlay_core._core.EngramSlot(7)
ids = np.zeros(1024, np.int64); hb = np.zeros(1024 * 268, np.uint8); fetch = np.zeros(1024, np.int64)
slot.set_buffers(ids.ctypes.data, hb.ctypes.data, fetch.ctypes.data, 1024)
slot.set_table(0, rows, b"\x01" * 32, rows)
slot.set_local(path, woff, soff, rows)
slot.gj_test_words()
if how == "truncate":
    os.truncate(path, 4096)
else:
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)
core = overlay_core._core.EngramCore(64, 100, 60.0, 30, (30, 10))
ids[:600] = np.arange(rows - 600, rows)  # rows past the truncation
slot.begin(1)
assert core.submit_gj(slot, 1, 600, 0, 0, 0, 100, (30, 10), 30.0, 1, queue=False) == 1
slot.gj_write_ids(1)
import threading
th = threading.Thread(target=core.next, daemon=True); th.start()
end = time.monotonic() + 20
while time.monotonic() < end and min(slot.gj_flags(8)) < 1:
    time.sleep(0.005)
print(dict(slot.gj_counters())["gj_bad_pieces"], flush=True)
core.retire()
th.join(10)  # next() re-takes the GIL on its way out: it must not meet the interpreter finalizing (abort)
assert not th.is_alive()
"""


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_a_shard_changed_under_the_fallback_is_bad_pieces_never_sigbus(how, tmp_path: Path) -> None:
    shard = tmp_path / "shard.bin"
    shard.write_bytes(os.urandom(4096 * 264))
    env = dict(os.environ, PYTHONPATH=str(Path(native.__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-c", CHILD, str(shard), how], capture_output=True, timeout=60, env=env)
    assert p.returncode != -signal.SIGBUS, "the fallback was killed by SIGBUS"
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert int(p.stdout.split()[-1]) > 0
