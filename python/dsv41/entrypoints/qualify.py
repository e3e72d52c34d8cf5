"""Hardware qualification (``ansible-playbook qualify.yml``, ``dsv41 qualify ...``): the checks,
their records and the report.

Every check produces one record (:func:`record`)::

    {"id": "links.mtu[ofl0]", "group": "links", "check": "mtu", "subject": "ofl0", "host": "sparkhead",
     "status": "pass" | "fail" | "skipped", "value": ..., "expected": ..., "unit": "bytes",
     "reason": "one line (why it failed or was skipped)", "time": "2026-12-02T01:02:03Z"}

Host-side probes (``dsv41 qualify peers|transport|sweep|serving-host``) run on the host being
qualified, through the inventory's own connection, and print a JSON list of records; controller-side
probes (``dsv41 qualify serving|reconnect|fail-closed``) read rank 0's API and the servers' metrics;
``playbooks/qualify.yml`` gathers every record and the ``qualify_report`` module calls
:func:`write_report`, which writes ``<out>/report.json`` and ``<out>/summary.md``. A check that
needs what a host lacks (an RDMA device, vLLM, a GPU, a container) is ``skipped`` with the reason,
never passed; a host that could not be reached fails every check it owed.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from dsv41 import envs, fileio
from dsv41.errors import Dsv41Error

GROUPS = ("links", "transport", "exactness", "serving", "drafter")
PLACEHOLDER = "CHANGE_ME"
#: 64 MiB: the published link probe's transfer size (README "Qualify on hardware").
BANDWIDTH_BYTES = 64 << 20


class QualifyError(Dsv41Error):
    """Bad input to a qualification (inventory placeholder, report directory, arguments)."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record(group: str, check: str, host: str, ok: bool | None, value: Any = None, expected: Any = None,
           *, unit: str = "", reason: str = "", subject: str = "") -> dict:
    """One check record (module docstring). ``ok``: True = pass, False = fail, None = skipped
    (``reason`` required: a skipped check always says why)."""
    if group not in GROUPS:
        raise ValueError(f"unknown group {group!r}")
    if ok is None and not reason:
        raise ValueError(f"skipped check {group}.{check} needs a reason")
    cid = f"{group}.{check}" + (f"[{subject}]" if subject else "")
    return {"id": cid, "group": group, "check": check, "subject": subject, "host": host,
            "status": "pass" if ok is True else "fail" if ok is False else "skipped",
            "value": value, "expected": expected, "unit": unit, "reason": reason, "time": _now()}


def skipped(group: str, checks: Iterable[str], host: str, reason: str, subject: str = "") -> list[dict]:
    """The same skip reason for several checks."""
    return [record(group, c, host, None, reason=reason, subject=subject) for c in checks]


# --- bad input: before any step runs -------------------------------------------------------------

def find_placeholders(doc: Any, placeholder: str = PLACEHOLDER, path: str = "") -> list[str]:
    """Dotted paths (``sparkhead.dsv41_links[0].name``) of every string in ``doc`` (nested dicts
    and lists) that contains ``placeholder``."""
    out: list[str] = []
    if isinstance(doc, str):
        if placeholder in doc:
            out.append(path or "(value)")
    elif isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(find_placeholders(v, placeholder, f"{path}.{k}" if path else str(k)))
    elif isinstance(doc, (list, tuple)):
        for i, v in enumerate(doc):
            out.extend(find_placeholders(v, placeholder, f"{path}[{i}]"))
    return out


