"""The one contract for ``DSV41_*`` environment variables (the shape of vLLM's ``vllm/envs.py``).

Every variable the package or a role's env file uses has one row in :data:`ENV_VARS`: its type,
default, range or choices, unit and meaning. :func:`parse` reads an environment once into a
frozen :class:`Settings` (one field per variable: ``name.removeprefix("DSV41_").lower()``) and
raises :class:`ConfigError`, whose message begins with the offending variable's name, on any bad
value or inconsistent combination. Nothing else in ``dsv41`` reads ``os.environ`` for a
``DSV41_*`` name (tests/unit/test_envs.py checks it).

Conventions: an unset or empty variable takes its default; booleans are ``0``/``1`` (also
``true``/``false``, ``yes``/``no``, ``on``/``off``); integers are decimal. The Engram remote
variables were once spelled ``VLLM_ENGRAM_REMOTE*``: vLLM 0.33 warns about every unknown
``VLLM_*`` variable and refuses to start under ``--fail-on-environ-validation``, so the old
spellings are refused here with an error naming the new ones (:data:`RENAMED`).

Deeper checks that need other packages stay with their owners and run on :class:`Settings`:
URL syntax and one URL per rank (``dsv41.engram.rowsource.remote_config``), the drafter URL and
depth policy (``dsv41.drafter.factory``).

The table itself (:data:`ENV_VARS`, :class:`EnvVar`, :data:`RENAMED`, :class:`ConfigError`) is
:mod:`dsv41.env_vars`; its names are re-exported here, the one place callers import them from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dsv41 import errors
from dsv41.env_vars import (
    _ROWS,
    ENV_VARS as ENV_VARS,
    PREFIX as PREFIX,
    RENAMED as RENAMED,
    ConfigError as ConfigError,
    EnvVar as EnvVar,
)


@dataclass(frozen=True)
class Settings:
    """Parsed environment: one field per row of :data:`ENV_VARS` (``DSV41_DRAFTER_K`` ->
    ``drafter_k``), typed and range-checked; defaults equal the table's. Build it with
    :func:`parse` (tests/unit/test_envs.py keeps the fields and the table in step)."""

    engine_threads: int = 1
    admission_hold_file: str = ""
    engine_drain_timeout_s: float = 30.0
    http_header_timeout_s: float = 10.0
    http_keepalive_timeout_s: float = 5.0
    http_max_connections: int = 512
    http_max_connections_per_client: int = 0
    metrics_max_connections: int = 16
    tp_peer_timeout_s: float = 5.0
    drafter_propose_deadline_ms: float = 1000.0
    engram_lookup_deadline_ms: float = 1000.0
    engram_remote: str = ""
    engram_remote_timeout_ms: int = 100
    engram_remote_required: bool = False
    engram_gpu_join: bool = True
    engram_local_readers: int = 0
    engram_local_parallel_rows: int = 1536
    engram_local_gap_bytes: int = 4096
    engram_local_coalesce: bool = True
    overlay_metrics_addr: str = ""
    overlay_rank: int = 0
    drafter_remote: str = ""
    drafter_local: str = ""
    drafter_dir: str = ""
    drafter_async: bool = False
    drafter_shadow: bool = False
    drafter_k: int = 5
    drafter_timeout_ms: float = 100.0
    drafter_depth_policy: str = ""
    drafter_watchdog_ms: float = 2000.0
    drafter_proxy_respawns: int = 3
    drafter_proxy_window_s: float = 60.0
    drafter_proxy_memlock: bool = True
    drafter_capacity_mode: bool = False
    drafter_local_memory_tokens: int = 0
    transport_pure: bool = False
    transport_client_spin_us: int = 50
    transport_server_spin_us: int = 0
    transport_server_max_connections: int = 64
    transport_server_send_timeout_s: float = 10.0
    nixl_progress_delay_us: int = 1000
    runtime_root: str = ""
    tables_manifest: str = ""
    tables_manifest_sha256: str = ""
    drafter_files_sha256: str = ""
    serve_inputs_sha256: str = ""
    engram_fault_delay_ms: float = 0.0
    bench_spec_file: str = ""
    greedy_prompts_file: str = ""
    window_token: str = ""
    operator_credential_file: str = ""
    control_hosts: str = ""
    api_key_file: str = ""


_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_env_text(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` pairs of an environment file's ``text`` in file order (blank lines and ``#``
    comments skipped, one pair of matching quotes around a value removed). ``source`` names the
    file in errors. Raises :class:`dsv41.errors.Dsv41Error` naming ``source`` and the line of the
    first malformed line or repeated key."""
    out: dict[str, str] = {}
    for no, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        key, sep, value = s.partition("=")
        key = key.strip()
        if not sep or not _ENV_KEY.fullmatch(key):
            raise errors.Dsv41Error(f"env file {source}:{no}: not KEY=VALUE: {line[:80]!r}")
        if key in out:
            raise errors.Dsv41Error(f"env file {source}:{no}: {key} is set twice")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def parse(env: Mapping[str, str] | None = None) -> Settings:
    """Read every variable of :data:`ENV_VARS` from ``env`` (default ``os.environ``).

    Names outside the table are ignored here (``dsv41 env check`` refuses unknown ``DSV41_*``
    names in an env file). Raises :class:`ConfigError` naming the first bad variable: a bad
    value, an old ``VLLM_ENGRAM_REMOTE*`` spelling, or an inconsistent combination.
    """
    env = os.environ if env is None else env
    for old, new in RENAMED.items():
        if old in env:
            raise ConfigError(old, f"{old} was renamed: set {new} instead (vLLM refuses unknown VLLM_* variables)")
    s = Settings(**{v.field: v.convert(env.get(v.name)) for v in _ROWS})
    _check(s)
    return s


