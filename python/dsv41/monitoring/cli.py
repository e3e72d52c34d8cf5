"""``dsv41 monitor``: the operations exporter, the rules and the dashboard (docs/operations.md
"Monitoring")."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import typer

from dsv41 import fileio
from dsv41.errors import Dsv41Error

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command()
def exporter(
    listen: str = typer.Option("127.0.0.1:9461", help="HOST:PORT of /metrics (a management or loopback address)."),
    api_url: str = typer.Option(
        "", help="Rank 0's base URL, e.g. http://198.18.0.11:8000 (admission gauges; empty: none)."
    ),
    journal: Path = typer.Option(
        Path("packages/journal.jsonl"), help="The controller's promotion journal (windows too)."
    ),
    once: bool = typer.Option(False, "--once", help="Print the current values as JSON and exit (no server)."),
    ready_file: Path = typer.Option(None, help="Written once listening."),
) -> None:
    """Serve dsv41_admission_*, dsv41_window_* and dsv41_promotion_* gauges for Prometheus
    (dsv41.monitoring.exporter), read at each scrape."""
    from dsv41.monitoring import exporter as ex

    col = ex.OpsCollector(api_url, journal)
    if once:
        print(fileio.dumps_json(ex.describe(col), sort_keys=True, nonfinite="null"))
        return
    server, _thread = ex.serve(listen, col)
    if ready_file is not None:
        fileio.atomic_write(ready_file, f"{listen}\n", "the ready file")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


@app.command()
def rules(
    project: Path = typer.Option(Path("."), help="The dsv41-offload checkout (holds roles/monitoring)."),
    overrides: str = typer.Option(
        "{}", help='monitoring_alert_overrides as JSON, e.g. \'{"table_server_down": {"for": "1m"}}\'.'
    ),
    ranks: str = typer.Option("0,1", help="TP ranks whose Engram counters rank 0 exports."),
) -> None:
    """Print the rules file (what roles/monitoring installs) for an existing Prometheus."""
    from dsv41.monitoring import rules as R

    if not (R.role_dir(project) / "templates" / "dsv41.rules.yml.j2").is_file():
        raise Dsv41Error(f"--project {project}: no roles/monitoring/templates/dsv41.rules.yml.j2 there")
    try:
        over = fileio.loads_json(overrides)
        rk = [int(x) for x in ranks.split(",") if x.strip()]
    except ValueError as exc:
        raise Dsv41Error(f"--overrides must be a JSON object and --ranks comma-separated integers ({exc})") from None
    if not isinstance(over, dict):
        raise Dsv41Error("--overrides must be a JSON object")
    try:
        text = R.render(project, over, rk)
    except Exception as exc:  # noqa: BLE001 - a template error (e.g. an override naming no key) is one line
        raise Dsv41Error(f"cannot render the rules: {exc}") from None
    typer.echo(text, nl=False)


@app.command()
def dashboard(
    out: Path = typer.Option(None, help="Write the dashboard JSON here (default: stdout)."),
) -> None:
    """The Grafana dashboard (dsv41.monitoring.dashboard, grafana-foundation-sdk) as JSON."""
    from dsv41.monitoring import dashboard as D

    text = D.render()
    if out is None:
        typer.echo(text, nl=False)
        return

    fileio.atomic_write(out, text, "the dashboard")


@app.command()
def render(
    prometheus: str = typer.Option(..., help="Prometheus base URL, e.g. http://198.18.0.13:9090."),
    minutes: float = typer.Option(30.0, min=1, max=10080, help="The last N minutes."),
    out: Path = typer.Option(Path("dashboard.png"), help="PNG to write."),
    step: float = typer.Option(5.0, min=1, help="Seconds between points."),
    rate_interval: str = typer.Option("1m", help="What $__rate_interval becomes."),
) -> None:
    """The dashboard's panels drawn with matplotlib from a Prometheus (no Grafana needed)."""
    import time

    from dsv41.monitoring import render as R

    end = time.time()
    drawn = R.render(prometheus, end - minutes * 60, end, str(out), step_s=step, rate_interval=rate_interval)
    print(fileio.dumps_json({"out": str(out), "series": drawn}, sort_keys=True))
