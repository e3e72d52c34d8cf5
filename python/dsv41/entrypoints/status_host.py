"""Step 1 of ``dsv41 status`` (:mod:`dsv41.entrypoints.status`): what a host runs, from its own
files and service manager, on the host itself (``dsv41 status --local --json``, run by
``playbooks/status.yml`` through the inventory's own connection; no network): its dsv41 services
and their state, the package version, the serving container's image, the Engram manifest's
revision and table identities, the drafter's identities, the current promotion package.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from dsv41 import fileio, service_control
from dsv41.errors import Dsv41Error

SERVICE_PREFIX = service_control.SERVICE_PREFIX


def _run(argv: list[str], timeout_s: float = 20.0) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def service_states(service_manager: str, prefix: str = SERVICE_PREFIX) -> dict[str, str]:
    """``{service: state}`` of the ``dsv41-*`` services this host's service manager knows
    (:mod:`dsv41.service_control`: ``list_services`` / ``parse_list``).

    ``service_manager``: ``systemd`` (``systemctl list-units``' ACTIVE column, e.g. ``active``,
    ``failed``). ``{"systemd": "unavailable: ..."}`` when the manager cannot be asked.
    ServiceControlError (a Dsv41Error) for an unknown manager.
    """
    ctl = service_control.for_manager(service_manager)
    cmd = ctl.list_services(prefix)
    r = _run(cmd)
    if r is None or r.returncode != 0:
        return {ctl.manager: f"unavailable: {(r.stderr.strip() if r else 'cannot run ' + cmd[0])[:200]}"}
    return ctl.parse_list(r.stdout, prefix)


def manifest_facts(path: str | os.PathLike) -> dict | None:
    """``{"revision", "sha256", "tables": {layer_id: identity}}`` of an Engram manifest, None when
    the file is absent; ``{"error": ...}`` when it is unreadable (the verify role owns validation)."""
    p = Path(path)
    if not p.exists():
        return None

    try:
        raw = fileio.read_bytes(p, "manifest")
        doc = fileio.loads_json(raw)
        return {
            "revision": str(doc.get("revision", "?")),
            "sha256": hashlib.sha256(raw).hexdigest(),
            "tables": {str(t["layer_id"]): str(t["identity"]) for t in doc.get("tables", [])},
        }
    except (fileio.FileError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return {"error": f"{p}: {exc}"[:300]}


def drafter_facts(drafter_dir: str | os.PathLike) -> dict | None:
    """``{"drafter", "markov", "target"}`` identities of a drafter directory (as
    ``dsv41 drafter identity`` prints them); None when absent, ``{"error": ...}`` when unreadable."""
    d = Path(drafter_dir)
    if not d.is_dir():
        return None
    from dsv41.drafter.model import identities

    try:
        return identities(d)
    except Exception as exc:  # noqa: BLE001 - any unreadable drafter is a fact to report, not a crash
        return {"error": f"{d}: {exc}"[:300]}


def promotion_facts(packages_dir: str | os.PathLike) -> str | None:
    """The current promotion package: ``<packages_dir>/current`` as a link (its target's name) or a
    one-line file (its content); None when there is none."""
    cur = Path(packages_dir) / "current"
    try:
        if cur.is_symlink():
            return Path(os.readlink(cur)).name
        if cur.is_file():
            return fileio.read_text(cur, max_bytes=4096).strip() or None
    except (OSError, Dsv41Error) as exc:
        return f"unreadable: {exc}"
    return None


def image_facts(container_runtime: str, container: str) -> str | None:
    """``"<image reference> <image id>"`` of the running serving container, None when there is no
    container runtime or no such container (the lab engine runs without one)."""
    if not container_runtime or not shutil.which(container_runtime):
        return None
    r = _run([container_runtime, "inspect", "--format", "{{.Config.Image}} {{.Image}}", container])
    if r is None or r.returncode != 0:
        return None
    return r.stdout.strip() or None


def host_facts(
    *,
    service_manager: str = "systemd",
    root: str = "/opt/dsv41",
    container_runtime: str = "/usr/bin/docker",
    container: str = "dsv41-serve",
) -> dict:
    """What this host runs, from its own files and service manager (no network). ``root`` holds
    ``tables/manifest.json``, ``drafter/`` and ``packages/``. Shape: one ``hosts[name]`` entry of
    the module docstring (without ``groups``, ``rank``, ``reachable``)."""
    from dsv41 import __version__

    r = Path(root)
    return {
        "hostname": os.uname().nodename,
        "services": service_states(service_manager),
        "dsv41": __version__,
        "image": image_facts(container_runtime, container),
        "manifest": manifest_facts(r / "tables" / "manifest.json"),
        "drafter": drafter_facts(r / "drafter"),
        "promotion": promotion_facts(r / "packages"),
    }