def prepare_report_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` (parents too) and prove it writable by writing and removing a file.
    QualifyError (one line) when it exists already with a report in it, or cannot be created or
    written."""
    p = Path(out_dir)
    if (p / "report.json").exists():
        raise QualifyError(f"report directory {p} already holds a report; pick another id")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".write-test"
        fileio.atomic_write(probe, "ok\n", "the report directory's write test", error=QualifyError)
        probe.unlink()
    except OSError as exc:
        raise QualifyError(f"report directory {p} cannot be written: {exc.strerror or exc}") from None
    return p


def preflight(hosts: dict, out_dir: str | os.PathLike, placeholder: str = PLACEHOLDER) -> Path:
    """Refuse a qualification before any host is touched: ``hosts`` ``{host: {var: value}}`` (the
    inventory variables a qualification reads) must hold no ``placeholder`` and at least one
    Spark and one offload host; the report directory must be writable. Returns the directory.
    QualifyError, one line, otherwise."""
    if not hosts:
        raise QualifyError("inventory has no spark and offload hosts")
    found = find_placeholders(hosts, placeholder)
    if found:
        raise QualifyError(f"inventory still has {placeholder} in {len(found)} place(s): {', '.join(found)}")
    return prepare_report_dir(out_dir)


# --- links -----------------------------------------------------------------------------------------

def from_links(host: str, result: dict) -> list[dict]:
    """Records of one host from an ``rdma_link`` module result (its ``checks``). A result without
    checks (the module did not run: unreachable, crashed) is one failed record with its message."""
    checks = result.get("checks")
    if not checks:
        msg = result.get("msg") or "rdma_link did not run"
        return [record("links", "rdma_link", host, False, reason=f"{host}: {msg}".replace("\n", " "))]
    out = []
    units = {"mtu": "bytes", "rdma_active_mtu": "bytes"}
    for c in checks:
        src = c.get("rdma_source")
        reason = c.get("reason") or ""
        if c["check"].startswith(("rdma", "roce")) and src and src not in reason:
            reason = f"{reason} (read through {src})" if reason else f"read through {src}"
        r = record("links", c["check"], host, c["ok"], c.get("value"), c.get("expected"),
                   unit=units.get(c["check"], ""), reason=reason, subject=c["link"])
        out.append(r)
    return out


def probe_peers(host: str, links: list[dict], count: int = 3, interval_s: float = 0.2, timeout_s: float = 1.0,
                ping: Callable | None = None) -> list[dict]:
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
            out.append(record("links", "peer_reachable", host, None, reason="no peer_address in the inventory",
                              subject=name))
            continue
        try:
            h = ping(peer, count=count, interval=interval_s, timeout=timeout_s, source=link.get("address"),
                     privileged=True)
            ok = h.packets_received > 0
            out.append(record("links", "peer_reachable", host, ok,
                              {"rtt_avg_ms": round(h.avg_rtt, 3), "received": h.packets_received, "sent": h.packets_sent},
                              f"{peer} answers", reason="" if ok else f"{name}: {peer} did not answer "
                              f"{h.packets_sent} echo requests from {link.get('address')}", subject=name))
        except (ICMPLibError, OSError) as exc:
            out.append(record("links", "peer_reachable", host, False, None, f"{peer} answers",
                              reason=f"{name}: ping {peer}: {exc}", subject=name))
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


def probe_transport(host: str, link: str, url: str, manifest: str, rank: int, tp: int, *, backend: str,
                    p50_max_us: float, p99_max_us: float, gbps_min: float, iters: int = 2000,
                    bw_bytes: int = BANDWIDTH_BYTES, bw_repeats: int = 5, start_at: float | None = None,
                    timeout_ms: int = 1000, seed: int = 0, sleep=time.sleep) -> list[dict]:
    """Transport checks of one rank over its own link, with the project's client
    (``dsv41.engram.client.RemoteRowSource``, required mode: no local fallback can hide a failure):

    - ``backend``: the URL's scheme is the production backend ``backend`` (nixl over RDMA, else tcp);
    - ``latency_p50`` / ``latency_p99`` (us): ``iters`` decode-size lookups (one token: this
      rank's columns of every Engram layer, in one ``lookup_layers`` call) against ceilings;
    - ``bandwidth`` (Gb/s): ``bw_bytes`` (64 MiB) of rows of one layer per transfer, median of
      ``bw_repeats``, against ``gbps_min``; the measurement starts at epoch ``start_at`` when given
      (both ranks together: the two links at once); ``value`` also carries start and end times;
    - ``refused_identity``: a HELLO naming a table the server does not hold is refused (``wrong_identity``);
    - ``late_reply_dropped``: a request timed out on purpose (1 M rows in 10 us): over tcp its
      connection is closed (its late reply is never read), over nixl its staging slot is
      quarantined; the next request returns rows byte-identical to the local shards.
    """
    import numpy as np

    from dsv41.engram.client import RemoteRowSource
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.reader import LocalRowReader
    from dsv41.engram.layout import layout_from_manifest
    from dsv41.transport import Refused, TransportError, TransportTimeout, open_client, parse_url
    from dsv41.transport import protocol as P

    out: list[dict] = []
    ep = parse_url(url)
    out.append(record("transport", "backend", host, ep.scheme == backend, ep.scheme, backend,
                      reason="" if ep.scheme == backend else f"{link}: {url} uses {ep.scheme}, production backend is {backend}",
                      subject=link))
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
        return out + [record("transport", n, host, False, reason=f"{link}: {url}: {exc}", subject=link) for n in names] + \
            [record("transport", "refused_identity", host, False, reason=f"{link}: {url}: {exc}", subject=link)]
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
        out.append(record("transport", "latency_p50", host, p50 <= p50_max_us, round(p50, 1), f"<= {p50_max_us}",
                          unit="us", subject=link, reason="" if p50 <= p50_max_us else
                          f"{link}: p50 {p50:.1f} us of {iters} decode lookups ({ncol} rows x {len(layers)} layers) over {p50_max_us} us"))
        out.append(record("transport", "latency_p99", host, p99 <= p99_max_us, round(p99, 1), f"<= {p99_max_us}",
                          unit="us", subject=link, reason="" if p99 <= p99_max_us else
                          f"{link}: p99 {p99:.1f} us of {iters} decode lookups over {p99_max_us} us"))
        # bandwidth: 64 MiB of one layer's rows per transfer
        n = max(1, bw_bytes // layout.row_bytes)
        lo, hi = ranges[0]
        ids = rng.integers(lo, hi, n, dtype=np.int64)
        buf = np.empty((n, layout.row_bytes), dtype=np.uint8)
        src.lookup(layers[0], ids[:1024])  # warm
        if start_at is not None:
            sleep(max(0.0, start_at - time.time()))
        t_start, secs = time.time(), []
        for _ in range(bw_repeats):
            t0 = time.perf_counter()
            src.lookup(layers[0], ids, out=buf)
            secs.append(time.perf_counter() - t0)
        t_end = time.time()
        gbps = n * layout.row_bytes * 8 / statistics.median(secs) / 1e9
        out.append(record("transport", "bandwidth", host, gbps >= gbps_min,
                          {"gbps": round(gbps, 2), "bytes": int(n * layout.row_bytes), "repeats": bw_repeats,
                           "start": round(t_start, 3), "end": round(t_end, 3)}, f">= {gbps_min}", unit="Gb/s",
                          subject=link, reason="" if gbps >= gbps_min else
                          f"{link}: {gbps:.2f} Gb/s for {n * layout.row_bytes} B transfers, floor {gbps_min}"))
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
        out.append(record("transport", "late_reply_dropped", host, ok,
                          {"timed_out": timed_out, guard: guarded, "bad_rows_after": bad, "rows_after": int(check_ids.size)},
                          {"timed_out": True, guard: True, "bad_rows_after": 0}, subject=link,
                          reason="" if ok else f"{link}: timed-out request: timed_out={timed_out} "
                          f"{guard}={guarded}, {bad} bad rows after it"))
    except (Dsv41Error, TransportError) as exc:
        done = {r["check"] for r in out}
        out += [record("transport", nm, host, False, reason=f"{link}: {url}: {exc}", subject=link)
                for nm in names if nm not in done]
    finally:
        src.close()
    # refused identity: a table the server does not hold
    try:
        c = open_client(ep, [os.urandom(32)], timeout_s=timeout_ms / 1e3)
        c.close()
        out.append(record("transport", "refused_identity", host, False, "accepted", "refused: wrong_identity",
                          reason=f"{link}: {url} accepted a HELLO for a table it does not hold", subject=link))
    except Refused as exc:
        ok = exc.status == P.ST_WRONG_IDENTITY
        out.append(record("transport", "refused_identity", host, ok, f"refused: {exc.reason}", "refused: wrong_identity",
                          reason="" if ok else f"{link}: refused with {exc.reason}", subject=link))
    except TransportError as exc:
        out.append(record("transport", "refused_identity", host, False, None, "refused: wrong_identity",
                          reason=f"{link}: {url}: {exc}", subject=link))
    return out


# --- exactness -------------------------------------------------------------------------------------

def probe_sweep(host: str, url: str, manifest: str, rank: int, tp: int, lookups: int, timeout_ms: int = 1000,
                seed: int = 0) -> list[dict]:
    """``exactness.bad_rows[layer L]``: ``dsv41 engram sweep`` (``dsv41.engram.sweep.run_sweep``)
    of this rank over the production URL against the local shards, required mode (a row that
    did not come from the server fails instead of falling back). 0 bad rows and 0 fallbacks per
    layer, and every lookup answered remotely."""
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.sweep import run_sweep

    try:
        m = load_manifest(manifest)
    except Dsv41Error as exc:
        return [record("exactness", "bad_rows", host, False, None, 0, reason=f"rank {rank}: manifest {manifest}: {exc}",
                       subject=f"rank {rank}")]
    layers = [t.layer_id for t in m.tables]
    try:
        rep = run_sweep(m, None, url, tp, rank, lookups=lookups, seed=seed, timeout_ms=timeout_ms, required=True)
    except Dsv41Error as exc:
        return [record("exactness", "bad_rows", host, False, None, 0, reason=f"rank {rank}: sweep over {url}: {exc}",
                       subject=f"rank {rank} layer {L}") for L in layers]
    out = []
    for L in layers:
        pl = rep["per_layer"][str(L)]
        ok = pl["bad_rows"] == 0 and pl["lookups"] > 0 and rep["fallbacks"] == 0
        out.append(record("exactness", "bad_rows", host, ok,
                          {"bad_rows": pl["bad_rows"], "lookups": pl["lookups"], "fallbacks": rep["fallbacks"],
                           "remote": url, "seconds": rep["seconds"]}, 0, unit="rows", subject=f"rank {rank} layer {L}",
                          reason="" if ok else f"rank {rank} layer {L}: {pl['bad_rows']} bad rows of {pl['lookups']}, "
                          f"{rep['fallbacks']} fallbacks"))
    return out


# --- serving ---------------------------------------------------------------------------------------

def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` as ``{key: bytes}`` (kB values times 1024)."""
    out = {}
    for line in fileio.read_text(path, "the kernel's meminfo").splitlines():
        m = re.match(r"^(\w+):\s+(\d+)(?:\s+kB)?$", line.strip())
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if line.strip().endswith("kB") else 1)
    return out


def probe_serving_host(host: str, rank: int, *, runtime: str, env_file: str, required: bool, pinned_max_bytes: int,
                       image: str = "", container: str = "dsv41-serve", container_runtime: str = "docker",
                       unit: str = "dsv41-serve", meminfo_path: str = "/proc/meminfo",
                       run: Callable | None = None) -> list[dict]:
    """Serving checks of one Spark that read only this host:

    - ``required_mode``: ``DSV41_ENGRAM_REMOTE_REQUIRED`` of the Engram env file is ``required``;
      with vLLM also ``dsv41 overlay active`` in the container's log;
    - ``host_memory``: ``Mlocked`` + ``Unevictable`` (bytes) at most ``pinned_max_bytes`` (the
      overlay's staging, far below the ~94 GiB per rank vLLM pins without it);
    - with ``runtime == 'vllm'``: ``image_digest`` (the running container's image is ``image``,
      pinned by ``@sha256:``), ``overlay_contract`` (plugin importable and ``contract.check_files``
      returns ``[]`` inside the container), ``piecewise`` (the unit carries
      ``"cudagraph_mode": "PIECEWISE"``); with the lab runtime these are skipped with the reason.
    """
    import subprocess

    run = run or (lambda argv: subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False))
    out = []
    env = read_env_file(env_file)
    try:
        val = "1" if envs.parse(env).engram_remote_required else "0"
    except envs.ConfigError as exc:
        val = f"invalid ({exc})"
    want = "1" if required else "0"
    out.append(record("serving", "required_mode", host, val == want, val, want, subject=f"rank {rank}",
                      reason="" if val == want else f"rank {rank}: {env_file} DSV41_ENGRAM_REMOTE_REQUIRED={val}, expected {want}"))
    mi = meminfo(meminfo_path)
    pinned = max(mi.get("Mlocked", 0), mi.get("Unevictable", 0))
    ok = pinned <= pinned_max_bytes
    out.append(record("serving", "host_memory", host, ok, {"mlocked": mi.get("Mlocked"), "unevictable": mi.get("Unevictable")},
                      f"<= {pinned_max_bytes}", unit="bytes", subject=f"rank {rank}",
                      reason=("lab: the simulated hosts share one kernel, so this is the machine's figure" if runtime == "lab" and ok
                              else "" if ok else f"rank {rank}: {pinned} B pinned, more than {pinned_max_bytes} B")))
    names = ("image_digest", "overlay_contract", "piecewise")
    if runtime != "vllm":
        return out + skipped("serving", names, host, f"serve_runtime {runtime}: no vLLM container on this host",
                             subject=f"rank {rank}")
    r = run([container_runtime, "inspect", "--format", "{{.Config.Image}}", container])
    running = r.stdout.strip() if r.returncode == 0 else None
    ok = running == image and "@sha256:" in image
    out.append(record("serving", "image_digest", host, ok, running, image, subject=f"rank {rank}",
                      reason="" if ok else f"rank {rank}: container {container} runs {running or 'nothing'}, expected {image} (pinned by digest)"))
    code = ("from dsv41.overlay import contract as C; import json; "
            "print(json.dumps(C.check_files(C.load(), C.installed_vllm_root(), C.installed_version())))")
    r = run([container_runtime, "exec", container, "python3", "-c", code])
    try:
        bad = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (ValueError, IndexError):
        bad = None
    ok = bad == []
    out.append(record("serving", "overlay_contract", host, ok, bad if bad is not None else (r.stderr or "").strip()[-200:], [],
                      subject=f"rank {rank}", reason="" if ok else f"rank {rank}: overlay contract inside {container}: {bad}"))
    r = run(["systemctl", "cat", unit])
    modes = re.findall(r'"cudagraph_mode"\s*:\s*"([A-Z_]+)"', r.stdout or "")
    ok = modes == ["PIECEWISE"] or (bool(modes) and set(modes) == {"PIECEWISE"})
    out.append(record("serving", "piecewise", host, ok, modes, ["PIECEWISE"], subject=f"rank {rank}",
                      reason="" if ok else f"rank {rank}: {unit} cudagraph_mode {modes or 'absent'}"))
    r = run([container_runtime, "logs", "--tail", "2000", container])
    active = "dsv41 overlay active" in (r.stdout or "") + (r.stderr or "")
    out.append(record("serving", "overlay_active", host, active, active, True, subject=f"rank {rank}",
                      reason="" if active else f"rank {rank}: no 'dsv41 overlay active' in {container}'s log"))
    return out


def _completions(api_url: str, n: int, timeout_s: float = 60.0) -> tuple[int, list[str]]:
    """Send ``n`` short completions to rank 0; (how many succeeded, error lines)."""
    import httpx

    from dsv41.harness.refs import served_model

    model = served_model(api_url)
    ok, errors = 0, []
    with httpx.Client(timeout=timeout_s, trust_env=False) as c:
        for i in range(n):
            try:
                r = c.post(api_url.rstrip("/") + "/v1/completions",
                           json={"model": model, "prompt": f"qualification traffic {i}: the", "max_tokens": 8, "temperature": 0})
                if r.status_code == 200:
                    ok += 1
                else:
                    errors.append(f"HTTP {r.status_code}: {r.text[:120]}")
            except httpx.HTTPError as exc:
                errors.append(str(exc))
    return ok, errors


def _engine(api_url: str) -> dict:
    from dsv41.entrypoints.status import engine_counters
    from dsv41.harness.refs import fetch_metrics_text

    return engine_counters(fetch_metrics_text(api_url.rstrip("/") + "/metrics"))


def probe_serving(api_url: str, refs_path: str, *, host: str, ranks: list[str], interval_s: float = 10.0,
                  requests: int = 8) -> list[dict]:
    """Controller-side serving checks: ``counters[rank R]`` (Engram lookups, rows and remote rows
    grow on each rank over ``interval_s`` seconds of traffic, fallbacks, transport errors and refusals stay 0)
    and ``greedy_refs`` (6/6 identical to the recorded references, ``dsv41.harness.refs``)."""
    from dsv41.harness import refs

    out = []
    try:
        before = _engine(api_url)
        t0 = time.monotonic()
        sent, errors = 0, []
        while True:
            k, e = _completions(api_url, requests)
            sent, errors = sent + k, errors + e
            if time.monotonic() - t0 >= interval_s:
                break
        after = _engine(api_url)
        secs = time.monotonic() - t0
    except Dsv41Error as exc:
        return [record("serving", "counters", host, False, reason=f"{api_url}: {exc}", subject=f"rank {r}") for r in ranks] + \
            [record("serving", "greedy_refs", host, False, reason=f"{api_url}: {exc}")]
    for r in ranks:
        b, a = before["engram"].get(r, {}), after["engram"].get(r)
        if a is None:
            out.append(record("serving", "counters", host, False, None, "growing, 0 fallbacks", subject=f"rank {r}",
                              reason=f"rank {r}: no Engram counters on {api_url}/metrics"))
            continue
        # remote_rows is reported by the vLLM overlay's counters; the lab engine's /metrics has no such series
        keys = [k for k in ("lookups", "rows", "remote_rows", "fallbacks", "transport_errors", "refusals")
                if k in a or k != "remote_rows"]
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in keys}
        grow = [k for k in ("lookups", "rows") if d[k] <= 0]
        if "remote_rows" in d and d["remote_rows"] <= 0:
            grow.append("remote_rows")
        bad = [k for k in ("fallbacks", "transport_errors", "refusals") if d[k] != 0]
        ok = not grow and not bad and sent > 0
        out.append(record("serving", "counters", host, ok, {k: int(v) for k, v in d.items()} | {"seconds": round(secs, 1), "requests": sent},
                          "lookups/rows grow; fallbacks, transport_errors, refusals 0", subject=f"rank {r}",
                          reason="" if ok else f"rank {r} over {secs:.0f} s: " + "; ".join(
                              [f"{k} did not grow" for k in grow] + [f"{k} +{int(d[k])}" for k in bad]
                              + ([f"no request succeeded ({errors[:1]})"] if sent == 0 else []))))
    try:
        cmp = refs.verify(api_url, refs.load_refs(refs_path))
        ok = cmp.identical == cmp.total == 6
        out.append(record("serving", "greedy_refs", host, ok, f"{cmp.identical}/{cmp.total}", "6/6",
                          reason="" if ok else f"greedy references from {refs_path}: {cmp.summary()}"))
    except Dsv41Error as exc:
        out.append(record("serving", "greedy_refs", host, False, None, "6/6", reason=f"greedy references: {exc}"))
    return out


def probe_reconnect(api_url: str, *, host: str, ranks: list[str], requests: int = 16, wait_s: float = 30.0) -> list[dict]:
    """After the table server was restarted (the playbook restarts it and waits for /ready just
    before): traffic until every rank counts a reconnect and remote lookups again with no
    fallback in the last round (``transport.reconnect[rank R]``), within ``wait_s`` seconds."""
    out = []
    try:
        base = _engine(api_url)
        deadline = time.monotonic() + wait_s
        state: dict = {}
        while True:
            before = _engine(api_url)
            _completions(api_url, requests)
            after = _engine(api_url)
            for r in ranks:
                a, b, z = after["engram"].get(r, {}), before["engram"].get(r, {}), base["engram"].get(r, {})
                state[r] = {"reconnects": int(a.get("reconnects", 0) - z.get("reconnects", 0)),
                            "fallbacks_during_restart": int(a.get("fallbacks", 0) - z.get("fallbacks", 0)),
                            "last_round_lookups": int(a.get("lookups", 0) - b.get("lookups", 0)),
                            "last_round_fallbacks": int(a.get("fallbacks", 0) - b.get("fallbacks", 0))}
            if all(s["last_round_lookups"] > 0 and s["last_round_fallbacks"] == 0 for s in state.values()) \
                    or time.monotonic() > deadline:
                break
    except Dsv41Error as exc:
        return [record("transport", "reconnect", host, False, reason=f"{api_url}: {exc}", subject=f"rank {r}") for r in ranks]
    for r in ranks:
        s = state.get(r, {})
        ok = bool(s) and s["last_round_lookups"] > 0 and s["last_round_fallbacks"] == 0
        out.append(record("transport", "reconnect", host, ok, s, "remote lookups again, 0 fallbacks", subject=f"rank {r}",
                          reason="" if ok else f"rank {r}: not serving remote rows {wait_s:.0f} s after the table server restart: {s}"))
    return out


def probe_fail_closed(api_url: str, refs_path: str, *, host: str, requests: int = 8) -> list[dict]:
    """With the drafter worker stopped (by the playbook, just before): requests still succeed,
    rank 0 counts fail-closed drafting rounds and no identity refusal, and the greedy references
    stay 6/6 (``drafter.fail_closed``)."""
    from dsv41.harness import refs

    try:
        before = _engine(api_url)
        ok_n, errors = _completions(api_url, requests)
        after = _engine(api_url)
        cmp = refs.verify(api_url, refs.load_refs(refs_path))
        same, total = cmp.identical, cmp.total
    except Dsv41Error as exc:
        return [record("drafter", "fail_closed", host, False, reason=f"{api_url}: {exc}")]
    fc = int(after["drafter"].get("fail_closed_rounds", 0) - before["drafter"].get("fail_closed_rounds", 0))
    ok = ok_n == requests and fc > 0 and same == total == 6
    return [record("drafter", "fail_closed", host, ok,
                   {"requests_ok": ok_n, "requests": requests, "fail_closed_rounds": fc, "greedy_refs": f"{same}/{total}"},
                   {"requests_ok": requests, "fail_closed_rounds": "> 0", "greedy_refs": "6/6"},
                   reason="" if ok else f"drafter worker stopped: {ok_n}/{requests} requests ok, {fc} fail-closed rounds, "
                   f"refs {same}/{total}" + (f" ({errors[0]})" if errors else ""))]


def probe_drafter_identity(worker: dict | None, expected: dict | None, *, host: str) -> list[dict]:
    """``drafter.worker_identity``: the worker's drafter / Markov / target identities (its
    ``/metrics``, ``dsv41 drafter status``) equal rank 0's drafter files (``dsv41 drafter identity``)."""
    if not worker or not expected:
        return [record("drafter", "worker_identity", host, False, worker, expected,
                       reason="drafter worker or rank 0's drafter files could not be read")]
    keys = ("drafter", "markov", "target")
    got = {k: (worker.get("identities") or {}).get(k) for k in keys}
    want = {k: expected.get(k) for k in keys}
    ok = got == want and all(want.values())
    return [record("drafter", "worker_identity", host, ok, got, want,
                   reason="" if ok else "worker identities differ from rank 0's drafter files: " +
                   ", ".join(k for k in keys if got[k] != want[k]))]


