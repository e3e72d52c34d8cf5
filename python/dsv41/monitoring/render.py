"""The dashboard's panels drawn with matplotlib from a Prometheus ``query_range`` (for the docs,
and where no Grafana is at hand): ``dsv41 monitor render``. Same expressions as the Grafana
dashboard (:data:`dsv41.monitoring.dashboard.PANELS`), ``$__rate_interval`` replaced by
``rate_interval``; alerts firing are drawn as red spans in every panel, ``marks`` as vertical lines."""

from __future__ import annotations

import math

from dsv41.errors import Dsv41Error


def query_range(prometheus_url: str, expr: str, start: float, end: float, step_s: float, timeout_s: float = 30.0):
    """``[(legend labels dict, [(t, value)])]`` of ``/api/v1/query_range``; Dsv41Error (one line)."""
    import httpx

    from dsv41.harness.http import check_url

    url = check_url(
        prometheus_url.rstrip("/") + "/api/v1/query_range", what=f"Prometheus {prometheus_url}", error=Dsv41Error
    )
    try:
        r = httpx.get(
            url, params={"query": expr, "start": start, "end": end, "step": step_s}, timeout=timeout_s, trust_env=False
        )
        r.raise_for_status()
        doc = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise Dsv41Error(f"Prometheus {prometheus_url}: query_range failed: {exc}") from None
    if doc.get("status") != "success":
        raise Dsv41Error(f"Prometheus {prometheus_url}: {doc.get('error', 'query failed')}")
    return [(s["metric"], [(float(t), float(v)) for t, v in s["values"]]) for s in doc["data"]["result"]]


def _legend(fmt: str, labels: dict) -> str:
    import re

    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: str(labels.get(m.group(1), "")), fmt)


def render(
    prometheus_url: str,
    start: float,
    end: float,
    out: str,
    step_s: float = 5.0,
    rate_interval: str = "1m",
    marks: list[tuple[float, str]] | None = None,
    title: str = "",
) -> dict:
    """Draw every panel into the PNG ``out``; returns ``{panel title: number of series drawn}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsv41.monitoring import dashboard as D

    panels = [p for _row, ps in D.PANELS for p in ps]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 2.8 * rows), squeeze=False)
    alerts = query_range(prometheus_url, 'ALERTS{alertstate="firing", alertname=~"Dsv41.*"}', start, end, step_s)
    drawn: dict[str, int] = {}
    for ax, (ptitle, _kind, unit, exprs, _desc) in zip(axes.flat, panels, strict=False):
        n = 0
        for expr, fmt in exprs:
            for labels, values in query_range(
                prometheus_url, expr.replace("$__rate_interval", rate_interval), start, end, step_s
            ):
                xs = [(t - start) / 60 for t, v in values if math.isfinite(v)]
                ys = [v for _t, v in values if math.isfinite(v)]
                if xs:
                    ax.plot(xs, ys, label=(_legend(fmt, labels).strip() or "value")[:40], linewidth=1)
                    n += 1
        for _labels, values in alerts:
            for t, _v in values:
                ax.axvspan((t - start) / 60, (t - start + step_s) / 60, color="red", alpha=0.04, linewidth=0)
        for t, text in marks or []:
            ax.axvline((t - start) / 60, color="black", linestyle=":", linewidth=1)
            ax.text((t - start) / 60, ax.get_ylim()[1], text, fontsize=6, rotation=90, va="top")
        ax.set_title(ptitle, fontsize=9)
        ax.set_xlabel("minutes", fontsize=7)
        ax.set_ylabel(unit, fontsize=7)
        ax.tick_params(labelsize=6)
        if n:
            ax.legend(fontsize=5, loc="upper left")
        drawn[ptitle] = n
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title or f"dsv41-offload dashboard queries ({prometheus_url}); red: dsv41 alerts firing", fontsize=11)
    fig.tight_layout()
    from dsv41 import fileio

    try:
        fileio.atomic_write(out, lambda f: fig.savefig(f, dpi=90, format="png"), "the rendering")
    finally:
        plt.close(fig)
    return drawn
