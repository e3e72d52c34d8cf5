"""``dsv41 drill run|clear|check``: fault drills under load on the lab (dsv41.harness.drill and its
``drill_faults``, ``drill_report``)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import re
from pathlib import Path

import typer

from dsv41 import names

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

_LAB_DIR = "/var/lib/dsv41-lab"

FaultsOpt = typer.Option(
    "all",
    "--faults",
    help="Comma-separated faults in order, or all (engram_server, drafter_worker, async_proxy, offload_link, netem).",
)
LinkOpt = typer.Option("sparkhead:ofl0", "--link", help="HOST:IFACE that offload_link and netem act on.")
NetemOpt = typer.Option("delay 60ms 20ms loss 5%", "--netem", help="tc netem arguments of the netem fault.")
LabDirOpt = typer.Option(_LAB_DIR, "--lab-dir", help="The lab's state directory (the hosts' pid files).")
ManagerOpt = typer.Option("systemd", "--service-manager", help="Service manager of the simulated hosts (systemd).")
ContainerOpt = typer.Option(
    None,
    "--serve-container/--plain-engine",
    show_default="auto",
    help="How rank 0's engine runs (roles/serve serve_container): in the container named "
    "after its service (found through the container runtime) or as the service's main "
    "process. Not given: in the container if the head host has one by that name.",
)
RuntimeOpt = typer.Option(
    "/usr/bin/docker",
    "--container-runtime",
    help="The hosts' container runtime command (serve_container_runtime); not on the host: no container.",
)


def _lab_hosts(lab_dir: str, service_manager: str):
    """The lab hosts driven through ``service_manager``; ServiceControlError (one line) for an
    unknown manager."""
    from dsv41 import service_control
    from dsv41.harness import drill_faults

    return drill_faults.LabHosts(lab_dir, service_control.for_manager(service_manager))


def _topology(link: str, netem: str, serve_container: bool | None, container_runtime: str):
    from dsv41.harness import drill_faults

    host, iface = drill_faults.parse_link(link)
    return drill_faults.Topology(
        link_host=host,
        link_iface=iface,
        netem=netem,
        serve_container=serve_container,
        container_runtime=container_runtime,
    ).validate()


@app.command()
def check(faults: str = FaultsOpt) -> None:
    """Validate a fault list (one error line naming an unknown fault); prints the faults in order."""
    from dsv41.harness import drill_faults

    print(",".join(drill_faults.parse_faults(faults)))


@app.command()
def clear(
    faults: str = FaultsOpt,
    link: str = LinkOpt,
    lab_dir: str = LabDirOpt,
    service_manager: str = ManagerOpt,
    serve_container: bool | None = ContainerOpt,
    container_runtime: str = RuntimeOpt,
) -> None:
    """Clear faults (idempotent): services started if not running, the link set up, the netem
    qdisc removed. Exit 1 naming any fault that could not be cleared."""
    from dsv41.harness import drill_faults

    names = drill_faults.parse_faults(faults)
    hosts = _lab_hosts(lab_dir, service_manager)
    topo = _topology(link, drill_faults.DEFAULT_NETEM, serve_container, container_runtime)
    for h in {topo.offload_host, topo.head_host, topo.link_host}:
        hosts.holder(h)
    out = drill_faults.clear_all(hosts, topo, names)
    for name, rec in out.items():
        print(f"{name}: {rec.get('error') or rec.get('action')}")
    bad = [n for n, r in out.items() if "error" in r]
    if bad:
        raise drill_faults.DrillError(f"drill: could not clear {', '.join(bad)}")


@app.command()
def run(
    faults: str = FaultsOpt,
    duration: float = typer.Option(20.0, "--duration", help="Seconds each fault is held."),
    baseline: float = typer.Option(8.0, "--baseline", help="Seconds of load before each fault."),
    recover_timeout: float = typer.Option(
        60.0, "--recover-timeout", help="Seconds to wait for recovery after clearing."
    ),
    stable: float = typer.Option(3.0, "--stable", help="Seconds of healthy counters that count as recovered."),
    streams: int = typer.Option(4, "--streams", help="Concurrent request streams of the load."),
    spec: str = typer.Option(
        "", "--spec", help="Bench workload spec (default: $DSV41_BENCH_SPEC_FILE, else the shipped one)."
    ),
    endpoint: str = typer.Option("http://198.18.0.11:8000", "--endpoint", help="Rank 0's API (lab address)."),
    refs_file: str = typer.Option(f"{_LAB_DIR}/refs/greedy_refs.json", "--refs", help="Recorded greedy references."),
    server_metrics: str = typer.Option(
        "http://198.18.0.13:9441/metrics", "--server-metrics", help="The table server's /metrics ('' to skip)."
    ),
    worker_metrics: str = typer.Option(
        "http://198.18.0.13:9451/metrics", "--worker-metrics", help="The drafter worker's /metrics ('' to skip)."
    ),
    link: str = LinkOpt,
    netem: str = NetemOpt,
    lab_dir: str = LabDirOpt,
    service_manager: str = ManagerOpt,
    serve_container: bool | None = ContainerOpt,
    container_runtime: str = RuntimeOpt,
    out_dir: str = typer.Option("drills", "--out-dir", help="Reports go to OUT_DIR/<id>/."),
    drill_id: str = typer.Option(
        "", "--id", help="Report id (default: UTC time).", callback=names.option("drill report id", empty_ok=True)
    ),
) -> None:
    """Inject each fault under load, clear it, measure; writes report.json, summary.md and
    timeline.png under OUT_DIR/<id>/. Exit 1 unless every fault had zero failed requests,
    recovered and left the greedy references 6/6."""
    from dsv41.errors import Dsv41Error
    from dsv41.harness import bench, drill, drill_faults, drill_report

    # Everything is checked before the lab is touched.
    names = drill_faults.parse_faults(faults)
    hosts = _lab_hosts(lab_dir, service_manager)
    topo = _topology(link, netem, serve_container, container_runtime)
    for v, what in (
        (duration, "--duration"),
        (baseline, "--baseline"),
        (recover_timeout, "--recover-timeout"),
        (stable, "--stable"),
    ):
        if not v >= 0 or v > 3600:
            raise drill_faults.DrillError(f"drill: {what} must be between 0 and 3600 s, not {v:g}")
    if not 1 <= streams <= 64:
        raise drill_faults.DrillError(f"drill: --streams must be between 1 and 64, not {streams}")
    drill_faults.check_lab_url(endpoint, "--endpoint")
    for url, what in ((server_metrics, "--server-metrics"), (worker_metrics, "--worker-metrics")):
        if url:
            drill_faults.check_lab_url(url, what)
    if not os.path.isfile(refs_file):
        raise drill_faults.DrillError(f"drill: no greedy references at {refs_file} (deploy records them)")
    sp = bench.load_spec(spec or None)
    did = drill_id or drill.new_id()
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}", did):
        raise drill_faults.DrillError(f"drill: --id {did!r} must be letters, digits, '_', '-', '.' (at most 64)")
    out = Path(out_dir) / did
    if out.exists():
        raise drill_faults.DrillError(f"drill: {out} exists; pick another --id")
    for h in {topo.offload_host, topo.head_host, topo.link_host}:
        hosts.holder(h)
    # Asked once, before any fault: a host that cannot tell refuses the drill with nothing
    # changed, and the report says which way the engine was found.
    topo = dataclasses.replace(topo, serve_container=drill_faults.engine_in_container(hosts, topo.head_host, topo))

    params = drill.DrillParams(
        names,
        endpoint,
        refs_file,
        server_metrics or None,
        worker_metrics or None,
        sp,
        streams,
        baseline,
        duration,
        recover_timeout,
        stable,
    )
    pdoc = {
        "faults": names,
        "streams": streams,
        "spec": sp["name"],
        "max_tokens": sp["max_tokens"],
        "baseline_s": baseline,
        "duration_s": duration,
        "recover_timeout_s": recover_timeout,
        "stable_s": stable,
        "interval_s": params.interval_s,
        "endpoint": endpoint,
        "link": link,
        "netem": topo.netem,
        "service_manager": service_manager,
        "serve_container": topo.serve_container,
        "serve_container_detected": serve_container is None,
    }
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    machine = f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()}, the three-host lab)"
    results: list[dict] = []
    error = None
    with bench.sigterm_as_interrupt():
        try:
            drill.run_drill(params, hosts, topo, log=lambda m: print(m, flush=True), results=results)
        except KeyboardInterrupt:
            error = "interrupted"
        except Dsv41Error as exc:
            error = str(exc)
        finally:
            cleared = drill_faults.clear_all(hosts, topo)
    finished = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    report = drill_report.build_report(did, results, pdoc, started, finished, machine)
    report["cleared"] = cleared
    if error:
        report.update(ok=False, error=error)
    paths = drill_report.write_report(report, out)
    print(
        f"drill {did}: {'PASS' if report['ok'] else 'FAIL'}; report {paths['report']}, summary {paths['summary']}, "
        f"timeline {paths['timeline']}"
    )
    not_cleared = [n for n, r in cleared.items() if "error" in r]
    if error or not report["ok"] or not_cleared:
        why = error or (
            f"could not clear {', '.join(not_cleared)}"
            if not_cleared
            else "; ".join(
                f"{f['fault']}: {f['failed']} failed, "
                f"{'recovered' if f['recovered'] else 'not recovered'}, refs "
                f"{(f['refs'] or {}).get('summary') or (f['refs'] or {}).get('error')}"
                for f in results
                if not f["ok"]
            )
            or "no fault ran"
        )
        raise drill_faults.DrillError(f"drill {did} failed: {why} (see {paths['summary']})")
