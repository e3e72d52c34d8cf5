"""The C++ core's exact local rows (``core_local.h``: ``LocalTable``, the fallback with the table
server down). Its gather gives the Python ``LocalRowReader``'s bytes for every kind of job (random
ids with duplicates, descending, adjacent runs, one row, the last row, a job split across the
reader threads) under every read mode (sorted and coalesced at each gap, parallel, the per-row
reader before it), reads fewer times than two per row, and still refuses an id outside the table
and a shard truncated or rewritten since it was opened. The options come from the overlay's
settings (``DSV41_ENGRAM_LOCAL_*``).

The GPU-join's C++ fallback reads its table's shard with pread, never through a MAP_SHARED
mapping: a shard truncated (or rewritten) under the running worker makes the fallback's pieces
count as bad (``gj_bad_pieces``) instead of a SIGBUS that would kill the vLLM worker. Runs the
fallback in a child process, so a regression shows as the child's death by SIGBUS, not as the
test runner's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from dsv41 import env_vars
from dsv41.engram import reader, synthetic
from dsv41.engram.manifest import load_manifest
from dsv41.envs import ConfigError
from dsv41.overlay import core as overlay_core, engram_gpujoin as GJ, settings as S
from dsv41.transport import native
from overlayutil import CFG

needs_cpp = pytest.mark.skipif(
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


@needs_cpp
@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_a_shard_changed_under_the_fallback_is_bad_pieces_never_sigbus(how, tmp_path: Path) -> None:
    shard = tmp_path / "shard.bin"
    shard.write_bytes(os.urandom(4096 * 264))
    env = dict(os.environ, PYTHONPATH=str(Path(native.__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-c", CHILD, str(shard), how], capture_output=True, timeout=60, env=env)
    assert p.returncode != -signal.SIGBUS, "the fallback was killed by SIGBUS"
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert int(p.stdout.split()[-1]) > 0


# ---- the gather against the Python reader ----------------------------------------------------

LAYER = 14
#: every read mode: the defaults, forced onto 3 readers, no gap, the widest gap, the reader before
MODES = {
    "defaults": {},
    "parallel": dict(readers=3, parallel_rows=64),
    "adjacent-only": dict(readers=2, parallel_rows=1, gap_bytes=0),
    "widest-gap": dict(readers=4, parallel_rows=16, gap_bytes=32768),
    "per-row": dict(readers=1, coalesce=False),
    "per-row-parallel": dict(readers=3, parallel_rows=64, coalesce=False),
}


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """(LocalRowReader, the layer's table entry, the shard's path) of synthetic tables."""
    d = tmp_path_factory.mktemp("local")
    m = load_manifest(synthetic.write_synthetic_tables(CFG, d, seed=3, chunk_size=1 << 20))
    r = reader.LocalRowReader(m, d, threads=1)
    t = r.tables[LAYER]
    yield r, t, str(d / t.file)
    r.close()


def _jobs(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    rand = rng.integers(0, rows, 700)
    return {
        "random-with-duplicates": np.concatenate([rand, rand[:50], rand[::7]]),
        "descending": np.arange(rows - 1, rows - 901, -1),
        "adjacent-runs": np.concatenate([np.arange(100, 400), np.arange(5000, 5040), np.arange(9000, 9300, 3)]),
        "one-row": np.array([rows // 2]),
        "the-last-row": np.array([rows - 1, 0, rows - 1]),
        "above-the-threshold": rng.integers(0, rows, 3000),
        "clustered": rng.integers(rows - 300, rows, 2500),
    }


def _table(t, path: str, **kw):
    return overlay_core._core.LocalTable(path, t.weight_offset, t.scale_offset, t.rows, **kw)


def _gather(lt, ids: np.ndarray) -> tuple[bool, np.ndarray]:
    out = np.full(len(ids) * 264, 0xA5, np.uint8)
    return lt.gather(np.ascontiguousarray(ids, np.int64), out), out.reshape(-1, 264)


@needs_cpp
@pytest.mark.parametrize("mode", sorted(MODES))
def test_gather_gives_the_python_readers_bytes(shard, mode) -> None:
    r, t, path = shard
    lt = _table(t, path, **MODES[mode])
    for name, ids in _jobs(t.rows).items():
        ok, got = _gather(lt, ids)
        assert ok, (mode, name)
        assert np.array_equal(got, r.read(LAYER, ids)), (mode, name)
    c = lt.counters()
    assert c["jobs"] == len(_jobs(t.rows))
    # the jobs above parallel_rows (3,000 and 2,500 rows) went to the readers where there are any
    assert c["parallel_jobs"] >= (2 if lt.options["readers"] > 1 else 0)


@needs_cpp
def test_coalescing_reads_each_span_once(shard) -> None:
    _, t, path = shard
    run = np.arange(1000, 1200)  # 200 adjacent rows: 51,200 weight bytes, 1,600 scale bytes
    for ids, reads in ((run, 2), (np.repeat([7], 50), 2), (run[::-1], 2), (np.array([10, 12]), 2)):
        lt = _table(t, path, readers=1)
        assert _gather(lt, ids)[0]
        assert lt.counters()["reads"] == reads, ids[:4]
    # no gap bridged: rows two apart are two weight reads, their scales (16 bytes apart) too
    lt = _table(t, path, readers=1, gap_bytes=0)
    assert _gather(lt, np.array([10, 12]))[0] and lt.counters()["reads"] == 4
    # the reader before: two preads per row, duplicates included
    lt = _table(t, path, readers=1, coalesce=False)
    assert _gather(lt, np.repeat([7], 50))[0] and lt.counters()["reads"] == 100
    # a span never passes 64 KiB: 1,000 adjacent rows are 4 weight reads of <= 256 rows and 1 scale read
    lt = _table(t, path, readers=1)
    assert _gather(lt, np.arange(2000, 3000))[0] and lt.counters()["reads"] == 4 + 1


@needs_cpp
def test_jobs_from_several_threads_at_once_are_exact(shard) -> None:
    """The worker and the watchdog may gather from one table at once: one job holds the readers,
    the other reads on its own thread; both exact."""
    r, t, path = shard
    lt = _table(t, path, readers=3, parallel_rows=64)
    jobs = [np.random.default_rng(k).integers(0, t.rows, 3000) for k in range(4)]
    refs = [r.read(LAYER, ids) for ids in jobs]
    bad: list[int] = []

    def run(k: int) -> None:
        for _ in range(5):
            ok, got = _gather(lt, jobs[k])
            if not (ok and np.array_equal(got, refs[k])):
                bad.append(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not bad and not any(th.is_alive() for th in threads)
    assert lt.counters()["jobs"] == 20 and lt.counters()["parallel_jobs"] >= 1


@needs_cpp
def test_a_small_job_stays_on_the_calling_thread(shard) -> None:
    _, t, path = shard
    lt = _table(t, path, readers=4, parallel_rows=600)
    assert _gather(lt, np.arange(600))[0] and lt.counters()["parallel_jobs"] == 0
    assert _gather(lt, np.arange(601))[0] and lt.counters()["parallel_jobs"] == 1


@needs_cpp
@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_id_outside_the_table_is_refused(shard, mode) -> None:
    _, t, path = shard
    lt = _table(t, path, **MODES[mode])
    for ids in ([t.rows], [0, 1, t.rows], [-1], list(range(2000)) + [t.rows + 5]):
        assert _gather(lt, np.array(ids))[0] is False, ids
    assert lt.counters()["reads"] == 0  # refused before any read


@needs_cpp
@pytest.mark.parametrize("how", ["truncate", "rewrite"])
@pytest.mark.parametrize("mode", ["defaults", "parallel", "per-row"])
def test_a_shard_changed_while_open_is_refused(shard, tmp_path, how, mode) -> None:
    _, t, src = shard
    path = tmp_path / "copy.bin"
    path.write_bytes(Path(src).read_bytes())
    lt = _table(t, str(path), **MODES[mode])
    ids = np.random.default_rng(2).integers(0, t.rows, 3000)
    assert _gather(lt, ids)[0]
    if how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:
        st = path.stat()
        with path.open("r+b") as f:
            f.write(b"\xff" * 16)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new mtime even on a coarse clock
    assert _gather(lt, ids)[0] is False
    assert _gather(lt, ids[:1])[0] is False


@needs_cpp
def test_bad_options_are_refused(shard) -> None:
    _, t, path = shard
    for kw in (dict(readers=-1), dict(readers=65), dict(parallel_rows=0), dict(gap_bytes=-1), dict(gap_bytes=32769)):
        with pytest.raises(ValueError, match="local reader"):
            _table(t, path, **kw)


# ---- the settings ------------------------------------------------------------------------------

NAMES = {
    "readers": "DSV41_ENGRAM_LOCAL_READERS",
    "parallel_rows": "DSV41_ENGRAM_LOCAL_PARALLEL_ROWS",
    "gap_bytes": "DSV41_ENGRAM_LOCAL_GAP_BYTES",
    "coalesce": "DSV41_ENGRAM_LOCAL_COALESCE",
}


@needs_cpp
def test_the_defaults_are_one_set(shard) -> None:
    """The table's defaults, the settings' and the extension's are the same (readers 0 resolved to
    min(8, hardware threads / 2), at least 1)."""
    _, t, path = shard
    table = {f: env_vars.ENV_VARS[n].default for f, n in NAMES.items()}
    assert S.LocalReader().kwargs() == table == S.parse({}).local_reader.kwargs()
    got = _table(t, path).options
    assert got == dict(table, readers=max(1, min(8, (os.cpu_count() or 2) // 2)))


def test_the_settings_read_the_environment() -> None:
    env = {NAMES["readers"]: "4", NAMES["parallel_rows"]: "100", NAMES["gap_bytes"]: "0", NAMES["coalesce"]: "0"}
    assert S.parse(env).local_reader == S.LocalReader(4, 100, 0, False)
    for name, bad in ((NAMES["readers"], "65"), (NAMES["parallel_rows"], "0"), (NAMES["gap_bytes"], "x")):
        with pytest.raises(ConfigError, match=name) as e:
            S.parse({name: bad})
        assert "\n" not in str(e.value)


@needs_cpp
def test_the_slot_reads_with_the_rows_options(shard) -> None:
    _, t, path = shard
    slot = overlay_core._core.EngramSlot(3)
    assert slot.local_options() is None
    rows = type("Rows", (), {"local_reader": S.LocalReader(2, 64, 512, True)})()
    GJ.set_local(slot, (path, t.weight_offset, t.scale_offset, t.rows), rows)
    assert slot.local_options() == dict(readers=2, parallel_rows=64, gap_bytes=512, coalesce=True)
    GJ.set_local(slot, (path, t.weight_offset, t.scale_offset, t.rows), object())  # no options: the defaults
    assert slot.local_options() == _table(t, path).options
