"""``dsv41 metrics get URL``: a Prometheus ``/metrics`` endpoint, parsed, as JSON (for playbooks)."""

from __future__ import annotations

import typer

from dsv41 import fileio

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command()
def get(
    url: str = typer.Argument(..., help="A /metrics URL, e.g. http://198.18.0.20:9451/metrics"),
    prefix: str = typer.Option("", help="Only samples whose name starts with this."),
    timeout: float = typer.Option(10.0, min=0.1, help="Seconds to wait for the answer."),
) -> None:
    """Print ``{"url": URL, "metrics": {sample name: [{"labels": {...}, "value": float}]}}``
    (parsed by prometheus_client; counters keep their ``_total`` suffix).  Exit 1 with one line
    when the endpoint cannot be read or is not Prometheus text."""
    from dsv41.harness import http

    out: dict[str, list[dict]] = {}
    for name, labels, value in http.get_metrics(url, timeout_s=timeout):
        if name.startswith(prefix):
            out.setdefault(name, []).append({"labels": labels, "value": value})
    print(fileio.dumps_json({"url": url, "metrics": out}, sort_keys=True, nonfinite="null"))
