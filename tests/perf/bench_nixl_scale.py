"""NIXL at the production table geometry, without RDMA hardware (``make bench``; UCX over TCP on
loopback, host memory).

Production: about 192 M rows per Engram layer per rank, 264 B a row (256 B FP8 weights + 8 B
UE8M0 scales, docs/engram.md), two layers: ~50 GB of weights per table.  Here each table is a
sparse file of that size (weights region then scales region, as the reader tests use sparse
files), mmapped read-only so no page is resident until touched; a ``RowServer`` with the
project's ``NixlExporter`` registers it, a ``NixlClient`` connects (handshake + prepared remote
descriptor list + warm-up READ) and looks rows up.

Measured per table size, each in its own process (so RSS is that size's alone):
- ``register``: ``NixlExporter`` creating its agent and registering the two regions (time, RSS
  growth), and the ``register_memory`` call alone (``register_only_s``);
- ``connect``: ``NixlClient`` construction (handshake, ``prep_xfer_dlist`` of the strided remote
  list, staging registration, one warm-up READ) (time, RSS growth);
- per-lookup descriptor construction for 24, 96 and 393,216 rows (a 32K-token prefill's rows of
  one layer for one TP2 rank): ``NixlClient._indices`` plus NIXL's ``make_prepped_xfer`` (the
  work before a READ is posted), and the same with the index building of the previous release
  (two concatenations and int32 casts per chunk) as the before column;
- a 24- and a 96-row ``lookup_into`` READ, checked byte for byte against rows written into the
  sparse file at those ids.

Takes no larger table once a process's RSS after connecting passes ``DSV41_BENCH_NIXL_RSS_CAP_MB``
(default 4096): memory growing with table rows would itself be the finding.  Results print as JSON lines (``DSV41_BENCH_OUT=FILE`` appends them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("UCX_TLS", "tcp")

from benchutil import machine  # noqa: E402

TABLE_ROWS = [int(x) for x in os.environ.get("DSV41_BENCH_NIXL_TABLE_ROWS", "1000000,16000000,192000000").split(",")]
REQUESTED = (24, 96, 393216)
RSS_CAP_MB = float(os.environ.get("DSV41_BENCH_NIXL_RSS_CAP_MB", "4096"))
STAGING_ROWS = 16384


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pattern(ids: np.ndarray) -> np.ndarray:
    """The 264 B row written at each id: bytes derived from the id (never all zero)."""
    ids = np.asarray(ids, np.uint64)
    base = (ids[:, None] * np.uint64(2654435761) + np.arange(264, dtype=np.uint64)[None, :]) % np.uint64(251)
    return (base + 1).astype(np.uint8)


def old_indices(slot: int, staging_rows: int, total: int, rows: np.ndarray, wbase: int, sbase: int):
    """Index building of the previous release (baseline): per chunk two concatenations + casts."""
    r = rows.astype(np.int64)
    k = r.shape[0]
    loc = slot * staging_rows + np.arange(k, dtype=np.int64)
    li = np.concatenate([loc, loc + total]).astype(np.int32)
    ri = np.concatenate([r + wbase, r + sbase]).astype(np.int32)
    return li, ri


def child(rows: int, directory: str) -> dict:
    """One table size, in this process: see the module docstring.  Returns the measurements."""
    import mmap

    from dsv41.transport import parse_url
    from dsv41.transport.nixl_backend import NixlClient, NixlExporter
    from dsv41.transport.server import RowServer, RowTable

    res: dict = {"table_rows": rows, "table_bytes": rows * 264}
    path = Path(directory) / f"sparse-{rows}.bin"
    rng = np.random.default_rng(rows)
    check = {n: rng.integers(0, rows, n) for n in (24, 96)}
    with open(path, "wb") as f:
        f.truncate(rows * 264)
        for ids in check.values():
            pat = pattern(ids)
            for i, r in enumerate(ids.tolist()):
                f.seek(r * 256)
                f.write(pat[i, :256].tobytes())
                f.seek(rows * 256 + r * 8)
                f.write(pat[i, 256:].tobytes())
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, rows * 264, mmap.MAP_SHARED, mmap.PROT_READ)
    buf = np.frombuffer(mm, np.uint8)
    table = RowTable(
        identity=bytes(range(32)),
        layer_id=1,
        weight=buf[: rows * 256].reshape(rows, 256),
        scale=buf[rows * 256 :].reshape(rows, 8),
    )
    r0 = rss_mb()
    res["rss_start_mb"] = round(r0, 1)
    t0 = time.perf_counter()
    exporter = NixlExporter([table])
    res["register_s"] = round(time.perf_counter() - t0, 4)
    r1 = rss_mb()
    res["register_rss_mb"] = round(r1 - r0, 1)
    # the registration alone (the exporter's time above includes creating its NIXL agent)
    exporter.agent.deregister_memory(exporter._reg)
    t0 = time.perf_counter()
    exporter._reg = exporter.agent.register_memory(
        [(table.weight.ctypes.data, table.weight.nbytes, 0, ""), (table.scale.ctypes.data, table.scale.nbytes, 0, "")],
        "DRAM",
    )
    res["register_only_s"] = round(time.perf_counter() - t0, 5)
    r1 = rss_mb()
    srv = RowServer([table], [parse_url("nixl://127.0.0.1:0")], nixl_provider=exporter)
    ep = srv.start()[0]
    try:
        t0 = time.perf_counter()
        client = NixlClient(ep, [table.identity], timeout_s=30.0, staging_rows=STAGING_ROWS)
        res["connect_s"] = round(time.perf_counter() - t0, 4)
        r2 = rss_mb()
        res["connect_rss_mb"] = round(r2 - r1, 1)
        if r2 > RSS_CAP_MB:
            res["stopped"] = f"RSS {r2:.0f} MB passed the cap"
            return res
        _, wbase, sbase = client.tables[table.identity]
        agent = client.agent
        for n in REQUESTED:
            ids = rng.integers(0, rows, n).astype(np.int64)
            reps = 3 if n > 1000 else 200
            for label, build in (
                ("new", lambda r: client._indices(0, [(r, wbase, sbase)])),
                ("old", lambda r: old_indices(0, STAGING_ROWS, client._total, r, wbase, sbase)),
            ):
                idx_s, make_s = [], []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for s in range(0, n, STAGING_ROWS):  # the client READs in staging-slot chunks
                        li, ri = build(ids[s : s + STAGING_ROWS])
                        t1 = time.perf_counter()
                        h = agent.make_prepped_xfer("READ", client.local_dlist, li, client.remote_dlist, ri)
                        t2 = time.perf_counter()
                        h.release()
                        idx_s.append(t1 - t0)
                        make_s.append(t2 - t1)
                        t0 = time.perf_counter()
                chunks = -(-n // STAGING_ROWS)
                res[f"prep_{n}_{label}_indices_us"] = round(float(np.median(idx_s)) * chunks * 1e6, 1)
                res[f"prep_{n}_{label}_make_xfer_us"] = round(float(np.median(make_s)) * chunks * 1e6, 1)
            res[f"prep_{n}_rss_mb"] = round(rss_mb() - r0, 1)
        for n, ids in check.items():
            out = np.zeros((n, 264), np.uint8)
            ts = []
            for _ in range(20):
                t0 = time.perf_counter()
                client.lookup_into(table.identity, ids.astype(np.uint64), [out], 30.0)
                ts.append(time.perf_counter() - t0)
            res[f"read_{n}_exact"] = bool(np.array_equal(out, pattern(ids)))
            res[f"read_{n}_p50_us"] = round(float(np.median(ts)) * 1e6, 1)
        res["rss_end_mb"] = round(rss_mb(), 1)
        client.close()
    finally:
        srv.stop(2)
        exporter.close()
        os.close(fd)  # the mapping (still referenced by the server core) goes with the process
        path.unlink()
    return res


def test_nixl_scale_table(tmp_path):
    pytest.importorskip("nixl_cu12")
    here = Path(__file__).resolve().parent
    results = []
    for rows in TABLE_ROWS:
        p = subprocess.run(
            [sys.executable, str(Path(__file__)), "--child", str(rows), str(tmp_path)],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp")},
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("{")]
        assert p.returncode == 0 and line, p.stderr[-3000:]
        res = json.loads(line[-1])
        res.update(machine=machine(), loadavg=[round(x, 2) for x in os.getloadavg()])
        print(f"\n[nixl scale] {json.dumps(res)}")
        out = os.environ.get("DSV41_BENCH_OUT")
        if out:
            with open(out, "a") as f:
                f.write(json.dumps({"bench": "nixl_scale", **res}) + "\n")
        results.append(res)
        if "stopped" in res:
            break  # memory grows with table rows: that is the finding, no larger table
        assert res["read_24_exact"] and res["read_96_exact"]


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(child(int(sys.argv[2]), sys.argv[3])))
