"""``dsv41 status``: is production healthy, and what is it running? (dsv41.entrypoints.status)

Exit 0 when healthy, 1 with the reasons when not, so it serves as a probe. Without ``--local``
it runs ``playbooks/status.yml`` through the inventory with ansible-runner (:func:`run_playbook`:
the hosts' facts gathered through their own connections, the report from the playbook's
summary task) and prints the report (``dsv41.entrypoints.status_render``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from dsv41 import fileio
from dsv41.entrypoints.status import StatusError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.callback(invoke_without_command=True)
def status(
    inventory: list[str] = typer.Option(
        [],
        "--inventory",
        "-i",
        help="Ansible inventory source; repeat it for several, in ansible-playbook's order "
        "(default: the one ansible.cfg names, the lab).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (for scripts)."),
    window: float = typer.Option(
        5.0, min=0, max=3600, help="Seconds between the two reads of rank 0's /metrics (the 'last N s' deltas)."
    ),
    local: bool = typer.Option(
        False,
        "--local",
        help="Only this host, from its own files and service manager (what status.yml runs on each host).",
    ),
    service_manager: str = typer.Option("systemd", help="With --local: the host's service manager (systemd)."),
    root: str = typer.Option("/opt/dsv41", help="With --local: install root (tables/, drafter/, packages/)."),
    container_runtime: str = typer.Option("/usr/bin/docker", help="With --local: runtime of the serving container."),
    prometheus: str = typer.Option(
        "",
        "--prometheus",
        help="Prometheus base URL whose firing dsv41 alerts the summary reports "
        "(default: the inventory's dsv41_prometheus_url, if any).",
    ),
    hold_ok: bool = typer.Option(
        False,
        "--hold-ok",
        help="A HOLD is expected (promote/rollback checks run under their own fenced HOLD): "
        "admission held is a warning, not a failure.",
    ),
) -> None:
    """Per host: services and state, package version, image digest, manifest and table identities,
    drafter and target identities, admission, Engram lookups and fallbacks per rank, drafter rounds,
    accepted tokens, fail-closed rounds, proxy respawns, promotion package and last window verdict."""
    from dsv41 import service_control
    from dsv41.entrypoints import status as st, status_host, status_render

    # Checked with or without --local: a bad value is bad input either way.
    service_control.for_manager(service_manager)
    if local:
        facts = status_host.host_facts(service_manager=service_manager, root=root, container_runtime=container_runtime)
        print(fileio.dumps_json(facts, indent=None if as_json else 1, sort_keys=True, nonfinite="null"))
        return
    report = run_playbook(list(inventory) or [default_inventory()], window_s=window, prometheus_url=prometheus)
    if hold_ok:
        report = st.allow_hold(report)
    if as_json:
        print(fileio.dumps_json(report, sort_keys=True, nonfinite="null"))
    elif sys.stdout.isatty():
        from rich.console import Console

        status_render.render_tables(report, Console())
    else:
        print("\n".join(status_render.render_lines(report)))
    if not report["healthy"]:
        raise typer.Exit(1)


def find_project(inventory: str | os.PathLike) -> Path:
    """The project checkout that holds ``playbooks/status.yml``: the first directory above the
    inventory, else above the current directory; StatusError when there is none."""
    for start in (Path(inventory).resolve(), Path.cwd().resolve()):
        for d in (start, *start.parents):
            if (d / "playbooks" / "status.yml").is_file() and (d / "ansible.cfg").is_file():
                return d
    raise StatusError(
        f"cannot find playbooks/status.yml above {inventory} or the current directory "
        "(run dsv41 status from the dsv41-offload checkout)"
    )


def default_inventory() -> str:
    """The inventory ansible.cfg names (the embedded default: the lab), as Ansible resolves it."""
    from ansible import constants as C

    hl = C.DEFAULT_HOST_LIST
    return hl[0] if isinstance(hl, (list, tuple)) and hl else str(hl)


def _sources(inventory: str | list[str]) -> list[str]:
    return [inventory] if isinstance(inventory, str) else list(inventory)


def inventory_hosts(inventory: str | list[str]) -> dict[str, list[str]]:
    """``{group: [host, ...]}`` of the ``spark`` and ``offload`` groups, parsed by Ansible's own
    inventory API from one source or several (later sources override earlier ones, as
    ``ansible-playbook -i A -i B``). StatusError (one line) for a missing source or an inventory
    without those hosts."""
    sources = _sources(inventory)
    for src in sources:
        if not os.path.exists(src):
            raise StatusError(f"inventory {src}: no such file or directory")
    inventory = ", ".join(sources)
    import contextlib
    import io

    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import init_plugin_loader

    init_plugin_loader()
    noise = io.StringIO()  # Ansible's warnings about the source: folded into the one error line
    try:
        with contextlib.redirect_stderr(noise), contextlib.redirect_stdout(noise):
            inv = InventoryManager(loader=DataLoader(), sources=sources)
    except Exception as exc:  # noqa: BLE001 - Ansible raises its own error types for bad sources
        raise StatusError(f"inventory {inventory}: {' '.join(str(exc).split())[:300]}") from None
    groups = {g: [h.name for h in inv.groups[g].get_hosts()] for g in ("spark", "offload") if g in inv.groups}
    if not groups.get("spark") or not groups.get("offload"):
        why = [
            ln.split(" plugin: ", 1)[-1].strip()
            for ln in noise.getvalue().splitlines()
            if ln.startswith("[WARNING]: Failed to parse")
        ]
        raise StatusError(
            f"inventory {inventory}: no hosts in the 'spark' and 'offload' groups"
            + (f" (it did not parse: {why[0][:200]})" if why else " (not a dsv41 inventory)")
        )
    return groups


def run_playbook(
    inventory: str | list[str], window_s: float = 5.0, timeout_s: float = 300.0, prometheus_url: str = ""
) -> dict:
    """Run ``playbooks/status.yml`` through ``inventory`` (one source or several, in
    ``ansible-playbook -i`` order) with ansible-runner (fresh private data dir) and return the
    report its summary task computed (``status.summarize``); ``window_s``
    (s) becomes ``status_window_s``, ``timeout_s`` (s) bounds the whole run, ``prometheus_url``
    (optional) becomes ``status_prometheus_url`` (firing alerts, ``status.add_alerts``).
    StatusError when the run produced none (the line says why)."""
    import tempfile

    import ansible_runner

    sources = _sources(inventory)
    inventory_hosts(sources)
    project = find_project(sources[0])
    # ansible-playbook from the venv running this command, even when that venv is not on PATH
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found: dict = {}
    failures: list[str] = []

    def on_event(ev: dict) -> bool:
        data = ev.get("event_data") or {}
        res = data.get("res") or {}
        if ev.get("event") == "runner_on_ok" and isinstance(res.get("report"), dict):
            found["report"] = res["report"]
        elif ev.get("event") in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            failures.append(f"{data.get('host', '?')}: {' '.join(str(res.get('msg', '')).split())[:300]}")
        return False

    with tempfile.TemporaryDirectory(prefix="dsv41-status-") as pdd:
        r = ansible_runner.run(
            private_data_dir=pdd,
            project_dir=str(project),
            playbook=str(project / "playbooks" / "status.yml"),
            inventory=[str(Path(src).resolve()) for src in sources],
            extravars={
                "status_window_s": float(window_s),
                **({"status_prometheus_url": prometheus_url} if prometheus_url else {}),
            },
            quiet=True,
            event_handler=on_event,
            timeout=int(timeout_s),
            envvars={"ANSIBLE_CONFIG": str(project / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "PATH": path},
        )
        if "report" in found:
            return found["report"]
        out = ""
        if r.stdout is not None:
            out = r.stdout.read()
    tail = [ln for ln in out.splitlines() if ln.strip().startswith(("ERROR!", "[ERROR]", "fatal:"))]
    why = failures[0] if failures else (tail[-1].strip() if tail else f"ansible-playbook {r.status}, rc {r.rc}")
    raise StatusError(f"status via {', '.join(sources)}: {why}")
