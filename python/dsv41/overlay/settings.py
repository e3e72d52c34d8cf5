"""The overlay's settings from the environment (torch-free).

Engram: ``DSV41_ENGRAM_REMOTE`` (one URL per rank, comma-separated; unset/empty = off),
``DSV41_ENGRAM_REMOTE_TIMEOUT_MS`` (1..600000, default 100), ``DSV41_ENGRAM_REMOTE_REQUIRED``
(0/1), ``DSV41_RUNTIME_ROOT`` (the read-only runtime root staged by roles/engram_overlay:
``manifest.json`` and ``overlay.json``, whose ``tables_dir`` holds the local exact fallback).
The old ``VLLM_ENGRAM_REMOTE*`` names are refused with a message naming the new ones.
Drafter: on when ``DSV41_DRAFTER_REMOTE`` is set; its settings are parsed by
``dsv41.drafter.spark.speculator_from_env`` (one parser for the lab engine and the overlay).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dsv41.errors import ConfigError
from dsv41.overlay.contract import OLD_ENV

DEFAULT_RUNTIME_ROOT = "/opt/dsv41/runtime"


@dataclass(frozen=True)
class OverlaySettings:
    """What the overlay does in this process.

    ``engram_urls``: raw URL list (empty = Engram overlay off); ``timeout_ms``; ``required``;
    ``runtime_root``; ``drafter``: True when ``DSV41_DRAFTER_REMOTE`` is set; ``env``: the
    mapping it was parsed from (the drafter's own parser reads it again).
    """

    engram_urls: tuple[str, ...]
    timeout_ms: int
    required: bool
    runtime_root: Path
    drafter: bool
    env: Mapping[str, str]

    @property
    def engram(self) -> bool:
        """Whether Engram rows come through the overlay."""
        return bool(self.engram_urls)

    @property
    def active(self) -> bool:
        """Whether the overlay patches anything."""
        return self.engram or self.drafter


# envs: DSV41_ENGRAM_REMOTE DSV41_ENGRAM_REMOTE_TIMEOUT_MS DSV41_ENGRAM_REMOTE_REQUIRED
# envs: DSV41_RUNTIME_ROOT DSV41_DRAFTER_REMOTE (moves into dsv41.envs once main has it)
def parse(env: Mapping[str, str] | None = None) -> OverlaySettings:
    """Parse the overlay's variables from ``env`` (default ``os.environ``).

    Raises ConfigError (message begins with the variable's name) for an old ``VLLM_ENGRAM_*``
    name, a bad timeout or required flag, or required mode without URLs.  URL syntax and the
    one-URL-per-rank rule are checked where TP is known (:func:`rank_url`).
    """
    env = os.environ if env is None else env
    for old, new in OLD_ENV.items():
        if old in env:
            raise ConfigError(f"{old} is no longer read: rename it to {new}")
    value = (env.get("DSV41_ENGRAM_REMOTE") or "").strip()
    tstr = (env.get("DSV41_ENGRAM_REMOTE_TIMEOUT_MS") or "").strip()
    rstr = (env.get("DSV41_ENGRAM_REMOTE_REQUIRED") or "").strip()
    if rstr not in ("", "0", "1"):
        raise ConfigError(f"DSV41_ENGRAM_REMOTE_REQUIRED must be 0 or 1, got {rstr!r}")
    required = rstr == "1"
    timeout_ms = 100
    if tstr:
        if not tstr.isdigit() or not 0 < int(tstr) <= 600_000:
            raise ConfigError(f"DSV41_ENGRAM_REMOTE_TIMEOUT_MS must be an integer in [1, 600000], got {tstr!r}")
        timeout_ms = int(tstr)
    urls = tuple(p for p in (x.strip() for x in value.split(",")) if p)
    if required and not urls:
        raise ConfigError("DSV41_ENGRAM_REMOTE_REQUIRED=1 but DSV41_ENGRAM_REMOTE is empty")
    root = Path((env.get("DSV41_RUNTIME_ROOT") or "").strip() or DEFAULT_RUNTIME_ROOT)
    drafter = bool((env.get("DSV41_DRAFTER_REMOTE") or "").strip())
    return OverlaySettings(urls, timeout_ms, required, root, drafter, env)


def rank_url(settings: OverlaySettings, tp: int, rank: int) -> str:
    """This rank's validated URL: one URL per rank (or one for all); ConfigError otherwise."""
    from dsv41.engram.rowsource import parse_remote_url

    urls = settings.engram_urls
    if len(urls) not in (1, tp):
        raise ConfigError(f"DSV41_ENGRAM_REMOTE names {len(urls)} URL(s) but tp is {tp}: one URL per rank")
    url = urls[rank] if len(urls) == tp else urls[0]
    return str(parse_remote_url(url, "DSV41_ENGRAM_REMOTE"))


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
        desc = json.loads((root / "overlay.json").read_text())
    except OSError as exc:
        raise ConfigError(f"DSV41_RUNTIME_ROOT {root}: overlay.json: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DSV41_RUNTIME_ROOT {root}: overlay.json is not JSON ({exc})") from None
    tables = desc.get("tables_dir") if isinstance(desc, dict) else None
    tdir = Path(tables) if isinstance(tables, str) and tables and Path(tables).is_dir() else None
    return manifest, tdir
