"""The fenced HOLD record (``DSV41_ADMISSION_HOLD_FILE``) and the window token: one definition
for both servers that keep it, the lab engine (``engine.server_state.ServerState``) and the vLLM
admission fence (``overlay.fence.AdmissionFence``). Standard library only (the fence runs inside
vLLM's API server process).

A record is the JSON object ``{"since": S, "window": TOKEN}``: ``S`` the Unix time (seconds) the
HOLD closed admission, ``TOKEN`` the fenced operation whose requests are still admitted (they
carry it in the ``X-DSV41-Window`` header). The file exists only while a fenced HOLD is in force;
each caller decides what an unreadable record means (the lab engine starts open, the fence stays
held).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error

#: A fenced window's requests carry this header (ASGI spelling: lower case); a HOLD taken with
#: ``/pause?window=TOKEN`` still admits requests whose header equals TOKEN.
WINDOW_HEADER = "x-dsv41-window"
#: What a window token may be (query parameter and header value alike).
WINDOW_TOKEN_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


class HoldFileError(Dsv41Error):
    """The hold file exists but cannot be read or is not a fenced HOLD record."""


class HoldWriteError(HoldFileError, OSError):
    """The hold file could not be written (an ``OSError``, as the callers that keep the HOLD expect)."""


@dataclass(frozen=True)
class HoldRecord:
    """One fenced HOLD: ``since`` (Unix time, seconds) and ``window`` (the admitted token)."""

    since: float
    window: str


def read_hold(path: str | os.PathLike) -> HoldRecord | None:
    """The record kept in ``path``, or None when the file does not exist, nor can (a parent is
    not a directory): no fenced HOLD.

    Raises HoldFileError (message names the file and why) when the file cannot be read, is not
    JSON, or is not ``{"since": number, "window": token}`` with a token matching
    :data:`WINDOW_TOKEN_RE`.
    """

    p = Path(path)
    try:
        os.stat(p)
    except (FileNotFoundError, NotADirectoryError):  # no record can exist there
        return None
    except OSError:
        pass  # fileio says why
    try:
        doc = fileio.loads_json(fileio.read_text(p, "admission hold file", max_bytes=1 << 16, error=HoldFileError))
    except ValueError as exc:
        raise HoldFileError(f"admission hold file {p} unreadable ({exc})") from None
    token = doc.get("window") if isinstance(doc, dict) else None
    since = doc.get("since") if isinstance(doc, dict) else None
    if not (
        isinstance(token, str)
        and WINDOW_TOKEN_RE.fullmatch(token)
        and isinstance(since, (int, float))
        and not isinstance(since, bool)
    ):
        raise HoldFileError(f"admission hold file {p} is not a fenced HOLD record")
    return HoldRecord(float(since), token)


def write_hold(path: str | os.PathLike, record: HoldRecord) -> None:
    """Keep ``record`` in ``path`` atomically (:func:`dsv41.fileio.atomic_write`; parents created).
    Raises OSError (:class:`HoldWriteError`) when it cannot be written, ``path`` included when it is
    not a regular file (a FIFO, a directory, a symlink)."""

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write(
        p,
        fileio.dumps_json({"since": record.since, "window": record.window}),
        "admission hold file",
        error=HoldWriteError,
    )


def remove_hold(path: str | os.PathLike) -> None:
    """Remove the kept record (no error when there is none). Raises OSError when it cannot."""
    Path(path).unlink(missing_ok=True)
