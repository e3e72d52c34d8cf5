"""The rank's row source from the environment (``DSV41_ENGRAM_REMOTE*``, docs/interfaces.md
section engram): the one place that knows every :class:`~dsv41.engram.rowsource.RowSource`
implementation, so the protocol's module and the implementations never import it back.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from dsv41 import envs
from dsv41.engram.rowsource import LocalRowSource, RowSource, remote_config
from dsv41.envs import Settings
from dsv41.errors import ConfigError


def from_env(
    manifest: Any,
    data_dir: str | os.PathLike | None,
    rank: int,
    tp: int,
    settings: Settings | None = None,
    threads: int = 16,
) -> RowSource:
    """Build the engine's RowSource from ``settings`` (default: ``envs.parse()`` of the
    environment).

    ``DSV41_ENGRAM_REMOTE`` unset/empty -> :class:`LocalRowSource` over a LocalRowReader of
    ``data_dir``, with ``fault_delay_ms=DSV41_ENGRAM_FAULT_DELAY_MS``.
    Otherwise ``dsv41.engram.client.RemoteRowSource(urls, manifest, rank, tp, timeout_ms,
    required, local=reader, deadline_ms=DSV41_ENGRAM_LOOKUP_DEADLINE_MS,
    fault_delay_ms=DSV41_ENGRAM_FAULT_DELAY_MS, spin_us=DSV41_TRANSPORT_CLIENT_SPIN_US)`` with
    ``urls`` the validated URL strings (one per rank) and ``reader`` the local exact fallback (None when ``data_dir`` is None): the
    engine's lookup deadline and the drill's delay live inside the remote source (no wrapper,
    no helper thread per lookup).
    ``manifest``: Manifest or path.  ConfigError on bad settings, rank/tp, or a missing client.
    """
    from dsv41.engram.manifest import Manifest, load_manifest
    from dsv41.engram.reader import LocalRowReader

    settings = envs.parse() if settings is None else settings
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be an int >= 1, got {tp!r}")
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise ConfigError(f"rank must be in [0, {tp}), got {rank!r}")
    remote = remote_config(settings, tp)
    m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    if remote is None:
        if data_dir is None:
            raise ConfigError("no data directory for the local Engram reader (and DSV41_ENGRAM_REMOTE is unset)")
        return LocalRowSource(LocalRowReader(m, Path(data_dir), threads=threads), settings.engram_fault_delay_ms)
    urls, timeout_ms, required = remote
    try:
        client = importlib.import_module("dsv41.engram.client")
    except ModuleNotFoundError as exc:
        if exc.name in ("dsv41.engram.client",):
            raise ConfigError("DSV41_ENGRAM_REMOTE is set but dsv41.engram.client is not installed") from None
        raise
    reader = LocalRowReader(m, Path(data_dir), threads=threads) if data_dir is not None else None
    return client.RemoteRowSource(
        [str(u) for u in urls],
        m,
        rank,
        tp,
        timeout_ms,
        required,
        local=reader,
        deadline_ms=settings.engram_lookup_deadline_ms,
        fault_delay_ms=settings.engram_fault_delay_ms,
        spin_us=settings.transport_client_spin_us,
    )


def verify_local(source: RowSource) -> bool:
    """Verify the local shards of ``source`` before a rank says it is ready: the reader of a
    :class:`LocalRowSource` or the exact fallback of a remote source
    (``LocalRowReader.verify``: present, sized, hashed and headed as the manifest says; then
    watched on every read). Returns False when the source reads no local shard. Raises
    VerificationError with the one reason (missing, truncated, changed)."""
    reader = source
    for _depth in range(4):  # remote -> its LocalRowSource -> its LocalRowReader
        if reader is None or hasattr(reader, "verify"):
            break
        reader = getattr(reader, "reader", None) or getattr(reader, "local", None)
    if reader is None or not hasattr(reader, "verify"):
        return False
    reader.verify()
    return True
