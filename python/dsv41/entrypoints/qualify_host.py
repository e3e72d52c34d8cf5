"""Host-side qualification probes (``dsv41 qualify peers|transport|sweep|serving-host|vllm-tiny``):
each runs on the host being qualified, through the inventory's own connection, and returns the
check records (``dsv41.entrypoints.qualify.record``) of its group: links (peer reachability),
transport (backend, latency, bandwidth, refused identity, late replies), exactness (the sweep).
The serving group (required mode, pinned memory, the container's image, overlay and graph mode;
the tiny vLLM run) is :mod:`dsv41.entrypoints.qualify_serving`. A check that needs what the host
lacks is ``skipped`` with the reason.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from dsv41 import envs
from dsv41.entrypoints.qualify import record
from dsv41.errors import Dsv41Error

#: 64 MiB: the published link probe's transfer size (README "Qualify on hardware").
BANDWIDTH_BYTES = 64 << 20


# --- links -----------------------------------------------------------------------------------------


def probe_peers(
    host: str,
    links: list[dict],
    count: int = 3,
    interval_s: float = 0.2,
    timeout_s: float = 1.0,
    ping: Callable | None = None,
) -> list[dict]:
    """``links.peer_reachable[<link>]``: ICMP echo to each link's ``peer_address`` from its own
    ``address`` (icmplib, raw socket: needs root/CAP_NET_RAW). Value: average RTT in ms and
    packets received of ``count``."""
    if ping is None:
        from icmplib import ping  # noqa: PLC0415
    from icmplib.exceptions import ICMPLibError  # noqa: PLC0415

    out = []
    for link in links:
        name, peer = link["name"], link.get("peer_address")
        if not peer:
            out.append(
                record("links", "peer_reachable", host, None, reason="no peer_address in the inventory", subject=name)
            )
            continue
        try:
            h = ping(
                peer, count=count, interval=interval_s, timeout=timeout_s, source=link.get("address"), privileged=True
            )
            ok = h.packets_received > 0
            out.append(
                record(
                    "links",
                    "peer_reachable",
                    host,
                    ok,
                    {"rtt_avg_ms": round(h.avg_rtt, 3), "received": h.packets_received, "sent": h.packets_sent},
                    f"{peer} answers",
                    reason=""
                    if ok
                    else f"{name}: {peer} did not answer {h.packets_sent} echo requests from {link.get('address')}",
                    subject=name,
                )
            )
        except (ICMPLibError, OSError) as exc:
            out.append(
                record(
                    "links",
                    "peer_reachable",
                    host,
                    False,
                    None,
                    f"{peer} answers",
                    reason=f"{name}: ping {peer}: {exc}",
                    subject=name,
                )
            )
    return out


# --- transport -------------------------------------------------------------------------------------


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """``KEY=VALUE`` pairs of a service's env file (:func:`dsv41.envs.parse_env_text`: comments and
    blanks skipped); {} when absent. Dsv41Error (one line) when it is not a regular file or malformed."""
    from dsv41.entrypoints.env_cli import read_env_file as read_pairs

    if not os.path.lexists(path):
        return {}
    return read_pairs(Path(path))


def rank_url(env: dict[str, str], rank: int) -> str | None:
    """This rank's ``DSV41_ENGRAM_REMOTE`` URL (one URL per rank, or one for all); None when unset.
    :class:`dsv41.envs.ConfigError` (one line) when ``env`` holds a value the services would refuse."""
    urls = [u.strip() for u in envs.parse(env).engram_remote.split(",") if u.strip()]
    if not urls:
        return None
    return urls[rank] if len(urls) > rank else urls[0]


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def probe_transport(
    host: str,
    link: str,
    url: str,
    manifest: str,
    rank: int,
    tp: int,
    *,
    backend: str,
    p50_max_us: float,
    p99_max_us: float,
    gbps_min: float,
    iters: int = 2000,
    bw_bytes: int = BANDWIDTH_BYTES,
    bw_repeats: int = 5,
    bw_min_s: float = 2.0,
    start_at: float | None = None,
    timeout_ms: int = 1000,
    seed: int = 0,
    sleep=time.sleep,
) -> list[dict]:
    """Transport checks of one rank over its own link, with the project's client
    (``dsv41.engram.client.RemoteRowSource``, required mode: no local fallback can hide a failure):

    - ``backend``: the URL's scheme is the production backend ``backend`` (nixl over RDMA, else tcp);
    - ``latency_p50`` / ``latency_p99`` (us): ``iters`` decode-size lookups (one token: this
      rank's columns of every Engram layer, in one ``lookup_layers`` call) against ceilings;
    - ``bandwidth`` (Gb/s): ``bw_bytes`` (64 MiB) of rows of one layer per transfer, median of
      ``bw_repeats`` transfers or more, until the transfers have lasted ``bw_min_s`` seconds,
      against ``gbps_min``; the measurement starts at epoch ``start_at`` when given (both ranks
      together: the two links at once). The floor on its duration keeps the two ranks' windows
      overlapping when one wakes late (clock skew, a loaded host): 5 x 64 MiB at 200 Gb/s would
      last 13 ms. ``value`` also carries start and end times and ``late_s``, how long after
      ``start_at`` the transfers began (the earlier checks ran past it when large);
    - ``refused_identity``: a HELLO naming a table the server does not hold is refused (``wrong_identity``);
    - ``late_reply_dropped``: a request timed out on purpose (1 M rows in 10 us): over tcp its
      connection is closed (its late reply is never read), over nixl its staging slot is
      quarantined; the next request returns rows byte-identical to the local shards.
    """
    import numpy as np

    from dsv41.engram.client import RemoteRowSource
    from dsv41.engram.layout import layout_from_manifest
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.reader import LocalRowReader
    from dsv41.transport import Refused, TransportError, TransportTimeout, open_client, parse_url, protocol as P

    out: list[dict] = []
    ep = parse_url(url)
    out.append(
        record(
            "transport",
            "backend",
            host,
            ep.scheme == backend,
            ep.scheme,
            backend,
            reason="" if ep.scheme == backend else f"{link}: {url} uses {ep.scheme}, production backend is {backend}",
            subject=link,
        )
    )
    m = load_manifest(manifest)
    layout = layout_from_manifest(m)
    layers = list(layout.layer_ids)
    c0, c1 = layout.columns_for_rank(tp, rank)
    rng = np.random.default_rng([seed, rank])
    ranges = [layout.row_range(li, tp, rank) for li in range(len(layers))]
    reader = LocalRowReader(m, Path(manifest).parent)
    names = ("latency_p50", "latency_p99", "bandwidth", "late_reply_dropped")
    try:
        src = RemoteRowSource([url], m, 0, 1, timeout_ms=timeout_ms, required=True, local=reader)
    except Dsv41Error as exc:
        return (
            out
            + [record("transport", n, host, False, reason=f"{link}: {url}: {exc}", subject=link) for n in names]
            + [record("transport", "refused_identity", host, False, reason=f"{link}: {url}: {exc}", subject=link)]
        )
    try:
        if not src.wait_connected(10.0):
            raise Dsv41Error("not connected within 10 s")
        # latency: decode-size lookups (one token's columns per layer)
        ncol = c1 - c0
        lat = []
        for _ in range(iters):
            rows = [rng.integers(lo, hi, ncol, dtype=np.int64) for lo, hi in ranges]
            t0 = time.perf_counter()
            src.lookup_layers(layers, rows)
            lat.append((time.perf_counter() - t0) * 1e6)
        p50, p99 = _pct(lat, 50), _pct(lat, 99)
        out.append(
            record(
                "transport",
                "latency_p50",
                host,
                p50 <= p50_max_us,
                round(p50, 1),
                f"<= {p50_max_us}",
                unit="us",
                subject=link,
                reason=""
                if p50 <= p50_max_us
                else f"{link}: p50 {p50:.1f} us of {iters} decode lookups ({ncol} rows x {len(layers)} layers) over {p50_max_us} us",
            )
        )
        out.append(
            record(
                "transport",
                "latency_p99",
                host,
                p99 <= p99_max_us,
                round(p99, 1),
                f"<= {p99_max_us}",
                unit="us",
                subject=link,
                reason=""
                if p99 <= p99_max_us
                else f"{link}: p99 {p99:.1f} us of {iters} decode lookups over {p99_max_us} us",
            )
        )
        # bandwidth: 64 MiB of one layer's rows per transfer
        n = max(1, bw_bytes // layout.row_bytes)
        lo, hi = ranges[0]
        ids = rng.integers(lo, hi, n, dtype=np.int64)
        buf = np.empty((n, layout.row_bytes), dtype=np.uint8)
        src.lookup(layers[0], ids[:1024])  # warm
        if start_at is not None:
            sleep(max(0.0, start_at - time.time()))
        t_start, secs = time.time(), []
        t_first = time.perf_counter()
        while len(secs) < bw_repeats or time.perf_counter() - t_first < bw_min_s:
            t0 = time.perf_counter()
            src.lookup(layers[0], ids, out=buf)
            secs.append(time.perf_counter() - t0)
        t_end = time.time()
        late_s = round(max(0.0, t_start - start_at), 3) if start_at is not None else None
        gbps = n * layout.row_bytes * 8 / statistics.median(secs) / 1e9
        out.append(
            record(
                "transport",
                "bandwidth",
                host,
                gbps >= gbps_min,
                {
                    "gbps": round(gbps, 2),
                    "bytes": int(n * layout.row_bytes),
                    "repeats": len(secs),
                    "start": round(t_start, 3),
                    "end": round(t_end, 3),
                    "late_s": late_s,
                },
                f">= {gbps_min}",
                unit="Gb/s",
                subject=link,
                reason=""
                if gbps >= gbps_min
                else f"{link}: {gbps:.2f} Gb/s for {n * layout.row_bytes} B transfers, floor {gbps_min}",
            )
        )
        # late reply: time one request out on purpose, then prove the next rows exact. tcp closes
        # the connection at a timeout (its late bytes are never read); nixl keeps the connection
        # and quarantines the staging slot the late READ may still write (nixl_backend).
        ident = bytes.fromhex(m.table(layers[0]).identity)
        big = min(P.MAX_ROWS, 1 << 20)
        check_ids = rng.integers(lo, hi, 4096, dtype=np.int64)
        c = open_client(ep, [ident], timeout_s=timeout_ms / 1e3)
        try:
            rows = rng.integers(lo, hi, big, dtype=np.int64).astype(np.uint64)
            dest = np.empty((big, layout.row_bytes), dtype=np.uint8)
            try:
                c.lookup_into(ident, rows, [dest], 1e-5)
                timed_out = False
            except TransportTimeout:
                timed_out = True
            if ep.scheme == "nixl":
                guard, guarded = "slot_quarantined", bool(getattr(c, "_quarantine", None))
                got = np.empty((check_ids.size, layout.row_bytes), dtype=np.uint8)
                c.lookup_into(ident, check_ids.astype(np.uint64), [got], timeout_ms / 1e3)  # same client, next request
            else:
                guard, guarded = "connection_closed", not c.connected
                got = src.lookup(layers[0], check_ids)  # the next request, on a new connection
        finally:
            c.close()
        bad = int(np.count_nonzero((got != reader.read(layers[0], check_ids)).any(axis=1)))
        ok = timed_out and guarded and bad == 0
        out.append(
            record(
                "transport",
                "late_reply_dropped",
                host,
                ok,
                {"timed_out": timed_out, guard: guarded, "bad_rows_after": bad, "rows_after": int(check_ids.size)},
                {"timed_out": True, guard: True, "bad_rows_after": 0},
                subject=link,
                reason=""
                if ok
                else f"{link}: timed-out request: timed_out={timed_out} {guard}={guarded}, {bad} bad rows after it",
            )
        )
    except (Dsv41Error, TransportError) as exc:
        done = {r["check"] for r in out}
        out += [
            record("transport", nm, host, False, reason=f"{link}: {url}: {exc}", subject=link)
            for nm in names
            if nm not in done
        ]
    finally:
        src.close()
    # refused identity: a table the server does not hold
    try:
        c = open_client(ep, [os.urandom(32)], timeout_s=timeout_ms / 1e3)
        c.close()
        out.append(
            record(
                "transport",
                "refused_identity",
                host,
                False,
                "accepted",
                "refused: wrong_identity",
                reason=f"{link}: {url} accepted a HELLO for a table it does not hold",
                subject=link,
            )
        )
    except Refused as exc:
        ok = exc.status == P.ST_WRONG_IDENTITY
        out.append(
            record(
                "transport",
                "refused_identity",
                host,
                ok,
                f"refused: {exc.reason}",
                "refused: wrong_identity",
                reason="" if ok else f"{link}: refused with {exc.reason}",
                subject=link,
            )
        )
    except TransportError as exc:
        out.append(
            record(
                "transport",
                "refused_identity",
                host,
                False,
                None,
                "refused: wrong_identity",
                reason=f"{link}: {url}: {exc}",
                subject=link,
            )
        )
    return out


# --- exactness -------------------------------------------------------------------------------------


def probe_sweep(
    host: str, url: str, manifest: str, rank: int, tp: int, lookups: int, timeout_ms: int = 1000, seed: int = 0
) -> list[dict]:
    """``exactness.bad_rows[layer L]``: ``dsv41 engram sweep`` (``dsv41.engram.sweep.run_sweep``)
    of this rank over the production URL against the local shards, required mode (a row that
    did not come from the server fails instead of falling back). 0 bad rows and 0 fallbacks per
    layer, and every lookup answered remotely."""
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.sweep import run_sweep

    try:
        m = load_manifest(manifest)
    except Dsv41Error as exc:
        return [
            record(
                "exactness",
                "bad_rows",
                host,
                False,
                None,
                0,
                reason=f"rank {rank}: manifest {manifest}: {exc}",
                subject=f"rank {rank}",
            )
        ]
    layers = [t.layer_id for t in m.tables]
    try:
        rep = run_sweep(m, None, url, tp, rank, lookups=lookups, seed=seed, timeout_ms=timeout_ms, required=True)
    except Dsv41Error as exc:
        return [
            record(
                "exactness",
                "bad_rows",
                host,
                False,
                None,
                0,
                reason=f"rank {rank}: sweep over {url}: {exc}",
                subject=f"rank {rank} layer {L}",
            )
            for L in layers
        ]
    out = []
    for L in layers:
        pl = rep["per_layer"][str(L)]
        ok = pl["bad_rows"] == 0 and pl["lookups"] > 0 and rep["fallbacks"] == 0
        out.append(
            record(
                "exactness",
                "bad_rows",
                host,
                ok,
                {
                    "bad_rows": pl["bad_rows"],
                    "lookups": pl["lookups"],
                    "fallbacks": rep["fallbacks"],
                    "remote": url,
                    "seconds": rep["seconds"],
                },
                0,
                unit="rows",
                subject=f"rank {rank} layer {L}",
                reason=""
                if ok
                else f"rank {rank} layer {L}: {pl['bad_rows']} bad rows of {pl['lookups']}, "
                f"{rep['fallbacks']} fallbacks",
            )
        )
    return out
