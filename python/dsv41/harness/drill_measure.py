"""What a drill measures (:mod:`dsv41.harness.drill`): counter samples, the load, and the pure
computations on the samples (rates, health, recovery time, deltas).

A sampler reads rank 0's ``/metrics`` every ``interval_s`` seconds: ``dsv41_engram_*_total
{rank="R"}`` carries every rank's row-source counters (rank 1 is headless and has no HTTP
endpoint of its own; the engine gathers its counters), ``dsv41_drafter_*_total`` the speculator's
(fail-closed rounds, proxy respawns), ``vllm:generation_tokens_total`` the tokens generated.
The table server's and the drafter worker's own ``/metrics`` are read too (best effort: they are
down during their own fault). The load is the bench client (:mod:`dsv41.harness.bench`):
several concurrent streams over the spec's short, code and long prompts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from dsv41.errors import Dsv41Error


@dataclasses.dataclass
class Sample:
    """One read of the counters at ``t`` seconds after the drill's start (monotonic clock).

    ``engram``: ``{rank: {"lookups", "fallbacks", "remote_rows"}}`` (cumulative); ``drafter``:
    rank 0's speculator counters (``rounds``, ``fail_closed_rounds``, ``proxy_respawns``, ...);
    ``gen_tokens``: ``vllm:generation_tokens_total``; ``server_requests`` / ``worker_rounds``:
    the table server's and drafter worker's own counters (None when unreachable); ``error``: why
    rank 0's ``/metrics`` could not be read (then the counters are empty)."""

    t: float
    engram: dict = dataclasses.field(default_factory=dict)
    drafter: dict = dataclasses.field(default_factory=dict)
    gen_tokens: float | None = None
    server_requests: float | None = None
    worker_rounds: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def read_sample(
    t: float, api_metrics: str, server_metrics: str | None, worker_metrics: str | None, timeout_s: float = 2.0
) -> Sample:
    """Read every counter the drill tracks (see :class:`Sample`); never raises for an unreachable
    endpoint (rank 0's goes into ``error``, the others become None)."""
    from dsv41.harness import http, refs

    s = Sample(t)
    try:
        text = http.request("GET", api_metrics, what=f"cannot read metrics at {api_metrics}", timeout_s=timeout_s).text
        s.engram = {
            r: {k: v for k, v in c.items() if k in ("lookups", "fallbacks", "remote_rows")}
            for r, c in refs.engram_counters(text).items()
        }
        s.drafter = refs.flat_values(text, "dsv41_drafter_")
        s.gen_tokens = sum(v for n, _l, v in http.metric_samples(text) if n == "vllm:generation_tokens_total")
    except Dsv41Error as exc:
        s.error = str(exc)
    for url, name, attr in (
        (server_metrics, "dsv41_engram_requests_total", "server_requests"),
        (worker_metrics, "dsv41_drafter_rounds_total", "worker_rounds"),
    ):
        if not url:
            continue
        try:
            vals = [v for n, _l, v in http.get_metrics(url, timeout_s=timeout_s) if n == name]
            setattr(s, attr, sum(vals) if vals else None)
        except Dsv41Error:
            pass
    return s


