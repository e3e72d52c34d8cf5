"""Helpers of the remote Engram benchmarks (tests/perf/bench_remote_engram.py): the results
record, the table server subprocess, the C ping-pong floor's samplers, the timed blocks, CPU
pinning, the interleaved decode arms and the server-load baseline (raw O_DIRECT read). A helper
module, not a bench file: the bench's fixtures and tests stay in bench_remote_engram.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("UCX_TLS", "tcp")

from dsv41 import envs  # noqa: E402
from dsv41.engram import reader  # noqa: E402
from dsv41.engram.client import RemoteRowSource  # noqa: E402
from dsv41.engram.server import PAGE, READ_CHUNK  # noqa: E402
from dsv41.transport import (
    open_client,  # noqa: E402
    protocol as P,  # noqa: E402
)

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"
ROWS = int(os.environ.get("DSV41_BENCH_ROWS", "2000000"))
ENV = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp"), "OMP_NUM_THREADS": "1"}
RESULTS: list[dict] = []
#: Busy-poll budgets (us) of the spinning arms: DSV41_TRANSPORT_CLIENT_SPIN_US of this
#: environment (default 50) for the clients; DSV41_TRANSPORT_SERVER_SPIN_US for the spinning
#: server, 50 when it is unset or 0 (the shipped default: off), so that server always spins.
_SETTINGS = envs.parse()
SPIN_CLIENT_US = _SETTINGS.transport_client_spin_us
SPIN_SERVER_US = _SETTINGS.transport_server_spin_us or 50
#: Idle time (s) before each call of the gap arms: a decode step's spacing order of magnitude,
#: far past both spin budgets, so the server thread is asleep when the request arrives.
GAP_S = 0.001


def record(name: str, **kv) -> None:
    row = {"bench": name, **kv}
    RESULTS.append(row)
    print(f"\n[remote bench] {json.dumps(row)}")
    out = os.environ.get("DSV41_BENCH_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


class Served:
    def __init__(self, man: Path, tmp: Path, pure: bool = False, server_spin_us: int = SPIN_SERVER_US):
        self.ready = tmp / f"ready-{os.getpid()}-{time.monotonic_ns()}.json"
        env = {**ENV, "DSV41_TRANSPORT_SERVER_SPIN_US": str(server_spin_us)}
        if pure:
            env["DSV41_TRANSPORT_PURE"] = "1"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsv41.engram.remote_cli",
                "serve",
                "--manifest",
                str(man),
                "--listen",
                "tcp://127.0.0.1:0",
                "--listen",
                "nixl://127.0.0.1:0",
                "--ready-file",
                str(self.ready),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while not self.ready.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        self.info = json.loads(self.ready.read_text())
        self.tcp, self.nixl = self.info["listen"]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0


def floor_samples(exe, req: int, rep: int, iters: int) -> list[float]:
    out = subprocess.run(
        [str(exe), str(req), str(rep), str(iters), "200"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return [int(x) / 1e3 for x in out.split()]  # microseconds


def floor_samples_n(exe, req: int, rep: int, iters: int, warm: int) -> list[float]:
    out = subprocess.run(
        [str(exe), str(req), str(rep), str(iters), str(warm)], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    return [int(x) / 1e3 for x in out.split()]


def lookup_samples(client, ident, rows, iters: int) -> list[float]:
    out = np.empty((rows.shape[0], 264), np.uint8)
    for _ in range(200):
        client.lookup_into(ident, rows, [out], 1.0)
    ts = []
    pc = time.perf_counter_ns
    for _ in range(iters):
        t0 = pc()
        client.lookup_into(ident, rows, [out], 1.0)
        ts.append((pc() - t0) / 1e3)
    return ts


class Floor:
    """The C ping-pong (``tcp_pingpong -s``) kept alive, so blocks of its round trips can be
    interleaved with the other arms; ``block(n)`` -> n round trips in microseconds."""

    def __init__(self, exe, req: int, rep: int, cpus=(-1, -1)):
        self.proc = subprocess.Popen(
            [str(exe), "-s", str(req), str(rep), str(cpus[0]), str(cpus[1])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def block(self, n: int) -> list[float]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return [int(x) / 1e3 for x in self.proc.stdout.readline().split()]

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0


def timed_block(fn, n: int) -> list[float]:
    """n calls of ``fn()``, each timed with perf_counter_ns, in microseconds."""
    ts = []
    pc = time.perf_counter_ns
    for _ in range(n):
        t0 = pc()
        fn()
        ts.append((pc() - t0) / 1e3)
    return ts


def timed_gap_block(fn, n: int, gap_s: float = GAP_S) -> list[float]:
    """n calls of ``fn()``, each after ``gap_s`` of sleep (not timed), in microseconds."""
    ts = []
    pc = time.perf_counter_ns
    for _ in range(n):
        time.sleep(gap_s)
        t0 = pc()
        fn()
        ts.append((pc() - t0) / 1e3)
    return ts


def pin_process(pid: int, cpus: set[int] | None) -> dict[int, set[int]]:
    """Set the affinity of every thread of ``pid`` (threads it creates later inherit it); returns
    the previous affinities to restore with ``restore_affinity``."""
    old = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            old[int(tid)] = os.sched_getaffinity(int(tid))
            if cpus is not None:
                os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return old


def restore_affinity(old: dict[int, set[int]]) -> None:
    for tid, cpus in old.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


#: Decode bench shape: ROUNDS rounds, each a block of BLOCK calls of every primary arm (C floor,
#: bare tcp call and RemoteRowSource.lookup with busy-polling on and off) in an order that rotates
#: every round, so drift in the machine's load hits every arm alike; the first WARM_ROUNDS rounds
#: are discarded, and so is the first call of every block (each arm's first call after another
#: arm ran wakes its peer: a cold call every arm pays alike, not part of the steady state).
#: Short blocks (20 calls, ~0.5 ms) spread a millisecond-scale stall of the guest over all arms
#: instead of one arm's block, and 12,000 samples per arm and pass keep the p99 estimate's
#: spread below the targets' margin: with 40 blocks of 100 calls (4,000 samples) the bare call
#: and RemoteRowSource.lookup, the same C++ path, differed by up to 0.5x the floor's p99 in one
#: run (docs/benchmarks.md, issue 15). The secondary arms run every SIDE_EVERY rounds (40 times,
#: as before); the drift check pools SIDE_EVERY rounds (300 calls per arm).
ROUNDS, BLOCK, WARM_ROUNDS, SIDE_EVERY, SIDE_BLOCK = 600, 20, 15, 15, 100


def decode_arms(m, server, server0, pingpong, n: int, rng, cpus) -> dict:
    """One interleaved measurement of every decode arm at ``n`` rows; ``cpus`` = (client cpu,
    server cpu) that the bench thread, both table servers' threads and the two ends of the C
    ping-pong are pinned to, or None (the scheduler decides for all of them).  ``server``
    busy-polls for requests (SPIN_SERVER_US) and its clients for replies (SPIN_CLIENT_US);
    ``server0`` never spins; its clients spin (SPIN_CLIENT_US, ``*_client_spin`` arms) or not
    (``*_nospin``)."""
    ident = P.identity_bytes(m.table(1).identity)
    rows = rng.integers(0, m.table(1).rows, n).astype(np.int64)
    rows2 = [rows, rng.integers(0, m.table(2).rows, n).astype(np.int64)]
    urows = rows.astype(np.uint64)
    req, rep = P.REQ.size + 8 * n, P.REP.size + P.ROW_BYTES * n
    req2, rep2 = P.REQ.size + 2 * P.SEG.size + 16 * n, P.REP.size + 2 * P.ROW_BYTES * n
    old_self = os.sched_getaffinity(0)
    old_srv = pin_process(server.proc.pid, None if cpus is None else {cpus[1]})
    old_srv0 = pin_process(server0.proc.pid, None if cpus is None else {cpus[1]})
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[0]})
    try:
        c = open_client(server.tcp, [ident], spin_us=SPIN_CLIENT_US)
        c0 = open_client(server0.tcp, [ident], spin_us=0)
        cc = open_client(server0.tcp, [ident], spin_us=SPIN_CLIENT_US)
        xc = open_client(server.nixl, [ident])
        src = RemoteRowSource(server.tcp, m, 0, 1, timeout_ms=100, spin_us=SPIN_CLIENT_US)
        src0 = RemoteRowSource(server0.tcp, m, 0, 1, timeout_ms=100, spin_us=0)
        srcc = RemoteRowSource(server0.tcp, m, 0, 1, timeout_ms=100, spin_us=SPIN_CLIENT_US)
        assert src._client.multi_table  # the server speaks protocol version 2
        assert src._client.spin_us == SPIN_CLIENT_US and src0._client.spin_us == 0
        fl = Floor(pingpong, req, rep, cpus or (-1, -1))
        fl2 = Floor(pingpong, req2, rep2, cpus or (-1, -1))
        buf = np.zeros((n, P.ROW_BYTES), np.uint8)
        outs = [np.zeros((n, P.ROW_BYTES), np.uint8) for _ in range(2)]
        buf0 = np.zeros((n, P.ROW_BYTES), np.uint8)
        bufc = np.zeros((n, P.ROW_BYTES), np.uint8)
        bare, bare0, barec = c.lookup_into, c0.lookup_into, cc.lookup_into
        look, layers, look0, lookc = src.lookup, src.lookup_layers, src0.lookup, srcc.lookup
        arms = {
            "floor": lambda k: fl.block(k),
            "tcp": lambda k: timed_block(lambda: bare(ident, urows, [buf], 1.0), k),
            "rowsource": lambda k: timed_block(lambda: look(1, rows, buf), k),
            "tcp_nospin": lambda k: timed_block(lambda: bare0(ident, urows, [buf0], 1.0), k),
            "rowsource_nospin": lambda k: timed_block(lambda: look0(1, rows, buf0), k),
            "tcp_client_spin": lambda k: timed_block(lambda: barec(ident, urows, [bufc], 1.0), k),
            "rowsource_client_spin": lambda k: timed_block(lambda: lookc(1, rows, bufc), k),
        }
        side = {  # secondary arms, once per round after the primary ones
            "general": (
                SIDE_BLOCK,
                lambda k: timed_block(lambda: src._lookup_general(1, rows, buf, time.perf_counter()), k),
            ),
            "floor2": (SIDE_BLOCK // 2, lambda k: fl2.block(k)),
            "both": (SIDE_BLOCK // 2, lambda k: timed_block(lambda: layers((1, 2), rows2, outs), k)),
            "two": (
                SIDE_BLOCK // 2,
                lambda k: timed_block(lambda: (look(1, rows2[0], outs[0]), look(2, rows2[1], outs[1])), k),
            ),
            "nixl": (20, lambda k: timed_block(lambda: xc.lookup_into(ident, urows, [buf], 1.0), k)),
            "gap": (20, lambda k: timed_gap_block(lambda: look(1, rows, buf), k)),
            "gap_nospin": (20, lambda k: timed_gap_block(lambda: look0(1, rows, buf0), k)),
            "gap_client_spin": (20, lambda k: timed_gap_block(lambda: lookc(1, rows, bufc), k)),
        }
        got = {k: [] for k in [*arms, *side]}
        per_round = []  # per SIDE_EVERY rounds: p50 of each primary arm
        names = list(arms)
        group = {k: [] for k in names}
        for r in range(WARM_ROUNDS + ROUNDS):
            order = names[r % len(names) :] + names[: r % len(names)]
            this = {k: arms[k](BLOCK + 1)[1:] for k in order}  # the block's cold first call dropped
            extra = {k: f(b) for k, (b, f) in side.items()} if r % SIDE_EVERY == 0 else {}
            if r < WARM_ROUNDS:
                continue
            for k, v in [*this.items(), *extra.items()]:
                got[k] += v
            for k, v in this.items():
                group[k] += v
            if (r + 1) % SIDE_EVERY == 0:
                per_round.append({k: pct(v, 50) for k, v in group.items()})
                group = {k: [] for k in names}
        ref = reader.LocalRowReader(m, m.path.parent, threads=4)
        assert np.array_equal(buf, ref.read(1, rows)) and np.array_equal(buf0, buf) and np.array_equal(bufc, buf)
        assert all(np.array_equal(outs[k], ref.read(k + 1, rows2[k])) for k in range(2))
        ref.close()
        got["no_out"] = timed_block(lambda: look(1, rows), 1000)  # without a caller buffer: an allocation
        for s_ in (src, src0, srcc):
            cnt = s_.counters()
            assert cnt["fallbacks"] == 0 and cnt["remote_rows"] == cnt["rows"]
            s_.close()
        c.close()
        c0.close()
        cc.close()
        xc.close()
        fl.close()
        fl2.close()
    finally:
        os.sched_setaffinity(0, old_self)
        restore_affinity(old_srv)
        restore_affinity(old_srv0)
    f50, f99 = pct(got["floor"], 50), pct(got["floor"], 99)
    rr = np.array([[pr["tcp"] / pr["floor"], pr["rowsource"] / pr["floor"]] for pr in per_round])

    def arm(k: str) -> dict:  # p50/p99 of one arm and its ratios to this run's floor
        a50, a99 = pct(got[k], 50), pct(got[k], 99)
        return {
            f"{k}_p50_us": round(a50, 1),
            f"{k}_p99_us": round(a99, 1),
            f"{k}_ratio_p50": round(a50 / f50, 2),
            f"{k}_ratio_p99": round(a99 / f99, 2),
        }

    res = {
        "pinned": None if cpus is None else {"client_cpu": cpus[0], "server_cpu": cpus[1]},
        "spin_us": {"client": SPIN_CLIENT_US, "server": SPIN_SERVER_US},
        "samples_per_arm": len(got["floor"]),
        "floor_p50_us": round(f50, 1),
        "floor_p99_us": round(f99, 1),
        "tcp_p50_us": round(pct(got["tcp"], 50), 1),
        "tcp_p99_us": round(pct(got["tcp"], 99), 1),
        "ratio_p50": round(pct(got["tcp"], 50) / f50, 2),
        "ratio_p99": round(pct(got["tcp"], 99) / f99, 2),
        "rowsource_tcp_p50_us": round(pct(got["rowsource"], 50), 1),
        "rowsource_tcp_p99_us": round(pct(got["rowsource"], 99), 1),
        "rowsource_ratio_p50": round(pct(got["rowsource"], 50) / f50, 2),
        "rowsource_ratio_p99": round(pct(got["rowsource"], 99) / f99, 2),
        "rowsource_vs_tcp_p50": round(pct(got["rowsource"], 50) / pct(got["tcp"], 50), 2),
        # drift check: the p50 ratios of each round (median, min, max over the rounds)
        "round_ratio_p50_tcp": [round(float(x), 2) for x in (np.median(rr[:, 0]), rr[:, 0].min(), rr[:, 0].max())],
        "round_ratio_p50_rowsource": [
            round(float(x), 2) for x in (np.median(rr[:, 1]), rr[:, 1].min(), rr[:, 1].max())
        ],
        "rowsource_general_path_p50_us": round(pct(got["general"], 50), 1),
        "rowsource_general_path_p99_us": round(pct(got["general"], 99), 1),
        "rowsource_general_vs_tcp_p50": round(pct(got["general"], 50) / pct(got["tcp"], 50), 2),
        "rowsource_no_out_p50_us": round(pct(got["no_out"], 50), 1),
        "layers_floor_p50_us": round(pct(got["floor2"], 50), 1),
        "layers_one_request_p50_us": round(pct(got["both"], 50), 1),
        "layers_one_request_p99_us": round(pct(got["both"], 99), 1),
        "layers_ratio_p50": round(pct(got["both"], 50) / pct(got["floor2"], 50), 2),
        "two_lookups_p50_us": round(pct(got["two"], 50), 1),
        "two_lookups_p99_us": round(pct(got["two"], 99), 1),
        "nixl_p50_us": round(pct(got["nixl"], 50), 1),
        "nixl_p99_us": round(pct(got["nixl"], 99), 1),
        # busy-polling off (client and server spin 0), same floor, same rounds
        **arm("tcp_nospin"),
        **arm("rowsource_nospin"),
        # client spin only (server0), the shipped defaults
        **arm("tcp_client_spin"),
        **arm("rowsource_client_spin"),
        "rowsource_vs_tcp_nospin_p50": round(pct(got["rowsource_nospin"], 50) / pct(got["tcp_nospin"], 50), 2),
        # calls after GAP_S idle (the server thread asleep), spin on / off; ratios to the floor
        **arm("gap"),
        **arm("gap_nospin"),
        **arm("gap_client_spin"),
    }
    return res


def summary(n: int, name: str, r: dict) -> str:
    """One readable line per pass: every arm's p50/p99 ratio to the same floor."""

    def pr(k: str) -> str:
        return f"{r[k + '_ratio_p50']:.2f}/{r[k + '_ratio_p99']:.2f}"

    return (
        f"[remote bench] {n:3d} rows {name:6s} floor {r['floor_p50_us']:.1f}/{r['floor_p99_us']:.1f} us | "
        f"both spin: tcp {r['ratio_p50']:.2f}/{r['ratio_p99']:.2f} rowsource "
        f"{r['rowsource_ratio_p50']:.2f}/{r['rowsource_ratio_p99']:.2f} | client spin: tcp {pr('tcp_client_spin')} "
        f"rowsource {pr('rowsource_client_spin')} | no spin: tcp {pr('tcp_nospin')} "
        f"rowsource {pr('rowsource_nospin')} | after 1 ms idle: both {pr('gap')} client {pr('gap_client_spin')} "
        f"none {pr('gap_nospin')}"
    )


