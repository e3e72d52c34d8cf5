"""The table of ``DSV41_*`` environment variables: one :class:`EnvVar` row per variable (type,
default, range or choices, unit, meaning) and how a raw value converts to its type.

Read through :mod:`dsv41.envs` (``envs.parse(env) -> Settings``), which re-exports these names;
tests/unit/test_envs.py keeps :class:`dsv41.envs.Settings` and this table in step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dsv41 import errors

PREFIX = "DSV41_"


class ConfigError(errors.ConfigError, ValueError):
    """A bad environment variable. ``name`` is the variable; ``str(exc)`` begins with it.

    A :class:`dsv41.errors.Dsv41Error`, so the ``dsv41`` command prints it as one line, exit 1.
    """

    def __init__(self, name: str, message: str) -> None:
        if not message.startswith(name):
            message = f"{name}: {message}"
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class EnvVar:
    """One row of the table.

    ``type``: ``int``, ``float``, ``bool`` or ``str``; ``default``: the value when unset or
    empty; ``unit``: of the value (``ms``, ``us``, ``s``, ``tokens``...; "" when none);
    ``min``/``max``: inclusive bounds of numbers; ``choices``: the allowed strings.
    """

    name: str
    type: type
    default: Any
    doc: str
    unit: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None

    @property
    def field(self) -> str:
        """The :class:`Settings` attribute: ``name.removeprefix("DSV41_").lower()``."""
        return self.name.removeprefix(PREFIX).lower()

    def convert(self, raw: str | None) -> Any:
        """The typed value of ``raw`` (None or blank -> ``default``); :class:`ConfigError`."""
        text = (raw or "").strip()
        if not text:
            return self.default
        if self.type is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ConfigError(self.name, f"{self.name} must be 0 or 1 (or true/false), got {raw!r}")
        if self.type is int:
            if not _INT.fullmatch(text):
                raise ConfigError(self.name, f"{self.name} must be an integer in {self._range()}, got {raw!r}")
            value: Any = int(text)
        elif self.type is float:
            value = float(text) if _FLOAT.fullmatch(text) else float("nan")
            if value != value or value in (float("inf"), float("-inf")):
                raise ConfigError(self.name, f"{self.name} must be a number in {self._range()}, got {raw!r}")
        else:
            value = text
            if self.choices is not None and value not in self.choices:
                raise ConfigError(self.name, f"{self.name} must be one of {', '.join(self.choices)}, got {raw!r}")
            return value
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            kind = "an integer" if self.type is int else "a number"
            raise ConfigError(self.name, f"{self.name} must be {kind} in {self._range()}, got {raw!r}")
        return value

    def _range(self) -> str:
        lo = "-inf" if self.min is None else _num(self.min)
        hi = "inf" if self.max is None else _num(self.max)
        return f"[{lo}, {hi}]" + (f" {self.unit}" if self.unit else "")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")  # no "1_0", "inf", "nan"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_ROWS = [
    # ---- engine
    EnvVar(
        "DSV41_ENGINE_THREADS",
        int,
        1,
        "torch CPU threads per engine rank when --threads is not given (roles/serve writes it).",
        "threads",
        1,
        4096,
    ),
    EnvVar(
        "DSV41_ADMISSION_HOLD_FILE",
        str,
        "",
        "Rank 0 keeps a fenced HOLD (/pause?window=TOKEN: window, "
        "promote, rollback) in this file, so an engine restarted under it starts held; /resume removes it "
        "(roles/serve writes /run/dsv41/admission-hold on rank 0: the lab engine, or vLLM's admission fence "
        "dsv41.overlay.fence, which re-reads it on every request; empty: memory only).",
    ),
    EnvVar(
        "DSV41_ENGINE_DRAIN_TIMEOUT_S",
        float,
        30.0,
        "SIGTERM on the lab engine's rank 0: seconds the "
        "requests in flight get to finish before they are aborted (a keep-frozen engine's at once); the process "
        "exits at most ABORT_SETTLE_S (5 s) later.",
        "s",
        0.1,
        3600,
    ),
    # ---- HTTP servers: slow and idle clients (docs/operations.md, "HTTP servers and slow clients")
    EnvVar(
        "DSV41_HTTP_HEADER_TIMEOUT_S",
        float,
        10.0,
        "Every dsv41 HTTP server (engine API, table-server and "
        "drafter /metrics): a request's head (on the engine API, its head and body) must arrive complete "
        "within this many seconds of the connection opening or of the previous response, else the connection is closed (idle and trickling clients).",
        "s",
        0.05,
        3600,
    ),
    EnvVar(
        "DSV41_HTTP_KEEPALIVE_TIMEOUT_S",
        float,
        5.0,
        "The engine API closes a keep-alive connection idle this "
        "long between requests (uvicorn timeout_keep_alive; vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, also 5).",
        "s",
        0.05,
        3600,
    ),
    EnvVar(
        "DSV41_HTTP_MAX_CONNECTIONS",
        int,
        512,
        "The engine API's connection cap: past it a new connection "
        "takes the place of the oldest idle one, or is answered 503 when all are busy; requests other than "
        "/health, /metrics, /is_paused and /v1/models are shed (503, Retry-After) an eighth below it, so "
        "health always finds room (dsv41.httpd).",
        "connections",
        2,
        1_000_000,
    ),
    EnvVar(
        "DSV41_HTTP_MAX_CONNECTIONS_PER_CLIENT",
        int,
        0,
        "One client address's share of the engine API's "
        "connections and of its requests in flight (429 past it); 0: a quarter of each.",
        "connections",
        0,
        1_000_000,
    ),
    EnvVar(
        "DSV41_METRICS_MAX_CONNECTIONS",
        int,
        16,
        "Table-server and drafter-worker /metrics and /ready, operations exporter: past "
        "this many open connections (or a quarter from one client) the oldest idle one makes room; all busy: 503.",
        "connections",
        1,
        4096,
    ),
    # ---- liveness and step-path deadlines (docs/engine.md, "Liveness and deadlines")
    EnvVar(
        "DSV41_TP_PEER_TIMEOUT_S",
        float,
        5.0,
        "How long a rank waits for the other once the TP group has "
        "formed (groups, handshake, every collective); past it the rank fails (/health 503) and exits for "
        "its service manager (systemd) to restart.",
        "s",
        2,
        3600,
    ),
    EnvVar(
        "DSV41_DRAFTER_PROPOSE_DEADLINE_MS",
        float,
        1000.0,
        "Deadline the engine enforces on one Speculator.propose; past it the round decodes without drafts.",
        "ms",
        1,
        4000,
    ),
    EnvVar(
        "DSV41_ENGRAM_LOOKUP_DEADLINE_MS",
        float,
        1000.0,
        "Whole-call deadline of one remote Engram lookup "
        "(RemoteRowSource: connection lock wait and every request); past it the rows come from the local "
        "reader.",
        "ms",
        1,
        600_000,
    ),
    # ---- Engram remote rows (docs/engram.md, "Row source")
    EnvVar(
        "DSV41_ENGRAM_REMOTE",
        str,
        "",
        "Comma-separated table-server URLs, one per TP rank "
        "(tcp://H:P[@LOCAL] or nixl://H:P[@LOCAL]); empty: the local exact reader.",
    ),
    EnvVar(
        "DSV41_ENGRAM_REMOTE_TIMEOUT_MS",
        int,
        100,
        "Per-lookup deadline of a remote Engram lookup; past it the rank falls back to its local reader.",
        "ms",
        1,
        600_000,
    ),
    EnvVar(
        "DSV41_ENGRAM_REMOTE_REQUIRED",
        bool,
        False,
        "1: a failed remote lookup is an error, not a local fallback (needs DSV41_ENGRAM_REMOTE).",
    ),
    EnvVar(
        "DSV41_ENGRAM_GPU_JOIN",
        bool,
        True,
        'vLLM overlay (docs/gpu.md, "The GPU-side join on host-mapped flags"): 1: a '
        "prefill chunk's Engram layer is queued whole on the GPU at _start_prefetch (waits on host-mapped flags "
        "the worker stores from the CPU, then each piece's graph) and _finish_prefetch waits on nothing on the "
        "host; needs the C++ extension, the driver's v2 stream memory operations and the exact local shards; "
        "required mode always joins on the host. 0: the launching thread waits for the worker's hand-off.",
    ),
    EnvVar(
        "DSV41_ENGRAM_LOCAL_READERS",
        int,
        0,
        "vLLM overlay, the C++ core's exact local rows (the fallback with the table server down): threads "
        "that read a job of more than DSV41_ENGRAM_LOCAL_PARALLEL_ROWS rows, the calling thread included "
        "(persistent, created at a table's first such job); 0: min(8, hardware threads / 2); 1: no threads.",
        "threads",
        0,
        64,
    ),
    EnvVar(
        "DSV41_ENGRAM_LOCAL_PARALLEL_ROWS",
        int,
        1536,
        "vLLM overlay: a local fill of more rows than this is split across DSV41_ENGRAM_LOCAL_READERS; a "
        "smaller one (a decode step's: 12 rows per token at TP2) stays on the worker's thread, with no hand-off.",
        "rows",
        1,
        2**31 - 1,
    ),
    EnvVar(
        "DSV41_ENGRAM_LOCAL_GAP_BYTES",
        int,
        4096,
        "vLLM overlay: the local fill reads rows in id order, each distinct id once, and two rows of a "
        "region (256-byte weights, 8-byte scales) whose bytes lie at most this far apart with one pread of "
        "the span (at most 64 KiB); 0: only adjacent rows.",
        "bytes",
        0,
        32768,
    ),
    EnvVar(
        "DSV41_ENGRAM_LOCAL_COALESCE",
        bool,
        True,
        "vLLM overlay: 1: the local fill sorts, deduplicates and coalesces its reads "
        "(DSV41_ENGRAM_LOCAL_GAP_BYTES); 0: two preads per row in request order (the reader before, for comparisons).",
    ),
    EnvVar(
        "DSV41_OVERLAY_METRICS_ADDR",
        str,
        "",
        "vLLM overlay: HOST:PORT (the Spark's management address) of "
        "this rank's Prometheus /metrics and /health, started once in the vLLM worker; empty: no endpoint.",
    ),
    EnvVar(
        "DSV41_OVERLAY_RANK",
        int,
        0,
        "vLLM overlay: the TP rank this container's worker runs (the "
        "`rank` label of its metrics; one GPU per Spark, so the node rank).",
        "",
        0,
        1023,
    ),
    # ---- speculative drafting (docs/drafter.md)
    EnvVar(
        "DSV41_DRAFTER_REMOTE",
        str,
        "",
        "tcp://H:P of the drafter worker (`dsv41 drafter serve`); "
        "exclusive with DSV41_DRAFTER_LOCAL; needs DSV41_DRAFTER_DIR.",
    ),
    EnvVar("DSV41_DRAFTER_LOCAL", str, "", "Drafter directory to draft in-process (no worker)."),
    EnvVar(
        "DSV41_DRAFTER_DIR",
        str,
        "",
        "Drafter files the Spark side hashes for the worker identity check and shadow parity.",
    ),
    EnvVar(
        "DSV41_DRAFTER_ASYNC", bool, False, "1: remote rounds go through the torch-free proxy process (async drafting)."
    ),
    EnvVar(
        "DSV41_DRAFTER_SHADOW",
        bool,
        False,
        "1: every synchronous remote round is re-drafted locally "
        "and compared (parity counters); not with DSV41_DRAFTER_ASYNC.",
    ),
    EnvVar(
        "DSV41_DRAFTER_K",
        int,
        5,
        "Most drafts per request per round (also the engine's verify depth).",
        "tokens",
        0,
        64,
    ),
    EnvVar("DSV41_DRAFTER_TIMEOUT_MS", float, 100.0, "Deadline of one remote drafting round.", "ms", 1, 60_000),
    EnvVar(
        "DSV41_DRAFTER_DEPTH_POLICY",
        str,
        "",
        "Batch-aware depth, MAXBATCH:DEPTH steps (empty: 1:5,2:4,4:3,8:2,*:1; dsv41.drafter.policy).",
    ),
    EnvVar(
        "DSV41_DRAFTER_WATCHDOG_MS",
        float,
        2000.0,
        "A proxy whose heartbeat is older than this is killed and respawned.",
        "ms",
        10,
        600_000,
    ),
    EnvVar(
        "DSV41_DRAFTER_PROXY_RESPAWNS",
        int,
        3,
        "Proxy respawns allowed per DSV41_DRAFTER_PROXY_WINDOW_S; then the proxy stays down (target-only decoding).",
        "respawns",
        0,
        1000,
    ),
    EnvVar("DSV41_DRAFTER_PROXY_WINDOW_S", float, 60.0, "Window of the respawn budget.", "s", 0.001, 86_400),
    EnvVar(
        "DSV41_DRAFTER_PROXY_MEMLOCK",
        bool,
        True,
        "1: the async proxy locks its memory (mlockall) and reports it (gauge dsv41_drafter_proxy_memlock: "
        "1 locked, 2 refused, 3 off); the container needs CAP_IPC_LOCK.",
    ),
    EnvVar(
        "DSV41_DRAFTER_CAPACITY_MODE",
        bool,
        False,
        "1 with a remote drafter: the engine's KV budget grows by DSV41_DRAFTER_LOCAL_MEMORY_TOKENS.",
    ),
    EnvVar(
        "DSV41_DRAFTER_LOCAL_MEMORY_TOKENS",
        int,
        0,
        "KV tokens a local drafter's memory would hold (capacity mode).",
        "tokens",
        0,
        1 << 40,
    ),
    # ---- transport
    EnvVar(
        "DSV41_TRANSPORT_PURE", bool, False, "1: the pure-Python transport path even where the C++ extension is built."
    ),
    EnvVar(
        "DSV41_TRANSPORT_CLIENT_SPIN_US",
        int,
        50,
        "Busy-poll budget of a tcp row client waiting for a "
        "reply before it sleeps in poll (0: sleep at once); spins the engine thread's core while its "
        "rows are in flight; the lookup deadline still applies.",
        "us",
        0,
        10_000,
    ),
    EnvVar(
        "DSV41_TRANSPORT_SERVER_SPIN_US",
        int,
        0,
        "Busy-poll budget of a table-server client thread "
        "waiting for that client's next request before it blocks (0, the default: block at once); up to "
        "this much CPU per request; only for a server whose clients never share its cores.",
        "us",
        0,
        10_000,
    ),
    EnvVar(
        "DSV41_TRANSPORT_SERVER_MAX_CONNECTIONS",
        int,
        64,
        "Table-server data port: connections past this many "
        "open ones (or past half of them from one client address) are closed at once, so memory stays "
        "bounded (about 4.3 MB of send buffer per client).",
        "connections",
        1,
        65_536,
    ),
    EnvVar(
        "DSV41_TRANSPORT_SERVER_SEND_TIMEOUT_S",
        float,
        10.0,
        "Table-server data port: a client that reads "
        "nothing of its answer for this long is disconnected (SO_SNDTIMEO).",
        "s",
        0.05,
        3600,
    ),
    EnvVar(
        "DSV41_NIXL_PROGRESS_DELAY_US",
        int,
        1000,
        "Wait between polls of the NIXL server agent's progress thread (0: busy-spin, nixl_cu12's default).",
        "us",
        0,
        1_000_000,
    ),
    # ---- written by roles for restart-on-change and operators; the package does not act on them
    EnvVar("DSV41_RUNTIME_ROOT", str, "", "Read-only Engram runtime root staged by roles/engram_overlay."),
    EnvVar("DSV41_TABLES_MANIFEST", str, "", "Trusted manifest the table server serves (roles/engram_server)."),
    EnvVar("DSV41_TABLES_MANIFEST_SHA256", str, "", "sha256 of that manifest: a new one restarts the server."),
    EnvVar("DSV41_DRAFTER_FILES_SHA256", str, "", "sha256 of the drafter files: new ones restart the worker."),
    EnvVar("DSV41_SERVE_INPUTS_SHA256", str, "", "sha256 of the engine's inputs: new ones restart the engine."),
    EnvVar(
        "DSV41_ENGRAM_FAULT_DELAY_MS",
        float,
        0.0,
        "Fault drills only (candidate slow-rows): every Engram layer "
        "lookup's rows arrive this much later (remote: inside the lookup deadline, as from a slow server); "
        "rows stay exact. Never set in production.",
        "ms",
        0,
        10_000,
    ),
    EnvVar(
        "DSV41_BENCH_SPEC_FILE",
        str,
        "",
        "Workload spec of `dsv41 bench run` / `dsv41 window run` when --spec "
        "is not given (empty: the shipped public spec; real prompt sets stay outside the repository).",
    ),
    EnvVar(
        "DSV41_GREEDY_PROMPTS_FILE",
        str,
        "",
        "JSON list of {name, prompt}: the greedy reference prompts (empty: the six shipped ones).",
    ),
    EnvVar(
        "DSV41_WINDOW_TOKEN",
        str,
        "",
        "Set by window.yml on the controller during a HOLD: the harness's "
        "requests carry it (header X-DSV41-Window) and the held engine admits only them (/pause?window=).",
    ),
    EnvVar(
        "DSV41_OPERATOR_CREDENTIAL_FILE",
        str,
        "",
        "File (mode 0600) holding the operator credential: rank 0's "
        "engine and the vLLM fence require it on every state-changing route (/pause, /resume); the controller's "
        "clients send it (header X-DSV41-Operator). Empty on a server: those routes are refused (dsv41.authz).",
    ),
    EnvVar(
        "DSV41_CONTROL_HOSTS",
        str,
        "",
        "Comma-separated host names (besides IP literals and localhost) a "
        "state-changing request may name in its Host header (DNS-rebinding guard; dsv41.authz).",
    ),
    EnvVar(
        "DSV41_API_KEY_FILE",
        str,
        "",
        "Controller side: file (mode 0600) holding the OpenAI API key the "
        "project's clients send as 'Authorization: Bearer KEY' (vLLM's --api-key / VLLM_API_KEY on the server).",
    ),
]

#: The table: one row per variable, by name.
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _ROWS}

#: Old spelling -> new name; an old spelling in the environment is a :class:`ConfigError`.
RENAMED: dict[str, str] = {
    "VLLM_ENGRAM_REMOTE": "DSV41_ENGRAM_REMOTE",
    "VLLM_ENGRAM_REMOTE_TIMEOUT_MS": "DSV41_ENGRAM_REMOTE_TIMEOUT_MS",
    "VLLM_ENGRAM_REMOTE_REQUIRED": "DSV41_ENGRAM_REMOTE_REQUIRED",
}
