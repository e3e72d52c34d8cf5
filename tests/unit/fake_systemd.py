"""A stand-in for ``systemctl`` and ``journalctl`` (the subset roles/dsv41_service calls, directly
and through ansible.builtin.systemd_service), with systemd's output shapes, for the unit tests of
the one service-control body and the readiness wait.

Usage: ``fake_systemd.py systemctl|journalctl ARGS...``; the state is the JSON file named by
``$FAKE_SYSTEMD_STATE``: ``{"units": {name: {"ActiveState": "active"|"inactive"|..., "NeedDaemonReload":
"yes"|"no", "NRestarts": N, "journal": [lines]}}}`` (names without ``.service``; a unit absent from
it is ``LoadState=not-found``). Every call is appended to ``$FAKE_SYSTEMD_STATE.log`` as
``COMMAND ARGS`` (one line; unit names without ``.service``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MUTATING = ("start", "stop", "restart", "kill", "daemon-reload", "reset-failed", "enable", "disable")


def _name(arg: str) -> str:
    return arg.strip("'").removesuffix(".service")


def main(argv: list[str]) -> int:
    tool, *args = argv
    path = Path(os.environ["FAKE_SYSTEMD_STATE"])
    st = json.loads(path.read_text())
    units = st["units"]
    plain = [a for a in args if not a.startswith("-")]
    with open(str(path) + ".log", "a", encoding="utf-8") as log:
        log.write(" ".join([tool, *[_name(a) if not a.startswith("-") else a for a in args]]) + "\n")
    if tool == "journalctl":
        name = next(_name(a.split("=", 1)[1]) for a in args if a.startswith("--unit="))
        lines = int(next((a.split("=", 1)[1] for a in args if a.startswith("--lines=")), "10"))
        print("\n".join(units.get(name, {}).get("journal", [])[-lines:]) or "-- No entries --")
        return 0
    cmd, names = plain[0], [_name(a) for a in plain[1:]]
    if cmd == "daemon-reload":
        for u in units.values():
            u["NeedDaemonReload"] = "no"
    elif cmd == "show":
        props = next((a.split("=", 1)[1].split(",") for a in args if a.startswith("--property=")), None)
        for n in names:
            u = units.get(n)
            full = ({"Id": f"{n}.service", "LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead",
                     "NeedDaemonReload": "no", "NRestarts": "0", "Result": "success"} if u is None else
                    {"Id": f"{n}.service", "LoadState": "loaded", "SubState": "running", "Result": "success",
                     "UnitFileState": "enabled", "NRestarts": str(u.get("NRestarts", 0)),
                     **{k: v for k, v in u.items() if k not in ("journal", "NRestarts")}})
            print("\n".join(f"{k}={v}" for k, v in full.items() if props is None or k in props))
    elif cmd == "is-enabled":
        print("enabled" if names[0] in units else "not-found")
        return 0 if names[0] in units else 1
    elif cmd in ("start", "restart"):
        if names[0] not in units:
            print(f"Failed to {cmd} {names[0]}.service: Unit {names[0]}.service not found.", file=sys.stderr)
            return 5
        units[names[0]]["ActiveState"] = "active"
    elif cmd == "stop":
        if names[0] in units:
            units[names[0]]["ActiveState"] = "inactive"
    elif cmd == "reset-failed":
        if units.get(names[0], {}).get("ActiveState") == "failed":
            units[names[0]]["ActiveState"] = "inactive"
    elif cmd == "kill":
        # SIGKILL under Restart=on-failure: systemd schedules the restart (activating, auto-restart)
        u = units[names[0]]
        u["ActiveState"], u["NRestarts"] = "activating", u.get("NRestarts", 0) + 1
    else:
        print(f"fake systemctl: unsupported {cmd}", file=sys.stderr)
        return 1
    path.write_text(json.dumps(st))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
