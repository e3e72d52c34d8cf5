"""Resident Engram table server (``dsv41 engram serve``).

Start-up order (docs/remote-engram.md): metrics endpoint up (``/ready`` 503) -> every table region
of the manifest loaded into RAM in parallel and its sha256 checked against the manifest ->
only then listen on each ``--listen`` address -> ``--ready-file`` written, ``/ready`` 200.
SIGTERM: stop accepting, drain in-flight requests, remove the ready file, exit 0.

Loading: one reader thread per region (weights and scales of each table) reads the
page-aligned span around the region with O_DIRECT in 8 MiB requests straight into a private
anonymous mmap (transparent huge pages advised: a shared anonymous mapping is shmem, where the
advice does nothing unless shmem THP is on); a hasher thread per region runs sha256 over the
chunks the reader has finished (hashlib releases the GIL), so hashing overlaps reading.  Where O_DIRECT
is refused (EINVAL, e.g. tmpfs) the same reads go through the page cache.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsv41 import fileio
from dsv41.errors import Dsv41Error, VerificationError
from dsv41.transport import protocol as P
from dsv41.transport.server import LATENCY_BUCKETS, RowServer, RowTable
from dsv41.transport.url import Endpoint, parse_url

PAGE = 4096
READ_CHUNK = 8 << 20  # bytes per O_DIRECT read (large aligned requests, docs/engram-spec.md s.8)


@dataclass
class RegionLoad:
    """One region loaded into RAM: ``view`` is uint8[length] inside ``buf`` (an anonymous mmap)."""

    buf: mmap.mmap
    view: np.ndarray
    sha256: str
    direct: bool
    seconds: float


class LoadProgress:
    """Bytes loaded so far / in total (thread-safe), read by the metrics endpoint."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total = 0
        self.done = 0

    def add(self, n: int) -> None:
        """Count ``n`` more region bytes loaded (thread-safe)."""
        with self.lock:
            self.done += n


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    from dsv41.engram.reader import open_table_file  # one open rule for reader and loader

    return open_table_file(path, direct)