def run_vllm_tiny(script: str, config: str, timeout_s: float = 3600.0, host: str = "localhost") -> dict:
    """``serving.vllm_tiny``: ``tools/qualify_vllm_tiny.sh`` (four ``vllm serve`` runs of a tiny
    DeepSeek-V4.1-shaped model: overlay inert, FULL graphs refused, remote rows, exact local
    fallback with identical greedy text). Skipped without ``vllm`` on PATH or without a CUDA GPU
    (``nvidia-smi -L`` lists none); the record keeps the script's last lines."""
    import shutil
    import subprocess

    if shutil.which("vllm") is None:
        return record("serving", "vllm_tiny", host, None, reason="no vllm on PATH on this host")
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False) if shutil.which("nvidia-smi") else None
    if gpus is None or gpus.returncode != 0 or "GPU" not in gpus.stdout:
        return record("serving", "vllm_tiny", host, None, reason="no CUDA GPU on this host (nvidia-smi -L)")
    if not Path(config).is_file():
        raise QualifyError(f"--config {config}: no such file")
    try:
        r = subprocess.run(["bash", script], env={**os.environ, "REAL_CONFIG": config}, capture_output=True, text=True,
                           timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return record("serving", "vllm_tiny", host, False, None, "exit 0", reason=f"{script} ran past {timeout_s:.0f} s")
    tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-8:]
    return record("serving", "vllm_tiny", host, r.returncode == 0, tail, "exit 0, identical greedy text: True",
                  reason="" if r.returncode == 0 else f"{script} exit {r.returncode}: {tail[-1] if tail else ''}")


