"""Per-component rollback: which components can be removed on their own, what their
removal must look like on the hosts, and the check of the resulting behaviour.

The components and their resulting behaviour follow the seed's rollback table
(docs/promotion.md, "Per-component rollback"):

==================  =====================================================  ==================================
component           removal (role variables, then a serve restart)         resulting behaviour (checked)
==================  =====================================================  ==================================
``async_handoff``   ``spec_decode_async: false`` (``DSV41_DRAFTER_ASYNC``   synchronous remote rounds: the
                    unset on both ranks)                                    proxy counters stay still, rounds
                                                                            grow on the engine and the worker
``remote_drafter``  ``spec_decode_remote: false``,                          local drafting with the baseline
                    ``spec_decode_capacity_mode: false`` (no                KV budget: the worker's rounds stay
                    ``DSV41_DRAFTER_REMOTE``/capacity env;                  still, the engine's grow, KV gauge
                    ``DSV41_DRAFTER_LOCAL`` on the drafting ranks)          = ``serve_kv_cache_tokens``
``remote_engram``   ``engram_overlay_remote: false`` (no                    the local reader serves: the table
                    ``DSV41_ENGRAM_REMOTE*``/overlay env)                   server's requests stay still, the
                                                                            ranks' lookups grow, 0 fallbacks
==================  =====================================================  ==================================

Every check also needs the greedy references 6/6 identical and zero failed requests over the
same traffic. :func:`evaluate` is the pure decision (unit-tested); :func:`run` sends the traffic
and reads the counters (``dsv41.harness.http``; Prometheus text via its ``metric_samples``).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import asdict, dataclass, field

from dsv41 import envs as dsv41_envs
from dsv41.engine.spec_decode import LEVEL_KEYS
from dsv41.errors import Dsv41Error
from dsv41.harness import http, refs

#: name -> the behaviour the seed's rollback table names for it.
COMPONENTS: dict[str, str] = {
    "async_handoff": "synchronous remote drafting rounds on both ranks (DSV41_DRAFTER_ASYNC unset)",
    "remote_drafter": "local drafting with the baseline KV budget (no remote drafter env, no capacity mode)",
    "remote_engram": "the local Engram reader serves (no DSV41_ENGRAM_REMOTE*, overlay env removed)",
}

#: name -> the role variables that switch the component off (set on the Sparks over production's
#: values by playbooks/rollback_component.yml; every other variable keeps production's value).
ROLE_VARS: dict[str, dict[str, bool]] = {
    "async_handoff": {"spec_decode_async": False},
    "remote_drafter": {"spec_decode_remote": False, "spec_decode_capacity_mode": False},
    "remote_engram": {"engram_overlay_remote": False},
}

#: Finish reasons of ``vllm:request_success_total`` that count as failed requests.
FAILED_REASONS = ("abort", "error")


class ComponentError(Dsv41Error):
    """An unknown component name, or counters that cannot be read."""


def component(name: str) -> str:
    """``name`` if it is a known component; ComponentError (one line listing the known ones)
    otherwise."""
    if name not in COMPONENTS:
        shown = repr(name) if name else "(none given: -e component=NAME)"
        raise ComponentError(f"unknown component {shown}: choose one of {', '.join(sorted(COMPONENTS))}")
    return name


#: Prefixes of the Engram overlay's variables (DSV41_ENGRAM_REMOTE*, DSV41_RUNTIME_ROOT): after a
#: remote_engram rollback none of them may be present at all, whatever its value.
ENGRAM_OVERLAY_PREFIXES = ("DSV41_ENGRAM_REMOTE", "DSV41_RUNTIME_ROOT")


def env_problems(name: str, envs: dict[str, str], drafting_hosts: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What in the hosts' environment files still carries component ``name``.

    ``envs``: ``{host: text}`` with the host's drafter and Engram overlay env files concatenated;
    ``drafting_hosts``: hosts whose engine drafts (remote_drafter: they must draft locally).
    Values are read the way the engine reads them (:func:`dsv41.envs.parse`; a file the engine
    would refuse is a problem too). Returns one line per problem (empty: the component is gone
    from every host's files).
    """
    component(name)
    out = []
    for host, text in sorted(envs.items()):
        try:
            raw = dsv41_envs.parse_env_text(text, host)
            s = dsv41_envs.parse(raw)
        except Dsv41Error as exc:  # envs.ConfigError included
            out.append(f"{host}: the engine would refuse its env files: {exc}")
            continue
        if name == "async_handoff" and s.drafter_async:
            out.append(f"{host}: DSV41_DRAFTER_ASYNC=1 (async handoff still configured)")
        elif name == "remote_drafter":
            if s.drafter_remote:
                out.append(f"{host}: DSV41_DRAFTER_REMOTE={s.drafter_remote} (remote drafter still configured)")
            if s.drafter_capacity_mode or s.drafter_local_memory_tokens:
                out.append(
                    f"{host}: capacity mode {int(s.drafter_capacity_mode)} with {s.drafter_local_memory_tokens} "
                    f"extra KV tokens (remote drafter still configured)"
                )
            if host in drafting_hosts and not s.drafter_local:
                out.append(f"{host}: no DSV41_DRAFTER_LOCAL (this rank drafts; it must draft locally)")
        elif name == "remote_engram":
            for key in sorted(k for k in raw if k.startswith(ENGRAM_OVERLAY_PREFIXES)):
                out.append(f"{host}: {key}={raw[key]} (remote Engram overlay env still present)")
    return out