def load_region(
    path: str | os.PathLike,
    offset: int,
    length: int,
    direct: bool = True,
    progress: LoadProgress | None = None,
    chunk: int = READ_CHUNK,
) -> RegionLoad:
    """Read ``length`` bytes at ``offset`` of ``path`` into a fresh anonymous mmap, hashing
    (sha256) overlapped with reading.

    The page-aligned span around the region is read with O_DIRECT (buffered where the file
    system refuses O_DIRECT).  Raises ``VerificationError`` if the file ends early, ``Dsv41Error``
    if it cannot be opened or read.
    """
    path = Path(path)
    t0 = time.perf_counter()
    a0 = offset - offset % PAGE
    a1 = -(-(offset + length) // PAGE) * PAGE
    span = max(a1 - a0, PAGE)
    # MAP_PRIVATE: Python's default for mmap(-1, n) is MAP_SHARED, i.e. shmem, and shmem ignores
    # MADV_HUGEPAGE while /sys/kernel/mm/transparent_hugepage/shmem_enabled is "never" (the usual
    # default): measured, 0 kB AnonHugePages and 4 KiB pages for the whole table
    # (docs/benchmarks.md, "Huge pages"). MADV_DONTFORK: a forked child never copies the table.
    buf = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        if hasattr(mmap, advice):
            try:
                buf.madvise(getattr(mmap, advice))
            except OSError:
                pass  # advice the kernel lacks (THP compiled out): only slower TLB behaviour
    mv = memoryview(buf)
    try:
        fd, is_direct = _open(path, direct)
    except FileNotFoundError:
        raise Dsv41Error(f"table file {path} does not exist") from None
    except OSError as exc:
        raise Dsv41Error(f"cannot open table file {path}: {exc.strerror or exc}") from None
    q: queue.Queue = queue.Queue()
    h = hashlib.sha256()
    herr: list[BaseException] = []

    def hasher() -> None:
        # Hash region bytes in file order as the reader completes chunks.
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                lo, hi = item
                lo, hi = max(lo, offset - a0), min(hi, offset - a0 + length)
                if hi > lo:
                    h.update(mv[lo:hi])  # noqa: F821 - the enclosing scope's view, deleted only after this thread is joined
        except BaseException as exc:  # pragma: no cover - hashlib does not fail on bytes
            herr.append(exc)

    ht = threading.Thread(target=hasher, name=f"sha256-{path.name}", daemon=True)
    ht.start()
    need = offset - a0 + length
    pos = 0
    try:
        while pos < need:
            n = min(chunk, span - pos)
            try:
                got = os.preadv(fd, [mv[pos : pos + n]], a0 + pos)
            except OSError as exc:
                if exc.errno == errno.EINVAL and is_direct:
                    os.close(fd)
                    fd, is_direct = _open(path, False)  # O_DIRECT refused at read time
                    continue
                raise Dsv41Error(f"reading {path} at byte {a0 + pos} failed: {exc.strerror or exc}") from None
            if got == 0:
                break
            q.put((pos, pos + got))
            if progress is not None:
                lo, hi = max(pos, offset - a0), min(pos + got, need)
                progress.add(max(0, hi - lo))
            pos += got
    finally:
        q.put(None)
        ht.join()
        os.close(fd)
    if herr:
        raise herr[0]
    if pos < need:
        try:
            size = os.stat(path).st_size
        except OSError:
            size = a0 + pos
        raise VerificationError(
            f"{path}: truncated: {size} bytes, the region [{offset}, {offset + length}) needs {offset + length}"
        )
    view = np.frombuffer(buf, dtype=np.uint8, count=length, offset=offset - a0)
    del mv
    return RegionLoad(buf, view, h.hexdigest(), is_direct, time.perf_counter() - t0)


def load_tables(
    manifest, data_dir: str | os.PathLike, direct: bool = True, progress: LoadProgress | None = None
) -> tuple[list[RowTable], dict]:
    """Load and verify every table of ``manifest`` (a ``Manifest``) from ``data_dir``.

    All regions load in parallel; each region's sha256 must equal the manifest's
    ``weight_sha256`` / ``scale_sha256`` (whose identity ``load_manifest`` already checked).
    Each shard's safetensors header is checked first, as the reference loader checks it, and must
    place every table where the manifest does (``manifest.check_table_header``).
    Returns (tables, report) where report has per-table seconds, bytes and ``direct``.
    Raises ``VerificationError`` naming the file, table and region that differ.
    """
    from dsv41.engram.manifest import check_table_header

    d = Path(data_dir)
    jobs = []
    for t in manifest.tables:
        check_table_header(d / t.file, t)
        if t.row_bytes != P.ROW_BYTES or t.weight_bytes != P.WEIGHT_BYTES or t.scale_bytes != P.SCALE_BYTES:
            raise VerificationError(f"layer {t.layer_id}: row geometry {t.weight_bytes}+{t.scale_bytes} is not 256+8")
        jobs.append((t, "weight", t.weight_offset, t.rows * t.weight_bytes, t.weight_sha256))
        jobs.append((t, "scale", t.scale_offset, t.rows * t.scale_bytes, t.scale_sha256))
    if progress is not None:
        with progress.lock:
            progress.total = sum(j[3] for j in jobs)
    results: dict[int, RegionLoad] = {}
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def run(i: int) -> None:
        t, _, off, length, _ = jobs[i]
        try:
            results[i] = load_region(d / t.file, off, length, direct, progress)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"load-{i}", daemon=True) for i in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    for i, (t, kind, off, length, want) in enumerate(jobs):
        if results[i].sha256 != want:
            raise VerificationError(
                f"layer {t.layer_id} {kind} region of {t.file} bytes [{off}, {off + length}): sha256 "
                f"{results[i].sha256[:16]}... != manifest {want[:16]}..."
            )
    tables, report = [], {"seconds": time.perf_counter() - t0, "tables": []}
    for k, t in enumerate(manifest.tables):
        w, s = results[2 * k], results[2 * k + 1]
        tables.append(
            RowTable(
                identity=P.identity_bytes(t.identity),
                layer_id=t.layer_id,
                weight=w.view.reshape(t.rows, P.WEIGHT_BYTES),
                scale=s.view.reshape(t.rows, P.SCALE_BYTES),
            )
        )
        report["tables"].append(
            {
                "layer_id": t.layer_id,
                "rows": t.rows,
                "bytes": t.rows * P.ROW_BYTES,
                "seconds": max(w.seconds, s.seconds),
                "direct": w.direct and s.direct,
            }
        )
    # the mmaps stay alive through the numpy views' base objects
    return tables, report