def raw_direct_read(m, d: Path, fresh: bool) -> float:
    """Baseline: O_DIRECT sequential 8 MiB reads of the same page-aligned spans, no hashing, one
    thread; into one reused 8 MiB buffer (``fresh=False``: the disk alone) or into a fresh
    anonymous mapping per region (``fresh=True``: what any loader must also pay to populate RAM)."""
    import mmap

    t0 = time.perf_counter()
    keep = []
    for t in m.tables:
        for off, length in ((t.weight_offset, t.rows * 256), (t.scale_offset, t.rows * 8)):
            a0 = off - off % PAGE
            end = off + length
            span = -(-(end - a0) // PAGE) * PAGE
            buf = mmap.mmap(-1, span if fresh else READ_CHUNK)
            keep.append(buf)
            mv = memoryview(buf)
            fd = os.open(d / t.file, os.O_RDONLY | os.O_DIRECT)
            pos = a0
            while pos < end:
                dst = mv[pos - a0 : pos - a0 + READ_CHUNK] if fresh else mv
                n = os.preadv(fd, [dst], pos)
                if n == 0:
                    break
                pos += n
            os.close(fd)
    dt = time.perf_counter() - t0
    keep.clear()  # the mappings go with their last views when this frame returns
    return dt


#: Rows of the huge-page bench's table (8,000,000 x 264 B = 2.1 GB; two copies are resident).
THP_ROWS = int(os.environ.get("DSV41_BENCH_THP_ROWS", "8000000"))


def anon_huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process holding ``addr`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0
