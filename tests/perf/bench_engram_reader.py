"""Engram core benchmarks: local row reader (cold cache, O_DIRECT) vs a plain single-threaded
pread loop, and verify throughput vs a raw sequential read of the same files.

Tables: two synthetic shards of ``DSV41_BENCH_ROWS`` rows each (default 2,000,000 = 528 MB per
shard, ~1.06 GB total) in ``DSV41_BENCH_DIR`` (default: a pytest tmp dir; must be a real disk,
not tmpfs, for the cold-cache numbers to mean anything).  The page cache is evicted with
``posix_fadvise(DONTNEED)`` (after fsync) before every timed repetition.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from benchutil import evict, machine
from dsv41.engram import reader, synthetic
from dsv41.engram.manifest import load_manifest, verify

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"
ROWS = int(os.environ.get("DSV41_BENCH_ROWS", "2000000"))


def cached_fraction(path: Path) -> str:
    """Resident pages of ``path`` per fincore (util-linux), to show the eviction worked."""
    try:
        out = subprocess.run(
            ["fincore", "-b", "-n", "-o", "RES,SIZE", str(path)], capture_output=True, text=True, timeout=10
        ).stdout.split()
        return f"{int(out[0]) / max(1, int(out[1])):.3f}"
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return "n/a"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = Path(os.environ.get("DSV41_BENCH_DIR") or tmp_path_factory.mktemp("bench_engram"))
    man = d / "manifest.json"
    if not man.exists() or load_manifest(man).tables[0].rows != ROWS:
        t0 = time.perf_counter()
        synthetic.write_synthetic_tables(LAB, d, seed=1, rows_override=[ROWS, ROWS])
        print(f"\n[engram bench] wrote {2 * ROWS} rows in {time.perf_counter() - t0:.1f} s to {d}")
    m = load_manifest(man)
    return m, d


def pread_loop(m, d: Path, layer: int, ids: np.ndarray) -> np.ndarray:
    """Baseline: one buffered pread per weight row and per scale row, one thread."""
    t = m.table(layer)
    out = np.empty((len(ids), 264), np.uint8)
    fd = os.open(d / t.file, os.O_RDONLY)
    try:
        for k, i in enumerate(ids.tolist()):
            out[k, :256] = np.frombuffer(os.pread(fd, 256, t.weight_offset + 256 * i), np.uint8)
            out[k, 256:] = np.frombuffer(os.pread(fd, 8, t.scale_offset + 8 * i), np.uint8)
    finally:
        os.close(fd)
    return out


def _stats(lat: list[float], n: int) -> tuple[float, float, float]:
    lat_sorted = sorted(lat)
    p50 = statistics.median(lat_sorted)
    p99 = lat_sorted[min(len(lat_sorted) - 1, int(round(0.99 * (len(lat_sorted) - 1))))]
    return n / statistics.fmean(lat), p50, p99


@pytest.mark.parametrize("n,reps,base_reps", [(24, 200, 50), (1024, 30, 5), (786432, 3, 1)])
def test_reader_cold(shards, n: int, reps: int, base_reps: int) -> None:
    m, d = shards
    files = [d / f["name"] for f in m.files]
    t = m.table(1)
    rng = np.random.default_rng(n)
    lat_r, lat_b = [], []
    with reader.LocalRowReader(m, d, threads=16, direct=True) as r:
        direct = r.is_direct(1)
        for k in range(reps):
            ids = rng.integers(0, t.rows, n)
            evict(files)
            t0 = time.perf_counter()
            got = r.read(1, ids)
            lat_r.append(time.perf_counter() - t0)
            if k < base_reps:
                evict(files)
                t0 = time.perf_counter()
                base = pread_loop(m, d, 1, ids)
                lat_b.append(time.perf_counter() - t0)
                np.testing.assert_array_equal(got, base)
        evict(files)
        frac = cached_fraction(files[0])
    rr, r50, r99 = _stats(lat_r, n)
    br, b50, b99 = _stats(lat_b, n)
    print(
        f"\n[engram bench] {machine()}; table {t.rows} rows x 264 B, O_DIRECT={direct}, "
        f"cached after evict={frac}, load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"| {n:,} rows | reader (16 threads) | {rr:,.0f} rows/s | p50 {r50 * 1e3:.2f} ms | p99 {r99 * 1e3:.2f} ms | {reps} reps |"
    )
    print(
        f"| {n:,} rows | pread loop (1 thread) | {br:,.0f} rows/s | p50 {b50 * 1e3:.2f} ms | p99 {b99 * 1e3:.2f} ms | {base_reps} reps |"
    )
    print(f"| {n:,} rows | ratio reader/pread | {rr / br:.2f}x | | | |")


def test_verify_vs_raw_read(shards) -> None:
    m, d = shards
    files = [d / f["name"] for f in m.files]
    total = sum(f["size"] for f in m.files)
    res = {"raw": [], "verify": []}
    buf = bytearray(4 << 20)
    for _ in range(2):
        evict(files)
        t0 = time.perf_counter()
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                off = 0
                while True:
                    k = os.preadv(fd, [buf], off)
                    if not k:
                        break
                    off += k
            finally:
                os.close(fd)
        res["raw"].append(total / (time.perf_counter() - t0))
        evict(files)
        c0 = os.times()
        t0 = time.perf_counter()
        verify(m, d, progress=False)
        res["verify"].append(total / (time.perf_counter() - t0))
        c1 = os.times()
        # CPU seconds per byte (all threads): robust to other load on a shared machine
        res.setdefault("cpu", []).append((c1.user - c0.user + c1.system - c0.system) / total)
    raw, ver = max(res["raw"]), max(res["verify"])
    # the hashing ceiling on this machine right now: one core's sha256 over data in memory
    blob = os.urandom(64 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(blob).digest()
    sha1core = len(blob) / (time.perf_counter() - t0)
    # hot cache too: isolates hashing speed from the disk
    t0 = time.perf_counter()
    verify(m, d, progress=False)
    hot = total / (time.perf_counter() - t0)
    print(
        f"\n[engram bench] {machine()}; {total / 1e9:.2f} GB in {len(files)} files; load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"| verify (default workers, cold) | {ver / 1e9:.2f} GB/s | raw sequential read (cold) {raw / 1e9:.2f} GB/s | ratio {ver / raw:.2f} |"
    )
    print(
        f"| verify (default workers, hot cache) | {hot / 1e9:.2f} GB/s | sha256 of RAM, 1 core: {sha1core / 1e9:.2f} GB/s | |"
    )
    cpu = min(res["cpu"])
    cap = 2 / cpu  # bytes/s two idle cores could verify, from the CPU time verify needed
    print(
        f"| verify CPU cost | {cpu * 1e9:.2f} CPU-s/GB | 2-core CPU capacity {cap / 1e9:.2f} GB/s | capacity / raw {cap / raw:.2f} |"
    )