def bandwidth_both(checks: list[dict], gbps_min: float) -> list[dict]:
    """``transport.bandwidth_both``: the sum of the per-link 64 MiB rates measured at the same
    time (every Spark's ``transport.bandwidth`` starts at the same epoch second); the value also
    gives the overlap of their measurement windows (fraction of the shorter one). Fails below
    ``gbps_min`` or with windows overlapping less than half. [] without two measured links."""
    bw = [c for c in checks if c["group"] == "transport" and c["check"] == "bandwidth" and isinstance(c.get("value"), dict)]
    if len(bw) < 2:
        return []
    total = sum(c["value"]["gbps"] for c in bw)
    start = max(c["value"]["start"] for c in bw)
    end = min(c["value"]["end"] for c in bw)
    shortest = min(c["value"]["end"] - c["value"]["start"] for c in bw) or 1e-9
    overlap = max(0.0, end - start) / shortest
    ok = total >= gbps_min and overlap >= 0.5
    links = " + ".join(f"{c['host']}:{c['subject']}" for c in bw)
    return [record("transport", "bandwidth_both", "localhost", ok,
                   {"gbps": round(total, 2), "links": links, "overlap": round(min(overlap, 1.0), 2)}, f">= {gbps_min}",
                   unit="Gb/s", subject="both links", reason="" if ok else
                   f"both links at once: {total:.2f} Gb/s (floor {gbps_min}), windows overlapping {overlap:.0%}")]


