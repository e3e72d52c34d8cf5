"""``dsv41 oplock``: the controller's one-change-operation-at-a-time lock (``dsv41.promotion.oplock``).

window.yml, promote.yml and rollback.yml run ``acquire`` first and ``release`` last; a second
operation started meanwhile is refused at once (exit 1, one line naming the holder and since when).
"""

from __future__ import annotations

from pathlib import Path

import typer

from dsv41 import fileio
from dsv41.promotion import oplock

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

STATE_OPT = typer.Option(Path("state"), "--state-dir", help="The controller's state directory (mode 0700).")
OWNER_OPT = typer.Option(
    None,
    "--owner-pid",
    help="Pid the lock follows (default: the outermost ansible-playbook above this command, else its parent).",
)


@app.command()
def acquire(
    op: str = typer.Option(..., "--op", help=f"The operation: {', '.join(oplock.OPERATIONS)}."),
    op_id: str = typer.Option(..., "--id", help="The operation's id (a plain name)."),
    state_dir: Path = STATE_OPT,
    owner_pid: int | None = OWNER_OPT,
) -> None:
    """Take the change lock for this run (held until its owner ends or `release`); exit 1 naming
    the holder when another operation holds it. Prints the holder record as JSON."""
    print(fileio.dumps_json(oplock.acquire(state_dir, op, op_id, owner_pid), sort_keys=True))


@app.command()
def release(state_dir: Path = STATE_OPT, owner_pid: int | None = OWNER_OPT) -> None:
    """Give the change lock back (only the run that holds it can)."""
    rec = oplock.release(state_dir, owner_pid)
    print("change lock released: " + oplock.describe(rec) if rec else "change lock was not held")


@app.command()
def status(state_dir: Path = STATE_OPT, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Who holds the change lock, and since when (exit 0 either way)."""
    st = oplock.status(state_dir)
    if as_json:
        print(fileio.dumps_json(st, sort_keys=True))
    elif st["held"]:
        print("held by " + oplock.describe(st["holder"]))
    else:
        print("free" + (f" (a dead holder's record remains: {oplock.describe(st['stale'])})" if st["stale"] else ""))