def _check(s: Settings) -> None:
    """Rules across variables (each message names the variable to change)."""
    if s.tp_peer_timeout_s * 1000 <= s.drafter_propose_deadline_ms:
        # the other rank waits for the next command while rank 0 drafts
        raise ConfigError(
            "DSV41_TP_PEER_TIMEOUT_S",
            f"DSV41_TP_PEER_TIMEOUT_S ({s.tp_peer_timeout_s:g} s) must "
            f"exceed DSV41_DRAFTER_PROPOSE_DEADLINE_MS "
            f"({s.drafter_propose_deadline_ms:g} ms)",
        )
    if s.engram_remote_required and not s.engram_remote:
        raise ConfigError(
            "DSV41_ENGRAM_REMOTE_REQUIRED", "DSV41_ENGRAM_REMOTE_REQUIRED=1 but DSV41_ENGRAM_REMOTE is empty"
        )
    if s.drafter_capacity_mode:
        if s.drafter_local:
            raise ConfigError(
                "DSV41_DRAFTER_CAPACITY_MODE",
                "DSV41_DRAFTER_CAPACITY_MODE=1 with DSV41_DRAFTER_LOCAL: a local drafter frees no memory",
            )
        if s.drafter_remote and s.drafter_local_memory_tokens <= 0:
            raise ConfigError(
                "DSV41_DRAFTER_LOCAL_MEMORY_TOKENS",
                "DSV41_DRAFTER_CAPACITY_MODE=1 needs DSV41_DRAFTER_LOCAL_MEMORY_TOKENS > 0",
            )
    if s.drafter_remote and s.drafter_local:
        raise ConfigError(
            "DSV41_DRAFTER_REMOTE", "DSV41_DRAFTER_REMOTE: set only one of DSV41_DRAFTER_REMOTE and DSV41_DRAFTER_LOCAL"
        )
    if s.drafter_remote and not s.drafter_dir:
        raise ConfigError(
            "DSV41_DRAFTER_DIR",
            "DSV41_DRAFTER_DIR: DSV41_DRAFTER_REMOTE needs DSV41_DRAFTER_DIR (the drafter files the worker must match)",
        )
    if s.drafter_async and s.drafter_shadow:
        raise ConfigError(
            "DSV41_DRAFTER_SHADOW", "DSV41_DRAFTER_SHADOW works with synchronous rounds only; unset DSV41_DRAFTER_ASYNC"
        )
