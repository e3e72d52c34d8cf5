"""Prometheus metrics of the lab engine, named like vLLM's where one exists.

vLLM names (``vllm:`` prefix, label ``model_name``): ``num_requests_running``,
``num_requests_waiting`` (gauges), ``prompt_tokens_total``, ``generation_tokens_total``,
``request_success_total{finished_reason}``, ``spec_decode_num_drafts_total``,
``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total`` (counters),
``time_to_first_token_seconds``, ``e2e_request_latency_seconds``, ``inter_token_latency_seconds``
(histograms).

Engram, per rank (label ``rank``, values gathered from every rank over torch.distributed):
``dsv41_engram_lookups_total``, ``_rows_total``, ``_fallbacks_total``, ``_transport_errors_total``,
``_refusals_total``, ``_reconnects_total``, ``_deadline_exceeded_total`` (lookups the engine
answered from the local reader because the remote missed ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS``), ``dsv41_engram_lookup_latency_seconds`` (summary:
``_sum``/``_count``), ``dsv41_engram_scale_bytes_total{value="0"|"255"}`` (reference-convention
special scale bytes seen) and ``dsv41_engram_nonfinite_values_total`` (values zeroed, see
docs/engine.md). ``dsv41_engine_spec_deadline_exceeded_total``: speculation rounds that went
without drafts because ``propose`` missed ``DSV41_DRAFTER_PROPOSE_DEADLINE_MS``. Drafter counters
(``Speculator.counters()``) as ``dsv41_drafter_<key>_total`` counters and the summary
``dsv41_drafter_propose_latency_seconds`` (see ``_DrafterCollector``).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from dsv41.engine.spec_decode import LEVEL_KEYS

ENGRAM_KEYS = ("lookups", "rows", "fallbacks", "transport_errors", "refusals", "reconnects", "deadline_exceeded")
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
# vLLM's inter-token latency buckets (seconds).
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngramCollector:
    def __init__(self, source: Callable[[], dict]) -> None:
        self._source = source

    def collect(self):
        per_rank = self._source()  # {rank: counters dict}
        fams = {
            k: CounterMetricFamily(f"dsv41_engram_{k}", f"Engram {k.replace('_', ' ')} per TP rank", labels=["rank"])
            for k in ENGRAM_KEYS
        }
        lat = SummaryMetricFamily(
            "dsv41_engram_lookup_latency_seconds", "Engram row lookup latency per rank", labels=["rank"]
        )
        sb = CounterMetricFamily(
            "dsv41_engram_scale_bytes",
            "Special UE8M0 scale bytes decoded (reference convention)",
            labels=["rank", "value"],
        )
        nf = CounterMetricFamily(
            "dsv41_engram_nonfinite_values",
            "Dequantized Engram values that were not finite and were zeroed",
            labels=["rank"],
        )
        for rank, c in sorted(per_rank.items()):
            r = str(rank)
            for k in ENGRAM_KEYS:
                fams[k].add_metric([r], float(c.get(k, 0)))
            lat.add_metric(
                [r], count_value=float(c.get("latency_count", 0)), sum_value=float(c.get("latency_sum_s", 0.0))
            )
            sb.add_metric([r, "0"], float(c.get("scale_bytes_0", 0)))
            sb.add_metric([r, "255"], float(c.get("scale_bytes_255", 0)))
            nf.add_metric([r], float(c.get("nonfinite_values", 0)))
        yield from fams.values()
        yield lat
        yield sb
        yield nf


class _DrafterCollector:
    """``Speculator.counters()`` as Prometheus types: ``latency_sum_s`` + ``latency_count`` ->
    summary ``dsv41_drafter_propose_latency_seconds`` (seconds); a key naming a maximum
    (``*max*``, e.g. ``parity_max_prob_diff``) or a level (:data:`~dsv41.engine.spec_decode.LEVEL_KEYS`:
    ``proxy_up``, ``proxy_state``, ``proxy_memlock``) -> gauge ``dsv41_drafter_<key>``; every other
    numeric key (monotonic since start, the Speculator contract) -> counter
    ``dsv41_drafter_<key>_total``."""

    def __init__(self, source: Callable[[], dict]) -> None:
        self._source = source

    def collect(self):
        try:
            counters = dict(self._source() or {})
        except Exception as exc:  # noqa: BLE001 - a broken speculator must not break /metrics
            yield GaugeMetricFamily(
                "dsv41_drafter_counters_error", f"Speculator.counters() failed: {exc}"[:200], value=1.0
            )
            return
        num = {str(k): float(v) for k, v in counters.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "latency_sum_s" in num or "latency_count" in num:
            lat = SummaryMetricFamily("dsv41_drafter_propose_latency_seconds", "Speculator propose() round latency")
            lat.add_metric([], count_value=num.pop("latency_count", 0.0), sum_value=num.pop("latency_sum_s", 0.0))
            yield lat
        for k, v in sorted(num.items()):
            name = "".join(ch if ch.isalnum() else "_" for ch in k)
            if k in LEVEL_KEYS or "max" in k.split("_"):
                yield GaugeMetricFamily(f"dsv41_drafter_{name}", f"Speculator {k}", value=v)
            else:
                yield CounterMetricFamily(f"dsv41_drafter_{name}", f"Speculator counter {k}", value=v)


class EngineMetrics:
    """All engine metrics in one private registry (``registry``), label ``model_name``.

    ``engram_source() -> {rank: counters}`` and ``drafter_source() -> dict`` are read at scrape.
    """

    def __init__(
        self, model_name: str, engram_source: Callable[[], dict], drafter_source: Callable[[], dict] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        R = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running set", lab, registry=R).labels(
            model_name
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for admission", lab, registry=R).labels(
            model_name
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", lab, registry=R).labels(
            model_name
        )
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lab, registry=R).labels(
            model_name
        )
        self._success = Counter("vllm:request_success", "Finished requests", lab + ["finished_reason"], registry=R)
        self.model_name = model_name
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Speculation rounds with drafts", lab, registry=R
        ).labels(model_name)
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", lab, registry=R
        ).labels(model_name)
        self.spec_accepted = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", lab, registry=R
        ).labels(model_name)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", lab, buckets=_TTFT_BUCKETS, registry=R
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency", lab, buckets=_TTFT_BUCKETS, registry=R
        ).labels(model_name)
        # vLLM's name; observed once per engine step that gives a request tokens (one SSE chunk).
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between steps emitting tokens, per request",
            lab,
            buckets=_ITL_BUCKETS,
            registry=R,
        ).labels(model_name)
        self.pause_drain_aborts = Counter(
            "dsv41_engine_pause_drain_aborts",
            "Requests aborted because a /pause?mode=wait drain timed out",
            lab,
            registry=R,
        ).labels(model_name)
        self.spec_deadline = Counter(
            "dsv41_engine_spec_deadline_exceeded",
            "Speculation rounds decoded without drafts: propose missed its deadline",
            lab,
            registry=R,
        ).labels(model_name)
        self.kv_tokens = Gauge(
            "dsv41_engine_kv_cache_tokens", "KV budget in tokens (incl. drafter capacity extra)", lab, registry=R
        ).labels(model_name)
        self.kv_extra_tokens = Gauge(
            "dsv41_engine_kv_extra_tokens", "KV tokens added because the drafter runs remotely", lab, registry=R
        ).labels(model_name)
        R.register(_EngramCollector(engram_source))
        if drafter_source is not None:
            R.register(_DrafterCollector(drafter_source))

    def finished(self, reason: str) -> None:
        """Count one finished request under ``finished_reason=reason``."""
        self._success.labels(self.model_name, reason).inc()