@dataclass
class Snapshot:
    """Counters read once. ``engine``: rank 0's speculator counters (``dsv41_drafter_*``, the
    ``_total`` dropped) plus ``spec_drafts`` (``vllm:spec_decode_num_drafts_total``),
    ``kv_tokens``/``kv_extra_tokens`` (gauges) and ``finished_<reason>``; ``engram``:
    ``{rank: {lookups, fallbacks, ...}}`` from rank 0's ``/metrics``; ``worker``: the drafter
    worker's ``dsv41_drafter_*`` values; ``server``: the table server's ``dsv41_engram_*``
    unlabelled values (``requests``, ``rows_served``, ...)."""

    engine: dict = field(default_factory=dict)
    engram: dict = field(default_factory=dict)
    worker: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)


def parse_engine(text: str) -> tuple[dict, dict]:
    """Rank 0's ``/metrics`` text -> (``engine`` dict, ``engram`` dict) of :class:`Snapshot`."""
    samples = http.metric_samples(text, what="rank 0 metrics", error=ComponentError)  # one clear error first
    engine = refs.flat_values(text, "dsv41_drafter_")
    for name, labels, value in samples:
        if name == "vllm:spec_decode_num_drafts_total":
            engine["spec_drafts"] = value
        elif name == "dsv41_engine_kv_cache_tokens":
            engine["kv_tokens"] = value
        elif name == "dsv41_engine_kv_extra_tokens":
            engine["kv_extra_tokens"] = value
        elif name == "vllm:request_success_total":
            key = "finished_" + labels.get("finished_reason", "")
            engine[key] = engine.get(key, 0.0) + value
    return engine, refs.engram_counters(text)


def _get(url: str, timeout_s: float) -> str:
    return http.request(
        "GET", url, what=f"cannot read metrics at {url}", timeout_s=timeout_s, error=ComponentError
    ).text


def snapshot(
    engine_url: str, worker_url: str, server_url: str, timeout_s: float = 10.0, rank_urls: dict[str, str] | None = None
) -> Snapshot:
    """Read rank 0's, the drafter worker's and the table server's ``/metrics`` (full URLs) and,
    with ``rank_urls`` (``{rank: url}``, :func:`dsv41.harness.rank_metrics.urls`: under vLLM each
    rank's overlay endpoint), every rank's Engram and drafter counters from there; an unreachable
    rank endpoint is a ComponentError naming the rank and the endpoint."""
    text = _get(engine_url, timeout_s)
    if rank_urls:
        from dsv41.harness import rank_metrics as RM

        extra = {r: u for r, u in rank_urls.items() if u != engine_url}
        text += "\n" + RM.fetch_text(extra, timeout_s, error=ComponentError) if extra else ""
    engine, engram = parse_engine(text)
    worker = refs.flat_values(_get(worker_url, timeout_s), "dsv41_drafter_")
    server = refs.flat_values(_get(server_url, timeout_s), "dsv41_engram_")
    return Snapshot(engine, engram, worker, server)