# --- the report ------------------------------------------------------------------------------------

def records_from_step(host: str, step: dict) -> list[dict]:
    """Records of one playbook step of ``host``.

    ``step``: ``{"group", "checks": [names], "subject", "kind": "command" | "rdma_link",
    "skip_reason": str, "result": <the registered task result>}``. A step Ansible skipped (its
    ``when`` false: check mode, no such component, the lab) gives ``skipped`` records with
    ``skip_reason``; a command that printed records gives those; one that failed (exit != 0, one
    ``dsv41: error:`` line) fails every check it owed with that line."""
    res = step.get("result") or {}
    group, subject = step["group"], step.get("subject", "")
    names = step.get("checks") or [step.get("name", "step")]
    if res.get("skipped") or not res:
        reason = step.get("skip_reason") or "not run in this play (--tags / --skip-tags left it out)"
        return skipped(group, names, host, reason, subject=subject)
    if step.get("kind") == "rdma_link":
        return from_links(host, res)
    if res.get("unreachable"):
        return [record(group, n, host, False, reason=f"{host}: unreachable: {res.get('msg', '')}"[:300], subject=subject)
                for n in names]
    if res.get("rc") == 0:
        try:
            recs = json.loads((res.get("stdout") or "").strip().splitlines()[-1])
            if isinstance(recs, list) and all(isinstance(r, dict) and "status" in r for r in recs):
                return recs
        except (ValueError, IndexError):
            pass
        why = "printed no records"
    else:
        lines = [ln for ln in (res.get("stderr") or res.get("msg") or "").splitlines() if ln.strip()]
        why = (lines[-1] if lines else f"exit {res.get('rc')}").strip()
    return [record(group, n, host, False, reason=f"{step.get('name', group)}: {why}"[:400], subject=subject) for n in names]


