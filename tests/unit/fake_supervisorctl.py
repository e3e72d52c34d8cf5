"""A stand-in for ``supervisorctl`` (the subset roles/dsv41_service tasks/control.yml calls, and
``dsv41.service_control``'s: ``pid P``, ``status`` of every program), with supervisor's own
messages and exit codes, for the unit tests of the one service-control body, the drills and status.

Usage: ``fake_supervisorctl.py STATE_JSON HOST COMMAND [ARGS...]``. STATE_JSON holds
``{"programs": {name: "RUNNING"|"STOPPED"}, "pending": {name: "added"|"updated"|"removed"},
"pids": {name: pid}}``: ``pending`` is what ``update`` finds after ``reread`` (a new, changed or
removed definition); ``pids`` the pid of a RUNNING program (default 42). Every call is appended to
``STATE_JSON + '.log'`` as ``HOST COMMAND ARGS`` (one line)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    state_path, host, cmd, *args = argv
    path = Path(state_path)
    st = json.loads(path.read_text())
    progs, pending = st["programs"], st.setdefault("pending", {})
    with open(str(path) + ".log", "a", encoding="utf-8") as log:
        log.write(" ".join([host, cmd, *args]) + "\n")
    rc = 0
    if cmd == "reread":
        print("No config updates to processes" if not pending else "\n".join(f"{n}: changed" for n in pending))
    elif cmd == "update":
        for name in list(pending) if not args else [a for a in args if a in pending]:
            what = pending.pop(name)
            if what == "removed":
                progs.pop(name, None)
                print(f"{name}: stopped\n{name}: removed process group")
            elif what == "updated":
                progs[name] = "RUNNING"  # autostart=true
                print(f"{name}: stopped\n{name}: updated process group")
            else:
                progs[name] = "RUNNING"
                print(f"{name}: added process group")
    elif cmd == "status" and not args:
        for name, state in sorted(progs.items()):
            print(f"{name:33s}RUNNING   pid {st.get('pids', {}).get(name, 42)}, uptime 0:00:07" if state == "RUNNING"
                  else f"{name:33s}{state:10s}Dec 02 06:00 AM")
        rc = 0 if all(v == "RUNNING" for v in progs.values()) else 3
    elif cmd == "pid":
        name = args[0]
        if name not in progs:
            print(f"{name}: ERROR (no such process)")
            rc = 1
        else:
            print(st.get("pids", {}).get(name, 42) if progs[name] == "RUNNING" else 0)
    elif cmd == "status":
        name = args[0]
        if name not in progs:
            print(f"{name}: ERROR (no such process)")
            rc = 4
        elif progs[name] == "RUNNING":
            print(f"{name:33s}RUNNING   pid {st.get('pids', {}).get(name, 42)}, uptime 0:00:07")
        else:
            print(f"{name:33s}{progs[name]:10s}Dec 02 06:00 AM")
            rc = 3
    elif cmd in ("stop", "start"):
        name = args[0]
        want = "STOPPED" if cmd == "stop" else "RUNNING"
        if name not in progs:
            print(f"{name}: ERROR (no such process)")
            rc = 1
        elif progs[name] == want:
            print(f"{name}: ERROR ({'not running' if cmd == 'stop' else 'already started'})")
            rc = 1
        else:
            progs[name] = want
            print(f"{name}: {'stopped' if cmd == 'stop' else 'started'}")
    elif cmd == "signal":
        name = args[1]
        if progs.get(name) != "RUNNING":
            print(f"{name}: ERROR (not running)")
            rc = 1
        else:
            progs[name] = "STOPPED"
            print(f"{name}: signalled")
    else:
        print(f"*** Unknown syntax: {cmd}")
        rc = 2
    path.write_text(json.dumps(st))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