def settled_snapshot(
    engine_url: str,
    worker_url: str,
    server_url: str,
    timeout_s: float = 10.0,
    settle_s: float = 5.0,
    interval_s: float = 0.5,
    rank_urls: dict[str, str] | None = None,
) -> Snapshot:
    """:func:`snapshot` repeated until two reads ``interval_s`` apart agree on the worker's and
    the table server's counters (both count a request after its reply is sent), at most
    ``settle_s`` seconds; returns the last read."""
    snap = snapshot(engine_url, worker_url, server_url, timeout_s, rank_urls)
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        nxt = snapshot(engine_url, worker_url, server_url, timeout_s, rank_urls)
        if nxt.worker == snap.worker and nxt.server == snap.server:
            return nxt
        snap = nxt
    return snap


def _d(after: dict, before: dict, key: str) -> float:
    return float(after.get(key, 0.0)) - float(before.get(key, 0.0))


@dataclass
class Check:
    """One named check: ``ok`` and a one-line ``detail`` with the numbers it judged."""

    name: str
    ok: bool
    detail: str


def evaluate(
    name: str,
    before: Snapshot,
    after: Snapshot,
    *,
    refs_identical: int,
    refs_total: int,
    failed_requests: int,
    sent_requests: int,
    env_problems_found: list[str],
    kv_baseline: int,
    ranks: list[str] | tuple[str, ...] = ("0", "1"),
) -> list[Check]:
    """The checks of component ``name``'s rollback over traffic between ``before`` and ``after``.

    ``refs_identical``/``refs_total``: greedy reference prompts identical / run;
    ``failed_requests``/``sent_requests``: requests of the traffic that failed / were sent (the
    engine's ``finished_abort``/``finished_error`` deltas are added to the failures);
    ``env_problems_found``: :func:`env_problems` of the hosts' files; ``kv_baseline``: the KV
    budget without capacity mode (tokens, ``serve_kv_cache_tokens``); ``ranks``: TP ranks whose
    Engram counters are judged. Returns every check, passing or not (order fixed).
    """
    component(name)
    e0, e1 = before.engine, after.engine
    failed = failed_requests + int(sum(_d(e1, e0, f"finished_{r}") for r in FAILED_REASONS))
    checks = [
        Check(
            "configuration",
            not env_problems_found,
            "; ".join(env_problems_found) or f"no {name} setting left in the hosts' env files",
        ),
        Check(
            "greedy references",
            refs_total > 0 and refs_identical == refs_total,
            f"{refs_identical}/{refs_total} identical",
        ),
        Check("failed requests", failed == 0, f"{failed} failed of {sent_requests} sent"),
    ]
    rounds = _d(e1, e0, "rounds")
    worker_rounds = _d(after.worker, before.worker, "rounds")
    if name == "async_handoff":
        moved = {
            k: _d(e1, e0, k)
            for k in sorted(set(e0) | set(e1))
            if k.startswith("proxy_") and k not in LEVEL_KEYS and _d(e1, e0, k) != 0
        }
        proxy_up = int(e1.get("proxy_up", 0))
        checks += [
            Check(
                "async counters still",
                not moved and proxy_up == 0,
                f"proxy counters moved {moved}" if moved else f"no proxy counter moved (proxy_up {proxy_up})",
            ),
            Check(
                "synchronous rounds continue",
                rounds > 0 and worker_rounds > 0,
                f"engine rounds +{rounds:g}, worker rounds +{worker_rounds:g}, "
                f"failed closed +{_d(e1, e0, 'fail_closed_rounds'):g}",
            ),
        ]
    elif name == "remote_drafter":
        kv, extra = e1.get("kv_tokens"), e1.get("kv_extra_tokens", 0.0)
        checks += [
            Check("worker rounds still", worker_rounds == 0, f"worker rounds +{worker_rounds:g}"),
            Check(
                "local speculation",
                rounds > 0 and _d(e1, e0, "spec_drafts") > 0,
                f"engine rounds +{rounds:g}, vllm:spec_decode_num_drafts +{_d(e1, e0, 'spec_drafts'):g}",
            ),
            Check(
                "KV budget baseline",
                kv is not None and int(kv) == int(kv_baseline) and extra == 0,
                f"kv_cache_tokens {kv if kv is None else int(kv)} (baseline {kv_baseline}), extra {int(extra)}",
            ),
        ]
    else:  # remote_engram
        served = _d(after.server, before.server, "requests")
        per_rank = {
            r: (
                _d(after.engram.get(r, {}), before.engram.get(r, {}), "lookups"),
                _d(after.engram.get(r, {}), before.engram.get(r, {}), "fallbacks"),
            )
            for r in ranks
        }
        checks += [
            Check(
                "remote lookups still",
                served == 0,
                f"table server requests +{served:g}, rows +{_d(after.server, before.server, 'rows_served'):g}",
            ),
            Check(
                "local reader serves",
                all(lk > 0 and fb == 0 for lk, fb in per_rank.values()),
                ", ".join(f"rank {r} lookups +{lk:g} fallbacks +{fb:g}" for r, (lk, fb) in per_rank.items()),
            ),
        ]
    return checks