def assemble(hosts: dict[str, Any], *, controller: list[dict] | None = None, meta: dict) -> dict:
    """The report from the playbook's raw results.

    ``hosts``: ``{host: {"version": <registered "dsv41 version --json"> | None, "done": bool,
    "steps": [step, ...]}}`` (:func:`records_from_step`). A host whose version probe is missing
    or unreachable fails one ``links.reachable`` check naming why; a host that did not reach the
    end of its steps fails ``links.finished``. ``controller``: steps run on the controller.
    ``meta``: id, inventory, started, expectations, check_mode. Returns
    ``{"result": "PASS"|"FAIL", "counts", "failed": ["<id>@<host>"...], "reasons", "checks", "versions", ...meta}``.
    """
    checks: list[dict] = []
    versions: dict[str, Any] = {}
    for h, raw in hosts.items():
        raw = raw or {}
        v = raw.get("version") or {}
        if not v or v.get("unreachable") or v.get("skipped"):
            msg = str(v.get("msg") or "not reached").replace("\n", " ")[:300]
            checks.append(record("links", "reachable", h, False, None, "reachable", reason=f"{h}: unreachable: {msg}"))
            continue
        try:
            versions[h] = json.loads(v.get("stdout") or "{}")
        except ValueError:
            versions[h] = {"error": (v.get("stderr") or "")[-200:]}
        for step in raw.get("steps") or []:
            checks.extend(records_from_step(h, step))
        if not raw.get("done"):
            checks.append(record("links", "finished", h, False, None, "every step ran",
                                 reason=f"{h}: stopped before its last step (a task failed or the host went away)"))
    exp = meta.get("expectations") or {}
    if exp.get("bandwidth_both_gbps_min") not in (None, ""):
        checks.extend(bandwidth_both(checks, float(exp["bandwidth_both_gbps_min"])))
    for step in controller or []:
        checks.extend(records_from_step("localhost", step))
    counts = {s: sum(1 for c in checks if c["status"] == s) for s in ("pass", "fail", "skipped")}
    failed = [f"{c['id']}@{c['host']}" for c in checks if c["status"] == "fail"]
    return {**meta, "versions": versions, "result": "FAIL" if failed or not checks else "PASS", "counts": counts,
            "failed": failed, "reasons": [c["reason"] for c in checks if c["status"] == "fail"], "checks": checks,
            "finished": _now()}


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(", ", ": "))
    return str(v)


