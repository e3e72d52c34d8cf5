"""The C++ core's exact local rows (``dsv41.overlay._core.LocalTable``, the fallback with the table
server down): the reader before (two ``pread`` per row, request order, one thread) against the
sorted, deduplicated, coalesced reads on one thread and on several reader threads.

Jobs: a decode step's 517 rows (the H100 record's decode job) and a 32K-token prefill chunk's
393,216 rows at TP2, gathered piece by piece in the core's layout (5 x 65,536, then 49,152,
14,336 and 2,048: ``EngramCore``'s piece and tail rows), ids uniform over the table (hashed
n-grams). The shard: ``DSV41_BENCH_LOCAL_ROWS`` rows of random bytes (default 1,000,000 = 264 MB)
in ``DSV41_BENCH_DIR`` (default: a pytest tmp dir), read warm (in the page cache) unless
``DSV41_BENCH_COLD=1`` (evicted before every repetition; a real disk then). Prints one line per
(job, mode): median and min of ``DSV41_BENCH_REPEATS`` (default 5) repetitions, syscalls per job,
and the speed-up against the reader before. Run: ``pytest -s tests/perf/bench_overlay_local_gather.py``.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

from benchutil import evict, machine
from dsv41.overlay import core as overlay_core

ROWS = int(os.environ.get("DSV41_BENCH_LOCAL_ROWS", "1000000"))
REPEATS = int(os.environ.get("DSV41_BENCH_REPEATS", "5"))
COLD = os.environ.get("DSV41_BENCH_COLD", "") == "1"
WOFF = 4096  # a header before the regions, as a safetensors shard has
PIECES = [65536] * 5 + [49152, 14336, 2048]  # 393,216 rows: a 32K-token chunk at TP2
MODES = {
    "before (1 thread, per row)": dict(readers=1, coalesce=False),
    "sorted+coalesced, 1 thread": dict(readers=1),
    "sorted+coalesced, default readers": dict(),
    "sorted+coalesced, 4 readers": dict(readers=4),
}

pytestmark = pytest.mark.skipif(overlay_core._core is None, reason="the C++ extension is not built")


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    d = Path(os.environ.get("DSV41_BENCH_DIR") or tmp_path_factory.mktemp("bench_local"))
    p = d / f"local_{ROWS}.bin"
    size = WOFF + ROWS * 264
    if not p.exists() or p.stat().st_size != size:
        rng = np.random.default_rng(1)
        with p.open("wb") as f:
            f.write(bytes(WOFF))
            for k in range(0, ROWS * 264, 1 << 26):
                f.write(rng.integers(0, 256, min(1 << 26, ROWS * 264 - k), np.uint8).tobytes())
    return p


def _time(lt, pieces: list[np.ndarray], outs: list[np.ndarray], path: Path) -> float:
    if COLD:
        evict([path])
    t0 = time.perf_counter()
    for ids, out in zip(pieces, outs, strict=True):
        assert lt.gather(ids, out)
    return time.perf_counter() - t0


@pytest.mark.parametrize("job", ["decode-517", "prefill-32k"])
def test_local_gather(shard: Path, job: str) -> None:
    rng = np.random.default_rng(7)
    sizes = [517] if job == "decode-517" else PIECES
    pieces = [rng.integers(0, ROWS, n).astype(np.int64) for n in sizes]
    print(
        f"\n[local gather] {machine()}; {ROWS} rows ({shard.stat().st_size / 2**20:.0f} MiB), {job}, "
        f"{sum(sizes)} rows in {len(sizes)} gathers, {'cold' if COLD else 'warm'} page cache, {REPEATS} repeats"
    )
    ref = None
    base = None
    for name, kw in MODES.items():
        lt = overlay_core._core.LocalTable(str(shard), WOFF, WOFF + ROWS * 256, ROWS, **kw)
        outs = [np.empty(len(p) * 264, np.uint8) for p in pieces]
        _time(lt, pieces, outs, shard)  # warm-up: the page cache, the reader threads
        got = np.concatenate(outs)
        if ref is None:
            ref = got
        assert np.array_equal(got, ref), name  # every mode reads the same bytes
        reads0 = lt.counters()["reads"]
        ts = [_time(lt, pieces, outs, shard) for _ in range(REPEATS)]
        reads = (lt.counters()["reads"] - reads0) / REPEATS
        med = statistics.median(ts)
        base = base or med
        print(
            f"  {name:36s} readers={lt.options['readers']}: median {med * 1e3:9.3f} ms, min {min(ts) * 1e3:9.3f} ms, "
            f"{reads:9.0f} preads/job, {base / med:5.2f}x the reader before"
        )
