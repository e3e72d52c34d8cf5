"""The operations exporter (``dsv41 monitor exporter``): what Prometheus cannot scrape from the
services themselves, as gauges on ``/metrics``, read at scrape time.

* ``dsv41_admission_held`` (1 while rank 0 holds admission, from its ``GET /is_paused``; the lab
  engine and vLLM's admission fence answer it), ``dsv41_admission_held_since_seconds`` (Unix s,
  0 while open), ``dsv41_admission_up`` (1 when ``/is_paused`` answered in JSON);
* ``dsv41_window_active`` (1 while the promotion journal's last operation is a window without
  ``done``: window.yml journals ``begin`` right after its snapshot and ``done`` after the restore is
  verified) and ``dsv41_window_active_since_seconds`` (its ``begin`` entry's time, Unix s; 0 when
  none), label-free ``dsv41_window_info{id}`` naming the window;
* ``dsv41_promotion_journal_open`` (1 when the last operation of the promotion journal has no
  ``done`` step: a promote or rollback is running or stopped part way), with
  ``dsv41_promotion_journal_last_step_seconds`` (Unix s of its last entry) and
  ``dsv41_promotion_current_since_seconds`` (mtime of ``packages/current`` when present).

A journal that cannot be read at a scrape (replaced or appended to under it, unreadable) is
``dsv41_promotion_journal_readable`` 0 with the journal gauges at 0 for that scrape, never an
error answer; the server is ``dsv41.httpd.BoundedHTTPServer`` (idle connections time out and
make room, query strings ignored).

The alert rules (roles/monitoring) use them to tell a HOLD left behind from one a window or a
promotion owns. It must run where the controller's files are (the lab's hosts share the machine's
filesystem; in production: the controller).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error


class OpsCollector:
    """Prometheus collector of the operations state. ``api_url``: rank 0's base URL (or "" to skip
    the admission gauges); ``journal``: the promotion journal (JSONL; windows journal there too); ``timeout_s``: the ``/is_paused`` request timeout."""

    def __init__(self, api_url: str, journal: str | os.PathLike, timeout_s: float = 3.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.journal = Path(journal)
        self.timeout_s = timeout_s

    def admission(self) -> tuple[int, int, float]:
        """(up, held, since): ``/is_paused`` answered, admission held, Unix s it was closed (0 if open)."""
        from dsv41.harness import http

        try:
            doc = http.request_json(
                "GET", self.api_url + "/is_paused", what="rank 0 /is_paused", timeout_s=self.timeout_s
            )
            held = bool(doc["is_paused"])
            since = float(doc.get("paused_since") or 0.0) if held else 0.0
            return 1, int(held), since
        except (Dsv41Error, KeyError, TypeError, ValueError):
            return 0, 0, 0.0

    def window(self) -> tuple[int, float, str]:
        """(active, since, id): the journal's last operation when it is a window without ``done``
        (since: its ``begin`` entry's ``ts``); (0, 0.0, "") otherwise."""
        from dsv41.promotion import journal as J

        entries = J.read(self.journal)
        if not entries:
            return 0, 0.0, ""
        op = entries[-1].get("op")
        steps = [e for e in entries if e.get("op") == op]
        begin = next((e for e in steps if e.get("step") == "begin"), {})
        if begin.get("kind") != "window" or any(e.get("step") == "done" for e in steps):
            return 0, 0.0, ""
        return 1, float(begin.get("ts") or 0.0), str(op)[:200]

    def promotion(self) -> tuple[int, float, float]:
        """(journal open, Unix s of its last entry, mtime of ``packages/current`` or 0)."""
        from dsv41.promotion import journal as J

        entries = J.read(self.journal)
        is_open, last = 0, 0.0
        if entries:
            op = entries[-1].get("op")
            steps = [e.get("step") for e in entries if e.get("op") == op]
            is_open = int("done" not in steps)
            last = float(entries[-1].get("ts") or 0.0)
        try:
            cur = (self.journal.parent / "current").lstat().st_mtime
        except OSError:
            cur = 0.0
        return is_open, last, cur

    def journal_state(self) -> tuple[int, tuple[int, float, str], tuple[int, float, float]]:
        """(readable, :meth:`window`, :meth:`promotion`) read together. A read that fails (the
        journal replaced or written under the reader, a bad entry) is tried once more, then
        reported as readable 0 with zeros; never raises."""
        for _attempt in range(2):
            try:
                return 1, self.window(), self.promotion()
            except (Dsv41Error, OSError, ValueError, TypeError, AttributeError):
                continue
        return 0, (0, 0.0, ""), (0, 0.0, 0.0)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        def gauge(name, doc, value, labels=None):
            g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
            g.add_metric(list((labels or {}).values()), value)
            return g

        if self.api_url:
            up, held, since = self.admission()
            yield gauge("dsv41_admission_up", "1 when rank 0's /is_paused answered", up)
            yield gauge("dsv41_admission_held", "1 while rank 0 holds admission (HOLD)", held)
            yield gauge("dsv41_admission_held_since_seconds", "Unix time admission was closed (0 while open)", since)
        readable, (active, wsince, wid), (jopen, jlast, cur) = self.journal_state()
        yield gauge(
            "dsv41_promotion_journal_readable", "1 when the promotion journal could be read at this scrape", readable
        )
        yield gauge(
            "dsv41_window_active", "1 while a window holds production (its journal operation has no done)", active
        )
        yield gauge("dsv41_window_active_since_seconds", "Unix time the active window started (0 when none)", wsince)
        if active:
            yield gauge("dsv41_window_info", "The active window (value 1)", 1, {"id": wid})
        yield gauge("dsv41_promotion_journal_open", "1 while the last promote/rollback has no done step", jopen)
        yield gauge(
            "dsv41_promotion_journal_last_step_seconds", "Unix time of the journal's last entry (0 when empty)", jlast
        )
        yield gauge(
            "dsv41_promotion_current_since_seconds",
            "Unix time production's package pointer last changed (0 when none)",
            cur,
        )


def serve(listen: str, collector: OpsCollector, stop: threading.Event | None = None, settings=None):
    """Serve ``collector`` on ``http://listen/metrics`` (``listen``: ``HOST:PORT``; port 0 picks
    one) from a daemon thread: prometheus_client's ``MetricsHandler`` on a
    ``dsv41.httpd.BoundedHTTPServer`` with ``settings``' (default: the environment's)
    ``DSV41_HTTP_HEADER_TIMEOUT_S`` and ``DSV41_METRICS_MAX_CONNECTIONS``. Returns ``(server,
    thread)`` (``server.shutdown()`` stops it); Dsv41Error when the address is bad or taken."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import MetricsHandler

    from dsv41 import envs
    from dsv41.engram.server import parse_hostport
    from dsv41.httpd import BoundedHTTPServer, bounded_handler

    host, port = parse_hostport(listen, "--listen")
    registry = CollectorRegistry()
    registry.register(collector)
    s = settings if settings is not None else envs.parse()
    try:
        server = BoundedHTTPServer(
            (host, port),
            bounded_handler(MetricsHandler.factory(registry)),
            s.http_header_timeout_s,
            s.metrics_max_connections,
        )
    except (OSError, OverflowError) as exc:
        raise Dsv41Error(f"cannot listen on {listen}: {getattr(exc, 'strerror', None) or exc}") from None
    thread = threading.Thread(target=server.serve_forever, name="ops-exporter-http", daemon=True)
    thread.start()
    return server, thread


def describe(collector: OpsCollector) -> dict:
    """The current values as a dict (``dsv41 monitor exporter --once``)."""
    out = {}
    for fam in collector.collect():
        for s in fam.samples:
            key = s.name + (fileio.dumps_json(s.labels, sort_keys=True) if s.labels else "")
            out[key] = s.value
    return out
