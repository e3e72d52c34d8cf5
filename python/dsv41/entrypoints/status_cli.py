"""``dsv41 status``: is production healthy, and what is it running? (dsv41.entrypoints.status)

Exit 0 when healthy, 1 with the reasons when not, so it serves as a probe.
"""

from __future__ import annotations

import json
import sys

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.callback(invoke_without_command=True)
def status(
    inventory: str = typer.Option("", "--inventory", "-i",
                                  help="Ansible inventory (default: the one ansible.cfg names, the lab)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (for scripts)."),
    window: float = typer.Option(5.0, min=0, max=3600,
                                 help="Seconds between the two reads of rank 0's /metrics (the 'last N s' deltas)."),
    local: bool = typer.Option(False, "--local",
                               help="Only this host, from its own files and service manager (what status.yml runs on each host)."),
    service_manager: str = typer.Option("systemd", help="With --local: supervisor or systemd."),
    supervisorctl: str = typer.Option("", help="With --local: the supervisorctl command line (supervisor hosts)."),
    root: str = typer.Option("/opt/dsv41", help="With --local: install root (tables/, drafter/, packages/)."),
    container_runtime: str = typer.Option("/usr/bin/docker", help="With --local: runtime of the serving container."),
    prometheus: str = typer.Option("", "--prometheus",
                                   help="Prometheus base URL whose firing dsv41 alerts the summary reports "
                                        "(default: the inventory's dsv41_prometheus_url, if any)."),
    hold_ok: bool = typer.Option(False, "--hold-ok",
                                 help="A HOLD is expected (promote/rollback checks run under their own fenced HOLD): "
                                      "admission held is a warning, not a failure."),
) -> None:
    """Per host: services and state, package version, image digest, manifest and table identities,
    drafter and target identities, admission, Engram lookups and fallbacks per rank, drafter rounds,
    accepted tokens, fail-closed rounds, proxy respawns, promotion package and last window verdict."""
    from dsv41.entrypoints import status as st

    if local:
        facts = st.host_facts(service_manager=service_manager, supervisorctl=supervisorctl, root=root,
                              container_runtime=container_runtime)
        print(json.dumps(facts, indent=None if as_json else 1, sort_keys=True))
        return
    report = st.run_playbook(inventory or st.default_inventory(), window_s=window, prometheus_url=prometheus)
    if hold_ok:
        report = st.allow_hold(report)
    if as_json:
        print(json.dumps(report, sort_keys=True))
    elif sys.stdout.isatty():
        from rich.console import Console

        st.render_tables(report, Console())
    else:
        print("\n".join(st.render_lines(report)))
    if not report["healthy"]:
        raise typer.Exit(1)