def render_summary(report: dict) -> str:
    """``summary.md``: verdict, failed checks with reasons, then one table per group."""
    c = report["counts"]
    lines = [f"# Qualification {report.get('id', '')}: {report['result']}", "",
             f"- inventory: `{report.get('inventory', '')}`; started {report.get('started', '')}, finished {report.get('finished', '')}",
             f"- checks: {c['pass']} pass, {c['fail']} fail, {c['skipped']} skipped"
             + (" (check mode: checks that change state were skipped)" if report.get("check_mode") else ""),
             f"- versions: {_fmt(report.get('versions', {}))}", ""]
    if report["failed"]:
        lines += ["## Failed", ""] + [f"- `{c['id']}` on {c['host']}: {c['reason']}" for c in report["checks"]
                                      if c["status"] == "fail"] + [""]
    for g in GROUPS:
        rows = [x for x in report["checks"] if x["group"] == g]
        if not rows:
            continue
        lines += [f"## {g}", "", "| check | host | status | value | expected | unit | reason / note | time |",
                  "|---|---|---|---|---|---|---|---|"]
        for x in rows:
            cells = [x["id"], x["host"], x["status"].upper() if x["status"] == "fail" else x["status"], _fmt(x["value"]),
                     _fmt(x["expected"]), x["unit"], x["reason"], x["time"]]
            lines.append("| " + " | ".join(s.replace("|", "\\|") for s in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict, out_dir: str | os.PathLike) -> dict:
    """Write ``report.json`` and ``summary.md`` into ``out_dir`` (already prepared by
    :func:`preflight`); returns ``{"report", "summary"}`` paths. QualifyError when it cannot."""
    p = Path(out_dir)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fileio.atomic_write_json(p / "report.json", report, "the qualification report", error=QualifyError)
        fileio.atomic_write(p / "summary.md", render_summary(report) + "\n", "the qualification summary",
                            error=QualifyError)
    except OSError as exc:
        raise QualifyError(f"report directory {p} cannot be written: {exc.strerror or exc}") from None
    return {"report": str(p / "report.json"), "summary": str(p / "summary.md")}


def failure_line(report: dict) -> str:
    """One line naming each failed check: ``qualification FAIL: links.mtu[ofl0]@sparkhead, ...``."""
    return f"qualification {report['result']}: " + (", ".join(report["failed"]) if report["failed"] else
                                                      f"{report['counts']['pass']} checks passed, {report['counts']['skipped']} skipped")
