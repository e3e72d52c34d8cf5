"""The WIN2 R3 two-window cap per question (``candidate:metric``): at most two windows, the second
only after UNRESOLVED; windows that ended INVALID do not count. State: ``windows/questions.json``
(an object of question -> list of ``{"window", "verdict", "at"}``), read-modify-written under its
lock (:mod:`dsv41.filelock`). Errors: :class:`dsv41.harness.win2.Win2Error` (CapError for a
refused window)."""

from __future__ import annotations

import datetime as _dt
import os

from dsv41 import fileio
from dsv41.errors import Dsv41Error
from dsv41.harness.win2 import VERDICTS, Win2Error

QUESTIONS_FILE = "questions.json"


class CapError(Dsv41Error):
    """A question already had its windows (WIN2 R3: at most two, the second only after UNRESOLVED)."""


def question_key(candidate: str, metric: str) -> str:
    """The question a window answers: ``candidate:metric``."""
    return f"{candidate}:{metric}"


def _load_questions(state_dir: str) -> dict:

    path = os.path.join(state_dir, QUESTIONS_FILE)
    if not os.path.lexists(path):
        return {}
    doc = fileio.read_json(path, "the window cap state", error=Win2Error)
    if not isinstance(doc, dict) or not all(isinstance(v, list) for v in doc.values()):
        raise Win2Error(f"{path}: expected an object of question -> list of windows")
    return doc


def check_cap(state_dir: str, candidate: str, metric: str) -> int:
    """Refuse a window the cap forbids; return the number (1 or 2) the new window would be.

    Windows that ended INVALID do not count (they gave no verdict to peek at). Raises CapError.
    """
    key = question_key(candidate, metric)
    past = [w for w in _load_questions(state_dir).get(key, []) if w.get("verdict") != "INVALID"]
    if not past:
        return 1
    if len(past) == 1 and past[0].get("verdict") == "UNRESOLVED":
        return 2
    if len(past) == 1:
        raise CapError(
            f"question {key} was decided {past[0].get('verdict')} in window {past[0].get('window')}; "
            "WIN2 R3 gives a second window only after UNRESOLVED"
        )
    raise CapError(
        f"question {key} already had two windows ({', '.join(str(w.get('window')) for w in past)}); "
        "WIN2 R3 refuses a third"
    )


def record_window(state_dir: str, candidate: str, metric: str, window_id: str, verdict: str) -> None:
    """Append a finished window to the cap state (:func:`dsv41.fileio.atomic_write` of
    ``questions.json``: a failed write leaves the old state, the window not counted).
    Raises Win2Error."""
    stage_window(state_dir, candidate, metric, window_id, verdict).commit()


def stage_window(state_dir: str, candidate: str, metric: str, window_id: str, verdict: str):
    """The cap state with this window appended, written beside ``questions.json`` but not yet in
    place (a :class:`dsv41.filelock.LockedStage`: ``commit()`` counts the window, ``discard()``
    drops it; the state's lock is held from the read until then, so concurrent recorders never
    lose a window).
    ``dsv41 window run`` stages the cap and the decision, then commits both, so neither is kept
    without the other. Raises Win2Error."""

    from dsv41.names import check_name

    if verdict not in VERDICTS:
        raise Win2Error(f"unknown verdict {verdict!r}")
    check_name(window_id, "window id", Win2Error)
    check_name(candidate, "candidate name", Win2Error)
    try:
        os.makedirs(state_dir, exist_ok=True)
    except OSError as exc:
        raise Win2Error(f"cannot create the window cap state directory {state_dir}: {exc.strerror or exc}") from None
    from dsv41 import filelock

    target = os.path.join(state_dir, QUESTIONS_FILE)
    # held from this read until commit/discard: concurrent recorders queue, none is lost
    fd = filelock.acquire(target, "window cap state", error=Win2Error)
    try:
        doc = _load_questions(state_dir)
        doc.setdefault(question_key(candidate, metric), []).append(
            {"window": window_id, "verdict": verdict, "at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
        )
        staged = fileio.stage(
            target, fileio.dumps_json(doc, indent=1, sort_keys=True), "the window cap state", error=Win2Error
        )
    except BaseException:
        os.close(fd)
        raise
    return filelock.LockedStage(staged, fd)