class _Collector:
    """Prometheus collector reading the server's counters at scrape time (no per-request cost)."""

    def __init__(self, es: EngramServer) -> None:
        self.es = es

    def collect(self):
        # an unlabelled family takes its one sample as value= (prometheus_client.core)
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        es = self.es
        with es.progress.lock:
            done, total = es.progress.done, es.progress.total
        yield GaugeMetricFamily("dsv41_engram_load_bytes", "Table bytes loaded into RAM so far", value=done)
        yield GaugeMetricFamily("dsv41_engram_load_total_bytes", "Table bytes to load", value=total)
        yield GaugeMetricFamily(
            "dsv41_engram_ready", "1 once loaded, verified and listening", value=1 if es.ready.is_set() else 0
        )
        srv = es.rowserver
        snap = srv.snapshot() if srv is not None else None
        yield CounterMetricFamily(
            "dsv41_engram_requests", "Lookup requests served", value=snap["requests"] if snap else 0
        )
        yield CounterMetricFamily("dsv41_engram_rows_served", "Rows served", value=snap["rows"] if snap else 0)
        c = CounterMetricFamily("dsv41_engram_refusals", "Requests refused, by reason", labels=["reason"])
        for reason, n in sorted((snap or {}).get("refusals", {}).items()):
            c.add_metric([reason], n)
        yield c
        yield CounterMetricFamily(
            "dsv41_engram_nixl_handshakes", "NIXL handshakes answered", value=snap["nixl_handshakes"] if snap else 0
        )
        yield GaugeMetricFamily(
            "dsv41_engram_connections", "Open client connections", value=snap["connections"] if snap else 0
        )
        h = HistogramMetricFamily("dsv41_engram_request_seconds", "Server-side lookup handling time")
        counts = snap["latency_buckets"] if snap else [0] * (len(LATENCY_BUCKETS) + 1)
        acc, buckets = 0, []
        for b, n in zip(LATENCY_BUCKETS, counts, strict=False):
            acc += n
            buckets.append((repr(b), acc))
        acc += counts[-1]
        buckets.append(("+Inf", acc))
        h.add_metric([], buckets, snap["latency_sum"] if snap else 0.0)
        yield h


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ``Dsv41Error`` on bad input."""
    if "://" in text or "@" in text:
        raise Dsv41Error(f"{what} must be HOST:PORT, got {text!r}")
    try:
        ep = parse_url(f"tcp://{text}")
    except Dsv41Error:
        raise Dsv41Error(f"{what} must be HOST:PORT (port 0..65535), got {text!r}") from None
    return ep.host, ep.port


class EngramServer:
    """The table server process's state: load, listen, metrics, drain.

    ``listens``: ``tcp://A:P`` / ``nixl://A:P`` URLs (port 0 = ephemeral); ``metrics``:
    ``A:P`` for the Prometheus ``/metrics`` and ``/ready`` endpoint or None.
    Raises ``Dsv41Error`` on a bad address, ``VerificationError`` when a table differs from the
    manifest.
    """

    def __init__(
        self, manifest, data_dir: str | os.PathLike, listens: list[str], metrics: str | None = None, direct: bool = True
    ) -> None:
        if not listens:
            raise Dsv41Error("serve needs at least one --listen tcp://HOST:PORT or nixl://HOST:PORT")
        self.endpoints: list[Endpoint] = [parse_url(u) for u in listens]
        for ep in self.endpoints:
            if ep.local_host:
                raise Dsv41Error(f"--listen {ep}: a listen address takes no @LOCAL part")
        self.manifest = manifest
        self.data_dir = Path(data_dir)
        self.direct = direct
        self.metrics_addr = parse_hostport(metrics, "--metrics") if metrics else None
        self.progress = LoadProgress()
        self.ready = threading.Event()
        self.rowserver: RowServer | None = None
        self.exporter = None
        self.tables: list[RowTable] = []
        self.report: dict = {}
        self.addresses: list[Endpoint] = []
        self._http = None
        self.metrics_bound: tuple[str, int] | None = None

    def start_metrics(self) -> None:
        """Serve ``/metrics`` (Prometheus text) and ``/ready`` (200 once ready, else 503)."""
        if self.metrics_addr is None:
            return
        from http.server import BaseHTTPRequestHandler
        from urllib.parse import urlsplit

        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        from dsv41 import envs
        from dsv41.httpd import BoundedHTTPServer, bounded_handler, http_error_body

        registry = CollectorRegistry()
        registry.register(_Collector(self))
        es = self

        class Handler(BaseHTTPRequestHandler):
            GET_PATHS = ("/metrics", "/ready")

            def do_GET(self):  # noqa: N802 - http.server API
                path = urlsplit(self.path).path  # a query string (Prometheus params:) changes nothing
                if path == "/metrics":
                    body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
                elif path == "/ready":
                    reason = es.not_ready_reason()
                    body, ctype, code = (
                        (b"ready\n" if reason is None else f"{reason}\n".encode()),
                        "text/plain",
                        200 if reason is None else 503,
                    )
                else:
                    body, ctype, code = (
                        http_error_body(404, f"GET {path}: not found (only /metrics and /ready)"),
                        "application/json",
                        404,
                    )
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keep stderr for real problems
                pass

        host, port = self.metrics_addr
        limits = envs.parse()
        try:
            self._http = BoundedHTTPServer(
                (host, port), bounded_handler(Handler), limits.http_header_timeout_s, limits.metrics_max_connections
            )
        except OSError as exc:
            raise Dsv41Error(f"cannot listen for metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.metrics_bound = self._http.server_address[:2]
        threading.Thread(target=self._http.serve_forever, name="metrics", daemon=True).start()

    def not_ready_reason(self) -> str | None:
        """None once the tables are loaded, verified and listened on; else why not (``/ready`` 503)."""
        return None if self.ready.is_set() else "loading"

    def load(self) -> dict:
        """Load and verify every table (see :func:`load_tables`); returns the load report."""
        self.tables, self.report = load_tables(self.manifest, self.data_dir, self.direct, self.progress)
        return self.report

    def listen(self) -> list[Endpoint]:
        """Listen on every endpoint (tables must be loaded); returns the bound endpoints."""
        if any(ep.scheme == "nixl" for ep in self.endpoints):
            from dsv41.transport.nixl_backend import NixlExporter

            self.exporter = NixlExporter(self.tables)
        self.rowserver = RowServer(self.tables, self.endpoints, nixl_provider=self.exporter)
        try:
            self.addresses = self.rowserver.start()
        except OSError as exc:
            raise Dsv41Error(f"cannot listen: {exc.strerror or exc}") from None
        self.ready.set()
        return self.addresses

    def ready_info(self) -> dict:
        """What the ready file holds: pid, bound URLs, metrics address, load report."""
        return {
            "pid": os.getpid(),
            "listen": [str(a) for a in self.addresses],
            "metrics": f"{self.metrics_bound[0]}:{self.metrics_bound[1]}" if self.metrics_bound else None,
            "implementation": "c++" if self.rowserver is not None and self.rowserver.native else "python",
            "load": self.report,
        }

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Drain and close listeners, clients, NIXL registration and the metrics endpoint."""
        self.ready.clear()
        if self.rowserver is not None:
            self.rowserver.stop(drain_timeout_s)
        if self.exporter is not None:
            self.exporter.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def _is_ready_file(p: Path) -> bool:
    try:
        doc = fileio.loads_json(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(doc, dict) and {"pid", "listen"} <= set(doc)


def clear_stale_ready_file(path: str | os.PathLike) -> None:
    """Prepare ``path`` for :func:`write_ready_file` before loading: its directory must exist;
    an existing ready file (JSON with ``pid`` and ``listen``, a crashed run's) is removed;
    anything else there (a directory, another file) is refused with ``Dsv41Error`` and kept."""
    p = Path(path)
    if not p.parent.is_dir():
        raise Dsv41Error(f"--ready-file {p}: directory {p.parent} does not exist")
    if os.path.lexists(p):
        if not p.is_file() or not _is_ready_file(p):
            raise Dsv41Error(f"--ready-file {p} exists and is not a ready file: refusing to replace it")
        try:
            p.unlink()
        except OSError as exc:
            raise Dsv41Error(f"cannot remove stale ready file {p}: {exc.strerror or exc}") from None


def write_ready_file(path: str | os.PathLike, info: dict) -> None:
    """Write ``info`` as JSON atomically (temp + rename) so a watcher never reads half a file."""
    from dsv41 import fileio

    fileio.atomic_write_json(path, info, "ready file")
