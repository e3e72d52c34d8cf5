"""The promotion journal: an append-only JSONL file on the controller, one line per step.

Every promote and rollback writes ``begin`` (with the package that was production, ``prev``),
then its steps, then ``done``. Each line is written with one ``write`` of a complete line and
``fsync``-ed (file and, on creation, its directory) before the playbook goes on, so after a kill
at any point the journal says how far the operation got. A torn last line (a kill inside the
write) is ignored on reading.

Replay (:func:`decide`): when the last operation has no ``done``, the next run first brings
production to a verified package:

* ``finish`` when the interrupted operation had already verified its target (step ``verified``
  with ``package``), or knew it from the start (a rollback's ``begin`` names its ``target``):
  apply it exactly (a no-op where it is in place), set the pointers and reopen admission;
* ``revert`` otherwise: restore ``prev`` (the package that was production when it began) exactly.

Either way it ends in a package whose every file was checked against its record.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error

STEPS = (
    "begin",
    "held",
    "applied",
    "verified",
    "recorded",
    "pointer",
    "reopened",
    "rolled_back",
    "recovered",
    "failed",
    "done",
    "stage_passed",
)


class JournalError(Dsv41Error):
    """A journal that cannot be written, or a step name that is not one of STEPS."""


def new_op_id() -> str:
    """A fresh operation id (``<utc yyyymmddThhmmss>-<8 hex>``)."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def append(path: str | os.PathLike, op_id: str, step: str, **fields) -> dict:
    """Append one step to the journal at ``path`` and fsync it; returns the entry written.

    Entry: ``{"ts": unix seconds (float), "op": op_id, "step": step, **fields}``; ``fields`` must be
    JSON-serialisable. Raises JournalError for an unknown step or an unwritable journal."""
    if step not in STEPS:
        raise JournalError(f"unknown journal step {step!r} (one of {', '.join(STEPS)})")
    entry = {"ts": round(time.time(), 3), "op": op_id, "step": step, **fields}
    line = (fileio.dumps_json(entry, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")

    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        new = not p.exists()
        fileio.append(p, line, "the promotion journal", error=JournalError)
        if new:
            dfd = os.open(p.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        raise JournalError(f"cannot write the promotion journal {p}: {exc}") from None
    return entry


def read(path: str | os.PathLike) -> list[dict]:
    """All complete entries of the journal (a missing journal is empty; torn or non-JSON lines,
    which only a kill inside a write leaves, are skipped)."""

    p = Path(path)
    if not os.path.lexists(p):
        return []
    out = []
    for raw in fileio.read_bytes(p, "the promotion journal", error=JournalError).split(b"\n"):
        try:
            e = fileio.loads_json(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(e, dict) and "op" in e and "step" in e:
            out.append(e)
    return out


def read_journal(path: str | os.PathLike) -> list[dict]:
    """:func:`read` for a path an operator named: a missing or empty journal is empty, but a file
    with content and not one journal entry (not JSON lines with ``op`` and ``step``: another
    file given by mistake) raises :class:`JournalError` instead of reading as "nothing
    interrupted"; so does a path that is not a regular file."""
    p = Path(path)
    if not os.path.lexists(p):
        return []
    raw = fileio.read_bytes(p, "the promotion journal", error=JournalError)
    entries = read(p) if raw.strip() else []
    if raw.strip() and not entries:
        raise JournalError(
            f"{p} is not a promotion journal: no line of it is a journal entry (a JSON object with op and step)"
        )
    return entries


@dataclass(frozen=True)
class Decision:
    """What a run must do first. ``action``: ``"none"`` (the last operation finished, or there is
    none), ``"finish"`` or ``"revert"``; ``package``: the id to bring production to (None for
    ``none``); ``op``/``kind``: the interrupted operation's id and kind; ``last_step``: its last
    step written; ``result_package``: for a finished last operation, the package it left as
    production (its ``done`` entry's ``package``); ``windows_dir``: for a window, the controller
    directory its ``begin`` names (where its ``dsv41 window run`` left ``run.pid``), else None."""

    action: str
    package: str | None = None
    op: str | None = None
    kind: str | None = None
    last_step: str | None = None
    result_package: str | None = None
    windows_dir: str | None = None

    def as_dict(self) -> dict:
        """The decision as a JSON-able dict."""
        return {
            "action": self.action,
            "package": self.package,
            "op": self.op,
            "kind": self.kind,
            "last_step": self.last_step,
            "result_package": self.result_package,
            "windows_dir": self.windows_dir,
        }


def decide(entries: list[dict]) -> Decision:
    """The replay decision for ``entries`` (as :func:`read` returns them); see the module docstring.

    Only the last operation counts (each run finishes or reverts the previous one before starting
    its own). An interrupted operation without a ``prev`` (the first deploy's record) and without
    a verified target has nothing to revert to: ``none``."""
    if not entries:
        return Decision("none")
    op = entries[-1]["op"]
    steps = [e for e in entries if e["op"] == op]
    names = [e["step"] for e in steps]
    begin = next((e for e in steps if e["step"] == "begin"), {})
    kind = begin.get("kind")
    if "done" in names:
        done = next(e for e in steps if e["step"] == "done")
        return Decision("none", op=op, kind=kind, last_step="done", result_package=done.get("package"))
    verified = [e for e in steps if e["step"] == "verified" and e.get("package")]
    if verified and "rolled_back" not in names:
        return Decision("finish", verified[-1]["package"], op, kind, names[-1])
    if begin.get("target"):
        # a rollback (or a window: its snapshot's package) knows its target from the start:
        # re-applying it exactly is idempotent
        return Decision("finish", begin["target"], op, kind, names[-1], windows_dir=begin.get("windows_dir"))
    prev = begin.get("prev")
    if not prev:
        return Decision("none", op=op, kind=kind, last_step=names[-1])
    return Decision("revert", prev, op, kind, names[-1])