@dataclass
class Result:
    """What :func:`run` saw: the checks, the two snapshots, the traffic and the time it took."""

    component: str
    checks: list[Check]
    before: Snapshot
    after: Snapshot
    sent: int
    failed: int
    errors: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        """Every check passed."""
        return all(c.ok for c in self.checks)

    def failed_checks(self) -> list[Check]:
        """The checks that did not pass."""
        return [c for c in self.checks if not c.ok]

    def message(self) -> str:
        """One line: which checks failed and why (empty when all passed)."""
        return "; ".join(f"{c.name}: {c.detail}" for c in self.failed_checks())

    def to_dict(self) -> dict:
        """JSON-ready form (the module's result; ``failed_requests``, since Ansible owns ``failed``)."""
        return {
            "component": self.component,
            "ok": self.ok,
            "checks": [asdict(c) for c in self.checks],
            "before": asdict(self.before),
            "after": asdict(self.after),
            "sent_requests": self.sent,
            "failed_requests": self.failed,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
        }


def run(
    name: str,
    endpoint: str,
    refs_path: str,
    *,
    engine_metrics_url: str,
    worker_metrics_url: str,
    server_metrics_url: str,
    envs: dict[str, str],
    kv_baseline: int,
    drafting_hosts: list[str] | tuple[str, ...] = (),
    burst: int = 8,
    max_tokens: int = 16,
    timeout_s: float = 120.0,
    rank_urls: dict[str, str] | None = None,
) -> Result:
    """Send traffic to ``endpoint`` (rank 0's API) and judge component ``name``'s rollback.

    Traffic: the greedy reference prompts of ``refs_path`` (compared with the recorded ids,
    ``dsv41.harness.refs``), then ``burst`` concurrent greedy completions of ``max_tokens``
    tokens. Counters are read before and after (:func:`settled_snapshot`; ``rank_urls``: every
    rank's counters endpoint, :func:`snapshot`). Raises
    ComponentError (unknown name, unreadable metrics) or refs.RefsError (no refs file); a failed
    request is counted, not raised.
    """
    component(name)
    t0 = time.monotonic()
    problems = env_problems(name, envs, drafting_hosts)
    recorded = refs.load_refs(refs_path)
    before = settled_snapshot(engine_metrics_url, worker_metrics_url, server_metrics_url, rank_urls=rank_urls)
    errors: list[str] = []
    identical, total = 0, len(recorded.get("prompts", []))
    try:
        cmp = refs.verify(endpoint, recorded, timeout_s)
        identical, total = cmp.identical, cmp.total
    except refs.RefsError as exc:
        errors.append(str(exc))
    model = recorded.get("model") or refs.served_model(endpoint)
    prompts = [p for _, p in refs.PROMPTS]

    def one(i: int) -> None:
        refs.generate(endpoint, prompts[i % len(prompts)], model, max_tokens, timeout_s)

    with cf.ThreadPoolExecutor(max_workers=max(1, burst)) as pool:
        for fut in [pool.submit(one, i) for i in range(burst)]:
            try:
                fut.result()
            except refs.RefsError as exc:
                errors.append(str(exc))
    after = settled_snapshot(engine_metrics_url, worker_metrics_url, server_metrics_url, rank_urls=rank_urls)
    sent = total + burst
    checks = evaluate(
        name,
        before,
        after,
        refs_identical=identical,
        refs_total=total,
        failed_requests=len(errors),
        sent_requests=sent,
        env_problems_found=problems,
        kv_baseline=kv_baseline,
    )
    return Result(name, checks, before, after, sent, len(errors), errors, time.monotonic() - t0)
