"""Shared helpers for tests that verify rendered systemd units with ``systemd-analyze verify --root``."""

from __future__ import annotations

from pathlib import Path

#: This machine's system unit directory (None where systemd is not installed).
SYSTEM_UNITS = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None)


def stub_root(root: Path, units: list[str]) -> Path:
    """A filesystem root for ``systemd-analyze verify --root``: this machine's own system units
    (the targets a unit orders itself after; regular files only, since their absolute symlinks
    would resolve outside the root) and an executable stand-in at every Exec*= path the units name
    (they exist on a real host; here only the unit's own syntax and semantics are checked)."""
    (root / "usr/lib/systemd/system").mkdir(parents=True, exist_ok=True)
    for unit in SYSTEM_UNITS.iterdir():
        if unit.is_file() and not unit.is_symlink():
            (root / "usr/lib/systemd/system" / unit.name).write_bytes(unit.read_bytes())
    for text in units:
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key.startswith("Exec") and value.strip():
                exe = root / value.lstrip("-@:+!").split()[0].lstrip("/")
                exe.parent.mkdir(parents=True, exist_ok=True)
                exe.write_text("#!/bin/sh\n")
                exe.chmod(0o755)
    return root
