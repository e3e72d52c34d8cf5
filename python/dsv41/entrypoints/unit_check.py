"""Verify a rendered systemd unit with ``systemd-analyze verify``, failing on any message.

``systemd-analyze verify`` exits 0 when a unit has an unknown key or a value it cannot parse (it
prints "..., ignoring." and goes on), so its exit status alone does not catch the typos a template
change can bring (measured on this machine kind: ../shared/docs/nspawn-lab-notes.md, kept in
docs/lab.md). Here any line on its stderr, or a non-zero exit, is a failure. Source:
systemd-analyze(1), "verify" (systemd 252, Debian 12).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error

SYSTEMD_ANALYZE = "systemd-analyze"
UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.\\@-]+\.service$")  # systemd.unit(5): a service unit's name
TIMEOUT_S = 30.0
MAX_BYTES = 1 << 20


def verify_unit(text: str, name: str, root: Path | None = None) -> list[str]:
    """The messages ``systemd-analyze verify`` gives for ``text`` installed as unit ``name``.

    ``text``: the unit file's contents (str). ``name``: its unit name, ``NAME.service``.
    ``root``: passed as ``--root`` (an alternate filesystem root holding the executables and the
    system units the unit needs; None checks against this host, as a host's own validate does).
    Returns the stderr lines (empty list: the unit is clean). Raises :class:`Dsv41Error` for a
    name that is not a service unit, a missing ``systemd-analyze`` or a run over ``TIMEOUT_S``."""
    if not UNIT_NAME.match(name):
        raise Dsv41Error(f"unit name {name!r} is not NAME.service")
    exe = shutil.which(SYSTEMD_ANALYZE)
    if exe is None:
        raise Dsv41Error(f"{SYSTEMD_ANALYZE} not found on PATH (Debian package systemd)")
    with tempfile.TemporaryDirectory(prefix="dsv41-unit-") as tmp:
        if root is None:
            path = Path(tmp) / name
            where = [str(path)]
        else:
            # with --root, systemd-analyze loads units by name from the root's unit directories
            path = Path(root) / "etc/systemd/system" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            where = [f"--root={root}", name]
        fileio.atomic_write(path, text)
        try:
            r = subprocess.run(
                [exe, "verify", "--man=no", *where], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise Dsv41Error(f"{SYSTEMD_ANALYZE} verify {name}: no answer in {TIMEOUT_S:g} s") from None
    lines = [line for line in (r.stderr + r.stdout).splitlines() if line.strip()]
    if r.returncode != 0 and not lines:
        lines = [f"{SYSTEMD_ANALYZE} verify exited {r.returncode}"]
    return [line.replace(str(path), name) for line in lines]


def check_unit_file(file: Path, name: str, root: Path | None = None) -> int:
    """Read ``file`` (a rendered unit, e.g. Ansible's validate ``%s``) and verify it as ``name``
    (against ``root`` when given: :func:`verify_unit`). Returns the number of lines checked.
    Raises :class:`Dsv41Error` with every message joined on one line when systemd-analyze
    reports anything."""
    text = fileio.read_text(file, "systemd unit", max_bytes=MAX_BYTES)
    messages = verify_unit(text, name, root)
    if messages:
        raise Dsv41Error(f"unit {name} ({file}): " + " | ".join(messages))
    return len(text.splitlines())
