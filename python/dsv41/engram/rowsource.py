"""The one interface the engine reads Engram rows through (:class:`RowSource`, its whole
contract), the exact local source, and the remote settings (``DSV41_ENGRAM_REMOTE*``:
:func:`remote_config`, docs/interfaces.md section engram). Which source a rank gets from the
environment: ``dsv41.engram.sources.from_env`` (above every implementation).
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dsv41 import envs
from dsv41.envs import ConfigError as EnvConfigError, Settings
from dsv41.errors import ConfigError, Dsv41Error

#: Counter keys every RowSource reports.
COUNTER_KEYS = (
    "lookups",
    "rows",
    "fallbacks",
    "transport_errors",
    "refusals",
    "reconnects",
    "latency_sum_s",
    "latency_count",
)
SCHEMES = ("tcp", "nixl")
DEFAULT_TIMEOUT_MS = 100


@runtime_checkable
class RowSource(Protocol):
    """Where packed Engram rows come from (local shards, the remote table server, a drill's
    delay wrapper, the drafter's in-memory synthetic tables): the whole contract.

    Every row source in the package subclasses this protocol explicitly, so a missing method is
    a ``TypeError`` at construction (``lookup``, ``counters`` and ``close`` are abstract) and
    callers never probe for a method or a parameter: every source takes ``out`` and has
    ``lookup_layers`` (by default one :meth:`lookup` per layer; the remote source overrides it
    with one round trip). Rows: ``uint8[N, 264]`` each, 256 fp8 e4m3 weight bytes then 8 ue8m0
    scale bytes (engram-spec.md section 4); row ids are global ids of the layer's table.
    """

    @abstractmethod
    def lookup(self, layer_id: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Packed rows ``uint8[N, 264]`` for global row ids ``rows`` (int ``[N]``) of
        ``layer_id``'s table, in request order (duplicates allowed).

        ``out``: None, or a caller-owned writable C-contiguous ``uint8[N, 264]`` buffer that
        is filled and returned (no allocation per call). Raises ``RowRangeError`` for ids
        outside the table or an unknown layer, ``Dsv41Error`` for a bad ``out`` (and, for the
        remote source, ``RemoteUnavailable`` when it may not fall back).
        """

    def lookup_layers(
        self, layer_ids: Sequence[int], rows: Sequence[np.ndarray], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[np.ndarray]:
        """Rows of several layers (e.g. both Engram layers of a step): one ``uint8[N_i, 264]``
        array per layer, as :meth:`lookup` of ``(layer_ids[i], rows[i], outs[i])``.

        ``outs``: None or one buffer (or None) per layer. Same errors as :meth:`lookup`, plus
        ``Dsv41Error`` when ``rows`` or ``outs`` do not give one entry per layer. This default
        makes one :meth:`lookup` per layer (locally there is no round trip to save).
        """
        layer_ids = list(layer_ids)
        if len(rows) != len(layer_ids) or (outs is not None and len(outs) != len(layer_ids)):
            raise Dsv41Error("lookup_layers needs one row array (and one out, if given) per layer")
        outs = [None] * len(layer_ids) if outs is None else outs
        return [self.lookup(L, r, out=o) for L, r, o in zip(layer_ids, rows, outs, strict=False)]

    def is_required(self) -> bool:
        """Whether a failed read raises (``RemoteUnavailable``) instead of serving exact local
        rows: False for every source that never falls back (local shards, in-memory tables);
        the remote source answers its ``required`` setting."""
        return False

    @abstractmethod
    def counters(self) -> dict:
        """Snapshot of the counters: at least :data:`COUNTER_KEYS` (counts, and
        ``latency_sum_s`` in seconds over ``latency_count`` calls)."""

    @abstractmethod
    def close(self) -> None:
        """Release files, sockets and threads."""


class LocalRowSource(RowSource):
    """RowSource over a :class:`~dsv41.engram.reader.LocalRowReader` (the exact local path).

    Counts lookups, rows and latency (seconds); fallbacks/transport_errors/refusals/reconnects
    stay 0. Thread-safe.

    ``fault_delay_ms`` (``DSV41_ENGRAM_FAULT_DELAY_MS``, fenced-window drills only; 0 = off):
    every layer's ``lookup`` sleeps that many milliseconds before reading, whether the layers are
    looked up one by one or through ``lookup_layers`` (about ``2 x delay`` per engine step on the
    lab model). Rows stay exact; only time is added, outside the latency counters, and
    ``counters()`` then carries ``fault_delay_ms``. The remote source applies the same delay
    itself, inside its lookup deadline (``RemoteRowSource(fault_delay_ms=...)``). The shipped
    candidate ``slow-rows`` uses it as the window's known LOSS (docs/windows.md). Never set in
    production. Dsv41Error for a negative or non-finite delay.
    """

    def __init__(self, reader: Any, fault_delay_ms: float = 0.0) -> None:
        if not 0 <= fault_delay_ms < float("inf"):  # also refuses NaN
            raise Dsv41Error(f"fault_delay_ms must be a finite number >= 0, got {fault_delay_ms}")
        self.reader = reader
        self.fault_delay_s = fault_delay_ms / 1e3
        self._lock = threading.Lock()
        self._c: dict[str, float | int] = {k: 0 for k in COUNTER_KEYS}
        self._c["latency_sum_s"] = 0.0

    def lookup(self, layer_id: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """See :meth:`RowSource.lookup` (the reader's ``read``, after ``fault_delay_ms``).
        RowRangeError for out-of-range ids, Dsv41Error for a bad ``out``."""
        if self.fault_delay_s:
            time.sleep(self.fault_delay_s)
        t0 = time.perf_counter()
        out = self.reader.read(layer_id, rows, out=out)
        dt = time.perf_counter() - t0
        with self._lock:
            self._c["lookups"] += 1
            self._c["rows"] += int(out.shape[0])
            self._c["latency_sum_s"] += dt
            self._c["latency_count"] += 1
        return out

    def counters(self) -> dict:
        """Snapshot of the counters (plus ``source: "local"``, and ``fault_delay_ms`` when set)."""
        with self._lock:
            c = {"source": "local", **self._c}
        if self.fault_delay_s:
            c["fault_delay_ms"] = self.fault_delay_s * 1e3
        return c

    def close(self) -> None:
        """Close the reader."""
        self.reader.close()


@dataclass(frozen=True)
class RemoteURL:
    """One parsed ``scheme://host:port[@local_addr]`` of ``DSV41_ENGRAM_REMOTE``."""

    scheme: str
    host: str
    port: int
    local_addr: str | None = None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        tail = f"@{self.local_addr}" if self.local_addr else ""
        return f"{self.scheme}://{host}:{self.port}{tail}"


def parse_remote_url(url: str, what: str = "DSV41_ENGRAM_REMOTE") -> RemoteURL:
    """Parse a client URL ``tcp://H:P[@LOCAL_ADDR]`` or ``nixl://H:P[@LOCAL_ADDR]`` (IPv6 hosts
    in []) with :func:`dsv41.transport.url.parse_url` (the package's one URL parser), plus the
    client rules: port 1..65535, a local address without a port.  ConfigError naming ``what``.
    """
    from dsv41.transport.url import parse_url

    try:
        ep = parse_url(url)
    except Dsv41Error as exc:
        raise ConfigError(f"{what}: {exc}") from None
    if ep.port == 0:
        raise ConfigError(f"{what}: port 0 in {url!r}: a server port must be 1..65535")
    if ep.local_port:
        raise ConfigError(f"{what}: the local address in {url!r} takes no port")
    return RemoteURL(ep.scheme, ep.host, ep.port, ep.local_host)


def remote_config(settings: Settings, tp: int) -> tuple[list[RemoteURL], int, bool] | None:
    """The remote row settings for ``tp`` ranks: None when ``DSV41_ENGRAM_REMOTE`` is empty,
    else (one URL per rank, ``DSV41_ENGRAM_REMOTE_TIMEOUT_MS``, ``DSV41_ENGRAM_REMOTE_REQUIRED``).

    The variables are parsed and range-checked by :func:`dsv41.envs.parse`; this adds the URL
    syntax and the one-URL-per-rank rule. :class:`dsv41.envs.ConfigError` on a bad URL list.
    """
    value = settings.engram_remote.strip()
    if not value:
        return None
    parts = [p for p in (x.strip() for x in value.split(",")) if p]
    if len(parts) != tp:
        raise EnvConfigError(
            "DSV41_ENGRAM_REMOTE", f"DSV41_ENGRAM_REMOTE names {len(parts)} URL(s) but tp is {tp}: one URL per rank"
        )
    try:
        urls = [parse_remote_url(p) for p in parts]
    except ConfigError as exc:
        raise EnvConfigError("DSV41_ENGRAM_REMOTE", str(exc)) from None
    return urls, settings.engram_remote_timeout_ms, settings.engram_remote_required


def parse_remote_env(env: Mapping[str, str], tp: int) -> tuple[list[RemoteURL], int, bool] | None:
    """:func:`remote_config` of ``envs.parse(env)``: None when remote is off, else (urls,
    timeout_ms, required). :class:`dsv41.envs.ConfigError` on any bad value."""
    return remote_config(envs.parse(env), tp)