class Sampler:
    """Calls ``read()`` (-> :class:`Sample`) every ``interval_s`` seconds on a thread."""

    def __init__(self, read: Callable[[], Sample], interval_s: float = 1.0) -> None:
        self.read, self.interval_s = read, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="drill-sampler", daemon=True)

    def _loop(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            self.samples.append(self.read())
            nxt += self.interval_s
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        return self.samples


#: Seconds a load stream waits after a failed request before its next one: a refused or failing
#: endpoint (a fault the drill injected) is retried at this pace, not in a busy loop that starves
#: the sampler on a 2-core controller and floods the report with identical failures.
FAILED_PAUSE_S = 0.2


class Load:
    """The bench client's requests (``bench.request_body`` / ``bench.stream_one``) on ``streams``
    threads, cycling through the spec's prompts with a fresh seed and cache salt per request,
    until :meth:`stop`. Each result: ``bench.RequestResult.to_dict()`` plus ``t_start`` /
    ``t_end`` (seconds on ``clock``, the drill's timeline); a failed request (refused, HTTP
    error, timeout) is a result with ``ok`` False and ``error`` saying why, and the stream pauses
    :data:`FAILED_PAUSE_S` before its next request.

    The clients are made here, in the caller's thread: a malformed ``endpoint`` raises
    ``bench.BenchError`` (one line) from the constructor instead of killing each load thread.
    """

    def __init__(self, endpoint: str, model: str, spec: dict, streams: int, clock: Callable[[], float]) -> None:
        from dsv41.harness import bench

        self.endpoint, self.model, self.spec, self.streams, self.clock = endpoint, model, spec, streams, clock
        self.items = bench.plan_requests(dict(spec, repeats=1), "x")
        self.salt = uuid.uuid4().hex[:12]
        self.results: list[dict] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # The bench's own client settings (timeouts, no proxy variables, the endpoint checked).
        self._clients = [bench._client(spec["timeout_s"], endpoint) for _ in range(streams)]
        self._threads = [
            threading.Thread(target=self._worker, args=(c,), name=f"drill-load-{i}", daemon=True)
            for i, c in enumerate(self._clients)
        ]

    def _worker(self, client) -> None:
        from dsv41.harness import bench

        with client as c:
            while not self._stop.is_set():
                with self._lock:
                    k = self._next
                    self._next += 1
                it = self.items[k % len(self.items)]
                salt = f"drill-{self.salt}-{k}" if self.spec["cache_salt"] else None
                body = bench.request_body(
                    self.model, it["prompt"], self.spec["seed"] + k, it["max_tokens"], self.spec["sampler"], salt
                )
                t0 = self.clock()
                r = bench.stream_one(c, self.endpoint, body, it["prompt_id"], it["category"])
                self.results.append({**r.to_dict(keep_steps=False), "t_start": t0, "t_end": self.clock()})
                if not r.ok:
                    self._stop.wait(FAILED_PAUSE_S)

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[dict]:
        """Stop submitting, wait for the requests in flight, return every result."""
        self._stop.set()
        for t in self._threads:
            t.join()
        return sorted(self.results, key=lambda r: r["t_start"])


# ---- computations on the samples (pure) ----------------------------------------------------------


def _engram_total(s: Sample, key: str) -> float:
    return sum(c.get(key, 0.0) for c in s.engram.values())


def timeline(samples: Sequence[Sample]) -> list[dict]:
    """Per interval between consecutive readable samples: ``{"t": midpoint s, "tok_s",
    "fallbacks_s" (all ranks), "fail_closed_s", "lookups_s"}`` (rates per second)."""
    ok = [s for s in samples if s.ok]
    out = []
    for a, b in zip(ok, ok[1:], strict=False):
        dt = b.t - a.t
        if dt <= 0:
            continue
        tok = (b.gen_tokens - a.gen_tokens) / dt if a.gen_tokens is not None and b.gen_tokens is not None else None
        out.append(
            {
                "t": (a.t + b.t) / 2,
                "tok_s": tok,
                "fallbacks_s": (_engram_total(b, "fallbacks") - _engram_total(a, "fallbacks")) / dt,
                "lookups_s": (_engram_total(b, "lookups") - _engram_total(a, "lookups")) / dt,
                "fail_closed_s": (b.drafter.get("fail_closed_rounds", 0.0) - a.drafter.get("fail_closed_rounds", 0.0))
                / dt,
            }
        )
    return out


def healthy_interval(a: Sample, b: Sample, ranks: Sequence[str], drafter: bool) -> bool:
    """True when, between ``a`` and ``b``, every rank in ``ranks`` counted Engram lookups and no
    fallback and (``drafter``) rank 0 ran drafting rounds and no fail-closed round."""
    if not (a.ok and b.ok):
        return False
    for r in ranks:
        ca, cb = a.engram.get(r), b.engram.get(r)
        if ca is None or cb is None:
            return False
        if (
            cb.get("lookups", 0.0) - ca.get("lookups", 0.0) <= 0
            or cb.get("fallbacks", 0.0) - ca.get("fallbacks", 0.0) != 0
        ):
            return False
    if drafter:
        if b.drafter.get("rounds", 0.0) - a.drafter.get("rounds", 0.0) <= 0:
            return False
        if b.drafter.get("fail_closed_rounds", 0.0) - a.drafter.get("fail_closed_rounds", 0.0) != 0:
            return False
    return True


def recovery_time(
    samples: Sequence[Sample], t_clear: float, ranks: Sequence[str], drafter: bool = True, stable_s: float = 3.0
) -> float | None:
    """Seconds from clearing the fault (``t_clear``, on the samples' clock) until the system is
    back: the start of the first run of consecutive :func:`healthy_interval` s lasting at least
    ``stable_s`` seconds, among intervals starting at or after ``t_clear``. ``0.0`` when healthy
    from the first sample after clearing (resolution: the sampling interval); None when it never
    recovered within the samples."""
    after = [s for s in samples if s.t >= t_clear]
    run_start: Sample | None = None
    for a, b in zip(after, after[1:], strict=False):
        if healthy_interval(a, b, ranks, drafter):
            if run_start is None:
                run_start = a
            if b.t - run_start.t >= stable_s:
                return max(0.0, run_start.t - t_clear)
        else:
            run_start = None
    return None


def throughput_recovery_time(
    samples: Sequence[Sample], t_inject: float, t_clear: float, frac: float = 0.5, window_s: float = 3.0
) -> float | None:
    """Seconds from ``t_clear`` until generation is back to at least ``frac`` of its pre-fault mean:
    the first interval (of :func:`timeline`, midpoint at or after ``t_clear``) from which the mean
    tok/s of the intervals within ``window_s`` seconds reaches ``frac`` x the mean before
    ``t_inject``. None without a baseline, or when it never gets there within the samples (or
    too few samples remain for a full window)."""
    rates = [r for r in timeline(samples) if r["tok_s"] is not None]
    before = [r["tok_s"] for r in rates if r["t"] < t_inject]
    if not before:
        return None
    want = frac * sum(before) / len(before)
    after = [r for r in rates if r["t"] >= t_clear]
    for i, r in enumerate(after):
        win = [x["tok_s"] for x in after[i:] if x["t"] <= r["t"] + window_s]
        if after[-1]["t"] < r["t"] + window_s - 1e-9:
            return None
        if sum(win) / len(win) >= want:
            return max(0.0, r["t"] - t_clear)
    return None


def counter_deltas(samples: Sequence[Sample], t0: float | None = None, t1: float | None = None) -> dict:
    """Counter deltas between the first and the last readable sample within ``[t0, t1]``:
    ``{"engram": {rank: {"lookups", "fallbacks", "remote_rows"}}, "drafter": {...}, "gen_tokens",
    "server_requests", "worker_rounds", "seconds"}``; empty dicts / None with fewer than two."""
    sel = [s for s in samples if s.ok and (t0 is None or s.t >= t0) and (t1 is None or s.t <= t1)]
    if len(sel) < 2:
        return {
            "engram": {},
            "drafter": {},
            "gen_tokens": None,
            "server_requests": None,
            "worker_rounds": None,
            "seconds": 0.0,
        }
    a, b = sel[0], sel[-1]

    def d(x, y):
        return None if x is None or y is None else y - x

    return {
        "engram": {r: {k: v - a.engram.get(r, {}).get(k, 0.0) for k, v in c.items()} for r, c in b.engram.items()},
        "drafter": {
            k: v - a.drafter.get(k, 0.0)
            for k, v in b.drafter.items()
            if k
            in (
                "rounds",
                "fail_closed_rounds",
                "proxy_respawns",
                "proxy_spawns",
                "watchdog_fires",
                "timeouts",
                "unavailable",
                "reconnects",
                "proxy_down",
                "proxy_gave_up",
            )
        },
        "gen_tokens": d(a.gen_tokens, b.gen_tokens),
        "server_requests": d(a.server_requests, b.server_requests),
        "worker_rounds": d(a.worker_rounds, b.worker_rounds),
        "seconds": b.t - a.t,
    }
