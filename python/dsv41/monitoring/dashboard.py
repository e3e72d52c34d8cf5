"""The dsv41-offload Grafana dashboard as code (Grafana's ``grafana-foundation-sdk`` builders).

``PANELS`` is the single definition: rows of panels, each with its PromQL expressions (vLLM's
metric names as in vLLM's own Grafana dashboard, plus the project's ``dsv41_*``; jobs as
roles/monitoring's file_sd targets name them). :func:`build` turns it into a dashboard,
:func:`render` into the JSON checked in at monitoring/grafana/dsv41-offload.json (a test
regenerates and compares), and tests evaluate every expression against the lab's Prometheus
(``$__rate_interval`` replaced by :data:`LAB_RATE_INTERVAL`). Annotations: window start/end, HOLD
taken/released and production's package changing (the operations exporter's gauges).
"""

from __future__ import annotations

from dsv41 import fileio

UID = "dsv41-offload"
TITLE = "dsv41-offload: serving, Engram, drafting, operations"
# $__rate_interval is Grafana's; evaluated outside Grafana (tests, the docs' rendering) it becomes this.
LAB_RATE_INTERVAL = "1m"

_Q = 'histogram_quantile({q}, sum by (le) (rate({m}_bucket{{job="dsv41-api"}}[$__rate_interval])))'


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [(_Q.format(q=q, m=metric), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


# (row title, [(panel title, kind, unit, [(expr, legend)], description)])
PANELS: list[tuple[str, list[tuple[str, str, str, list[tuple[str, str]], str]]]] = [
    (
        "Serving (rank 0's API; every request and step spans both TP ranks)",
        [
            (
                "TTFT quantiles",
                "timeseries",
                "s",
                _quantiles("vllm:time_to_first_token_seconds"),
                "vllm:time_to_first_token_seconds histogram",
            ),
            (
                "Step time quantiles",
                "timeseries",
                "s",
                _quantiles("vllm:inter_token_latency_seconds"),
                "vllm:inter_token_latency_seconds: one observation per engine step that emits tokens",
            ),
            (
                "Tokens/s",
                "timeseries",
                "short",
                [
                    ('sum(rate(vllm:generation_tokens_total{job="dsv41-api"}[$__rate_interval]))', "generated"),
                    ('sum(rate(vllm:prompt_tokens_total{job="dsv41-api"}[$__rate_interval]))', "prompt"),
                ],
                "vllm:generation_tokens_total and vllm:prompt_tokens_total",
            ),
            (
                "Requests",
                "timeseries",
                "short",
                [
                    ('sum(vllm:num_requests_running{job="dsv41-api"})', "running"),
                    ('sum(vllm:num_requests_waiting{job="dsv41-api"})', "waiting"),
                ],
                "vllm:num_requests_running / _waiting",
            ),
        ],
    ),
    (
        "Engram per TP rank (lookups are counted by the rank that makes them)",
        [
            (
                "Engram lookups/s",
                "timeseries",
                "short",
                [
                    (
                        'sum by (rank) (rate(dsv41_engram_lookups_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "rank {{rank}}",
                    ),
                ],
                "dsv41_engram_lookups_total",
            ),
            (
                "Engram rows/s",
                "timeseries",
                "short",
                [
                    (
                        'sum by (rank) (rate(dsv41_engram_rows_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "rank {{rank}}",
                    ),
                    (
                        'sum(rate(dsv41_engram_rows_served_total{job="dsv41-table-server"}[$__rate_interval]))',
                        "served by the table server",
                    ),
                ],
                "rows fetched per rank and rows the table server served",
            ),
            (
                "Engram fallbacks/s",
                "timeseries",
                "short",
                [
                    (
                        'sum by (rank) (rate(dsv41_engram_fallbacks_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "fallbacks rank {{rank}}",
                    ),
                    (
                        'sum by (rank) (rate(dsv41_engram_deadline_exceeded_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "deadline missed rank {{rank}}",
                    ),
                ],
                "lookups answered from the rank's exact local tables",
            ),
            (
                "Engram lookup latency (mean)",
                "timeseries",
                "s",
                [
                    (
                        'sum by (rank) (rate(dsv41_engram_lookup_latency_seconds_sum{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))'
                        ' / sum by (rank) (rate(dsv41_engram_lookup_latency_seconds_count{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "rank {{rank}}",
                    ),
                    (
                        'histogram_quantile(0.99, sum by (le) (rate(dsv41_engram_request_seconds_bucket{job="dsv41-table-server"}[$__rate_interval])))',
                        "table server handling p99",
                    ),
                ],
                "dsv41_engram_lookup_latency_seconds (summary, per rank) and the server's dsv41_engram_request_seconds",
            ),
            (
                "Engram transport errors and refusals/s",
                "timeseries",
                "short",
                [
                    (
                        'sum by (rank) (rate(dsv41_engram_transport_errors_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval])'
                        ' + rate(dsv41_engram_refusals_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "rank {{rank}}",
                    ),
                    (
                        'sum by (reason) (rate(dsv41_engram_refusals_total{job="dsv41-table-server"}[$__rate_interval])) or vector(0)',
                        "server refused {{reason}}",
                    ),
                ],
                "client-side errors per rank; server-side refusals by reason",
            ),
            (
                "Table server",
                "timeseries",
                "short",
                [
                    ('dsv41_engram_ready{job="dsv41-table-server"}', "ready {{host}}"),
                    ('dsv41_engram_connections{job="dsv41-table-server"}', "connections {{host}}"),
                ],
                "dsv41_engram_ready, dsv41_engram_connections",
            ),
            (
                "vLLM overlay per rank",
                "timeseries",
                "short",
                [
                    (
                        'max by (rank, state) (dsv41_overlay_state{job="dsv41-overlay"}) or vector(0)',
                        "rank {{rank}} {{state}}",
                    ),
                    (
                        'max by (rank, implementation) (dsv41_overlay_transport_info{job="dsv41-overlay"}) or vector(0)',
                        "rank {{rank}} transport {{implementation}}",
                    ),
                ],
                "under vLLM: dsv41_overlay_state (1 = the rank's state; active expected) and the transport each rank "
                "imported; one unlabelled 0 where no rank runs the overlay (the stand-in engine, vLLM's own code)",
            ),
        ],
    ),
    (
        "Drafting (rank 0 drafts; the worker runs on the offload host)",
        [
            (
                "Drafter rounds/s",
                "timeseries",
                "short",
                [
                    (
                        'sum(rate(dsv41_drafter_rounds_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "engine rounds",
                    ),
                    (
                        'sum(rate(dsv41_drafter_rounds_total{job="dsv41-drafter-worker"}[$__rate_interval]))',
                        "worker rounds",
                    ),
                ],
                "dsv41_drafter_rounds_total on rank 0 and on the worker",
            ),
            (
                "Accepted tokens per round",
                "timeseries",
                "short",
                [
                    (
                        'sum(rate(vllm:spec_decode_num_accepted_tokens_total{job="dsv41-api"}[$__rate_interval]))'
                        ' / sum(rate(vllm:spec_decode_num_drafts_total{job="dsv41-api"}[$__rate_interval]))',
                        "accepted / round",
                    ),
                    (
                        'sum(rate(vllm:spec_decode_num_accepted_tokens_total{job="dsv41-api"}[$__rate_interval]))'
                        ' / sum(rate(vllm:spec_decode_num_draft_tokens_total{job="dsv41-api"}[$__rate_interval]))',
                        "acceptance rate",
                    ),
                ],
                "vLLM's spec_decode counters",
            ),
            (
                "Fail-closed rounds, respawns, watchdog",
                "timeseries",
                "short",
                [
                    (
                        'sum(increase(dsv41_drafter_fail_closed_rounds_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "fail-closed rounds",
                    ),
                    (
                        'sum(increase(dsv41_drafter_proxy_respawns_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "proxy respawns",
                    ),
                    (
                        'sum(increase(dsv41_drafter_watchdog_fires_total{job=~"dsv41-api|dsv41-overlay"}[$__rate_interval]))',
                        "watchdog fires",
                    ),
                ],
                "per rate interval",
            ),
        ],
    ),
    (
        "Admission, windows, promotion, hosts",
        [
            (
                "Admission and operations",
                "timeseries",
                "short",
                [
                    ('max(dsv41_admission_held{job="dsv41-ops"})', "HOLD"),
                    ('max(dsv41_window_active{job="dsv41-ops"})', "window active"),
                    ('max(dsv41_promotion_journal_open{job="dsv41-ops"})', "promotion journal open"),
                ],
                "1 = held / active / open (dsv41 monitor exporter)",
            ),
            (
                "Firing dsv41 alerts",
                "timeseries",
                "short",
                [
                    (
                        'count by (alertname) (ALERTS{alertstate="firing", alertname=~"Dsv41.*"}) or vector(0)',
                        "{{alertname}}",
                    ),
                ],
                "ALERTS from roles/monitoring's rules",
            ),
            (
                "Targets up",
                "timeseries",
                "short",
                [
                    ('up{job=~"dsv41-.*|node"}', "{{job}} {{host}}"),
                ],
                "1 = scraped",
            ),
            (
                "Table host RAM available",
                "timeseries",
                "bytes",
                [
                    ('node_memory_MemAvailable_bytes{job="node", dsv41_role="offload"}', "{{host}} available"),
                ],
                "node exporter on the offload host (the tables are resident)",
            ),
        ],
    ),
]

ANNOTATIONS = [
    # (name, expr, colour): a window started or ended; admission HOLD taken or released;
    # production's package pointer changed (promote, rollback or deploy)
    ("Window start/end", 'changes(max(dsv41_window_active{job="dsv41-ops"})[2m:15s]) > 0', "blue"),
    ("HOLD taken/released", 'changes(max(dsv41_admission_held{job="dsv41-ops"})[2m:15s]) > 0', "orange"),
    (
        "Production package changed",
        'changes(max(dsv41_promotion_current_since_seconds{job="dsv41-ops"})[2m:15s]) > 0',
        "purple",
    ),
]


def expressions() -> list[tuple[str, str]]:
    """Every panel expression as ``(panel title, expr)``, in dashboard order."""
    return [(p[0], e) for _row, panels in PANELS for p in panels for e, _legend in p[3]]


def build():
    """The dashboard (a ``grafana_foundation_sdk.models.dashboard.Dashboard``)."""
    from grafana_foundation_sdk.builders import dashboard as gd, prometheus as gp, timeseries as gt
    from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    b = (
        gd.Dashboard(TITLE)
        .uid(UID)
        .tags(["dsv41", "vllm", "engram"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("utc")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .editable()
        .with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for name, expr, color in ANNOTATIONS:
        b = b.annotation(gd.AnnotationQuery().name(name).datasource(ds).enable(True).icon_color(color).expr(expr))
    for row, panels in PANELS:
        b = b.with_row(gd.Row(row))
        for title, _kind, unit, exprs, desc in panels:
            p = gt.Panel().title(title).description(desc).unit(unit).datasource(ds).height(8).span(12).fill_opacity(10)
            for i, (expr, legend) in enumerate(exprs):
                p = p.with_target(
                    gp.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i)).datasource(ds)
                )
            b = b.with_panel(p)
    return b.build()


def render() -> str:
    """The dashboard JSON (sorted keys, 2-space indent, trailing newline): what Grafana imports."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return fileio.dumps_json(build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"
