"""The overlay's settings from the environment (torch-free).

Engram: ``DSV41_ENGRAM_REMOTE`` (one URL per rank, comma-separated; unset/empty = off),
``DSV41_ENGRAM_REMOTE_TIMEOUT_MS`` (1..600000, default 100), ``DSV41_ENGRAM_REMOTE_REQUIRED``
(0/1), ``DSV41_ENGRAM_GPU_JOIN`` (0/1, default 1: a prefill chunk's layer joined on the GPU with no host
wait, ``dsv41.overlay.engram_gpujoin``; never in required mode), ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS`` (whole-call deadline of a lookup, default 1000, the
same setting the lab engine uses) and ``DSV41_TRANSPORT_CLIENT_SPIN_US`` (busy-poll budget per
reply, default 50; both read from ``env``), ``DSV41_ENGRAM_LOCAL_READERS``, ``DSV41_ENGRAM_LOCAL_PARALLEL_ROWS``, ``DSV41_ENGRAM_LOCAL_GAP_BYTES`` and
``DSV41_ENGRAM_LOCAL_COALESCE`` (how the C++ core reads the exact local rows when the table server
is down: :class:`LocalReader`),
``DSV41_RUNTIME_ROOT`` (the read-only runtime root
staged by roles/engram_overlay: ``manifest.json`` and ``overlay.json``, whose ``tables_dir``
holds the local exact fallback).
The old ``VLLM_ENGRAM_REMOTE*`` names are refused with a message naming the new ones.
Drafter: on when ``DSV41_DRAFTER_REMOTE`` is set; ``dsv41.drafter.factory.build_speculator``
builds it from the same :class:`dsv41.envs.Settings` as the lab engine.  Every variable is read
by :func:`dsv41.envs.parse` (the one contract of ``DSV41_*`` names).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dsv41 import envs, fileio
from dsv41.errors import ConfigError

DEFAULT_RUNTIME_ROOT = "/opt/dsv41/runtime"


@dataclass(frozen=True)
class LocalReader:
    """How the C++ core reads a table's exact local rows (``dsv41.overlay._core``'s ``LocalTable``,
    ``core_local.h``): the shard is read with ``pread``, never mapped or loaded.

    ``readers``: threads of a job of more than ``parallel_rows`` rows, the calling thread included
    (``DSV41_ENGRAM_LOCAL_READERS``, 0: min(8, hardware threads / 2)); ``parallel_rows``: smaller
    jobs stay on the worker's thread (``DSV41_ENGRAM_LOCAL_PARALLEL_ROWS``); ``gap_bytes``: rows of
    a region at most this many bytes apart are read with one ``pread`` (``DSV41_ENGRAM_LOCAL_GAP_BYTES``);
    ``coalesce``: False reads two rows' regions per row in request order (``DSV41_ENGRAM_LOCAL_COALESCE``).
    The defaults are the table's (``dsv41.env_vars``) and the extension's."""

    readers: int = 0
    parallel_rows: int = 1536
    gap_bytes: int = 4096
    coalesce: bool = True

    @classmethod
    def from_env(cls, env: envs.Settings) -> LocalReader:
        """The options of a parsed environment."""
        return cls(
            env.engram_local_readers,
            env.engram_local_parallel_rows,
            env.engram_local_gap_bytes,
            env.engram_local_coalesce,
        )

    def kwargs(self) -> dict[str, int | bool]:
        """Keyword arguments of ``EngramSlot.set_local`` / ``LocalTable``."""
        return {
            "readers": self.readers,
            "parallel_rows": self.parallel_rows,
            "gap_bytes": self.gap_bytes,
            "coalesce": self.coalesce,
        }


@dataclass(frozen=True)
class OverlaySettings:
    """What the overlay does in this process.

    ``engram_urls``: raw URL list (empty = Engram overlay off); ``timeout_ms``; ``required``;
    ``gpu_join`` (``DSV41_ENGRAM_GPU_JOIN``); ``local_reader`` (:class:`LocalReader`); ``runtime_root``; ``drafter``: True when ``DSV41_DRAFTER_REMOTE`` is set; ``env``: the
    :class:`dsv41.envs.Settings` it was built from (the drafter factory reads it).
    """

    engram_urls: tuple[str, ...]
    timeout_ms: int
    required: bool
    runtime_root: Path
    drafter: bool
    env: envs.Settings
    gpu_join: bool = True
    local_reader: LocalReader = LocalReader()

    @property
    def engram(self) -> bool:
        """Whether Engram rows come through the overlay."""
        return bool(self.engram_urls)

    @property
    def active(self) -> bool:
        """Whether the overlay patches anything."""
        return self.engram or self.drafter


def parse(env: Mapping[str, str] | None = None) -> OverlaySettings:
    """The overlay's settings from ``env`` (default ``os.environ``) through :func:`dsv41.envs.parse`
    (the one reader of ``DSV41_*``); raises :class:`dsv41.envs.ConfigError` (message begins with
    the variable's name) for an old ``VLLM_ENGRAM_*`` name, a bad value or an inconsistent
    combination.  URL syntax and the one-URL-per-rank rule are checked where TP is known
    (:func:`rank_url`)."""
    s = envs.parse(env)
    urls = tuple(p for p in (x.strip() for x in s.engram_remote.split(",")) if p)
    root = Path(s.runtime_root.strip() or DEFAULT_RUNTIME_ROOT)
    return OverlaySettings(
        urls,
        s.engram_remote_timeout_ms,
        s.engram_remote_required,
        root,
        bool(s.drafter_remote.strip()),
        s,
        s.engram_gpu_join,
        LocalReader.from_env(s),
    )


def rank_url(settings: OverlaySettings, tp: int, rank: int) -> str:
    """This rank's validated URL (``dsv41.engram.rowsource.remote_config``: one URL per rank);
    :class:`dsv41.envs.ConfigError` otherwise."""
    from dsv41.engram.rowsource import remote_config

    remote = remote_config(settings.env, tp)
    if remote is None:
        raise ConfigError("DSV41_ENGRAM_REMOTE is empty")
    return str(remote[0][rank])


def runtime_files(settings: OverlaySettings) -> tuple[Path, Path | None]:
    """(manifest path, local tables dir or None) from the runtime root.

    The manifest is ``<root>/manifest.json``; the tables dir is ``overlay.json``'s
    ``tables_dir`` when that directory exists (the exact local fallback), else None.
    ConfigError when the manifest or overlay.json is missing or unreadable.
    """
    root = settings.runtime_root
    manifest = root / "manifest.json"
    if not manifest.is_file():
        raise ConfigError(f"DSV41_RUNTIME_ROOT {root}: no manifest.json (run roles/engram_overlay)")

    try:
        desc = fileio.loads_json(
            fileio.read_text(root / "overlay.json", f"DSV41_RUNTIME_ROOT {root}: overlay.json", error=ConfigError)
        )
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DSV41_RUNTIME_ROOT {root}: overlay.json is not JSON ({exc})") from None
    tables = desc.get("tables_dir") if isinstance(desc, dict) else None
    tdir = Path(tables) if isinstance(tables, str) and tables and Path(tables).is_dir() else None
    return manifest, tdir
