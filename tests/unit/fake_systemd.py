"""A stand-in for ``systemctl`` and ``journalctl`` (the subset roles/dsv41_service calls, directly
and through ansible.builtin.systemd_service), with systemd's output shapes, for the unit tests of
the one service-control body and the readiness wait.

Also the subset ``dsv41.service_control`` builds (the drills, ``dsv41 status``): ``is-active``,
``show -p MainPID --value``, ``kill --kill-whom=main --signal=SIG``, ``list-units ... PATTERN``.

Usage: ``fake_systemd.py systemctl|journalctl ARGS...``; the state is the JSON file named by
``$FAKE_SYSTEMD_STATE``: ``{"units": {name: {"ActiveState": "active"|"inactive"|..., "NeedDaemonReload":
"yes"|"no", "NRestarts": N, "MainPID": pid, "journal": [lines]}}}`` (names without ``.service``; a
unit absent from it is ``LoadState=not-found``; ``MainPID`` is 0 unless active, 4242 when a start
finds none). Every call is appended to ``$FAKE_SYSTEMD_STATE.log`` as ``COMMAND ARGS`` (one line;
unit names without ``.service``), or as ``HOST ARGS`` when ``$FAKE_SYSTEMD_HOST`` is set (several
simulated hosts sharing one log)."""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from pathlib import Path

MUTATING = ("start", "stop", "restart", "kill", "daemon-reload", "reset-failed", "enable", "disable")
# systemctl options whose value is the next argument (systemctl(1)); the rest are --opt[=value].
_VALUED = ("-p", "--property", "-s", "--signal", "-t", "--type")


def _name(arg: str) -> str:
    return arg.strip("'").removesuffix(".service")


def main(argv: list[str]) -> int:
    tool, *args = argv
    path = Path(os.environ["FAKE_SYSTEMD_STATE"])
    st = json.loads(path.read_text())
    units = st["units"]
    plain, props = [], None
    it = iter(args)
    for a in it:
        if a in _VALUED:
            v = next(it)
            if a in ("-p", "--property"):
                props = (props or []) + v.split(",")
        elif a.startswith("--property="):
            props = (props or []) + a.split("=", 1)[1].split(",")
        elif a != "--" and not a.startswith("-"):
            plain.append(a)
    with open(str(path) + ".log", "a", encoding="utf-8") as log:
        who = os.environ.get("FAKE_SYSTEMD_HOST") or tool
        log.write(" ".join([who, *[_name(a) if not a.startswith("-") else a for a in args]]) + "\n")
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
        for n in names:
            u = units.get(n)
            full = (
                {
                    "Id": f"{n}.service",
                    "LoadState": "not-found",
                    "ActiveState": "inactive",
                    "SubState": "dead",
                    "NeedDaemonReload": "no",
                    "NRestarts": "0",
                    "Result": "success",
                    "MainPID": "0",
                }
                if u is None
                else {
                    "Id": f"{n}.service",
                    "LoadState": "loaded",
                    "SubState": "running",
                    "Result": "success",
                    "UnitFileState": "enabled",
                    "NRestarts": str(u.get("NRestarts", 0)),
                    "MainPID": "0",
                    **{k: str(v) for k, v in u.items() if k not in ("journal", "NRestarts")},
                }
            )
            shown = [(k, v) for k, v in full.items() if props is None or k in props]
            print("\n".join(v if "--value" in args else f"{k}={v}" for k, v in shown))
    elif cmd == "is-active":
        # systemctl is-active: the ActiveState word, exit 0 only for active (3 otherwise)
        state = units.get(names[0], {}).get("ActiveState", "inactive")
        print(state)
        return 0 if state == "active" else 3
    elif cmd == "list-units":
        for n, u in sorted(units.items()):
            if any(fnmatch.fnmatch(f"{n}.service", pat) for pat in names) or not names:
                state = u.get("ActiveState", "inactive")
                sub = {"active": "running", "activating": "auto-restart", "failed": "failed"}.get(state, "dead")
                print(f"{n}.service loaded {state} {sub} {n}")
    elif cmd == "is-enabled":
        print("enabled" if names[0] in units else "not-found")
        return 0 if names[0] in units else 1
    elif cmd in ("start", "restart"):
        if names[0] not in units:
            print(f"Failed to {cmd} {names[0]}.service: Unit {names[0]}.service not found.", file=sys.stderr)
            return 5
        u = units[names[0]]
        u["ActiveState"], u["MainPID"] = "active", int(u.get("MainPID") or 4242)
    elif cmd == "stop":
        if names[0] in units:
            units[names[0]]["ActiveState"], units[names[0]]["MainPID"] = "inactive", 0
    elif cmd == "reset-failed":
        if units.get(names[0], {}).get("ActiveState") == "failed":
            units[names[0]]["ActiveState"] = "inactive"
    elif cmd == "kill":
        # SIGKILL under Restart=on-failure: systemd schedules the restart (activating, auto-restart)
        u = units[names[0]]
        u["ActiveState"], u["NRestarts"], u["MainPID"] = "activating", u.get("NRestarts", 0) + 1, 0
    else:
        print(f"fake systemctl: unsupported {cmd}", file=sys.stderr)
        return 1
    path.write_text(json.dumps(st))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
