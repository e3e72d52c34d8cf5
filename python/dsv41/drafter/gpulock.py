"""Lifetime card locks of the drafter worker: one ``fcntl.flock`` per card, held until the process
(and any child it handed the descriptor to) ends.

A card is named by a *card key* (:func:`dsv41.drafter.pair.card_key`: ``gpu-<uuid>`` for a CUDA
card, so two processes that see the same card under different ``CUDA_VISIBLE_DEVICES`` numbers
still meet on one lock; ``cpu-<position>`` for the CPU stand-ins of a pair). The lock file is
``<lock dir>/<key>.lock`` (the worker's ``--lock-dir``, default ``/run/dsv41``) and holds the pid of
the worker that took it, so a second worker asking for the card refuses with one line naming that
pid. The kernel drops a flock when the last descriptor of it closes, so a killed worker leaves no
stale lock behind (the file stays; only the lock matters).
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from dsv41.errors import Dsv41Error

#: What a card key may be: a name, never a path (no ``/``, no ``..``), at most 80 characters.
KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,79}")
DEFAULT_LOCK_DIR = "/run/dsv41"


class CardBusy(Dsv41Error):
    """A card is locked by another process (``holder``: its pid, 0 when unknown)."""

    def __init__(self, message: str, holder: int) -> None:
        super().__init__(message)
        self.holder = holder


def lock_path(lock_dir: str | os.PathLike, key: str) -> Path:
    """``<lock_dir>/<key>.lock``; :class:`Dsv41Error` when ``key`` is not a plain name."""
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise Dsv41Error(f"card lock: {key!r} is not a card name (letters, digits, '-', '_'; at most 80)")
    return Path(lock_dir) / f"{key}.lock"


def holder_pid(path: str | os.PathLike) -> int:
    """The pid written in a lock file (0 when the file is missing, empty or not a pid)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    except OSError:
        return 0
    finally:
        os.close(fd)
    return int(text) if text.isdigit() and len(text) < 12 else 0


def acquire(lock_dir: str | os.PathLike, key: str, *, owner_pid: int | None = None) -> int:
    """Lock card ``key`` for the life of this process; returns the descriptor (close it to release;
    a child that inherits it keeps the card locked while it lives).

    Creates ``lock_dir`` (mode 0755) when missing. Writes ``owner_pid`` (default: this process)
    into the file once the lock is granted. Never waits: raises :class:`CardBusy` naming the
    holder's pid when another process holds the card, :class:`Dsv41Error` when the directory or
    file cannot be opened.
    """
    path = lock_path(lock_dir, key)
    try:
        os.makedirs(lock_dir, mode=0o755, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise Dsv41Error(f"card lock {path}: cannot open it: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = holder_pid(path)
        who = f"pid {pid}" if pid else "another process (pid not written yet)"
        raise CardBusy(f"card {key} is held by {who} (lock {path}); stop that worker first", pid) from None
    except OSError as exc:
        os.close(fd)
        raise Dsv41Error(f"card lock {path}: cannot lock it: {exc.strerror or exc}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner_pid or os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise Dsv41Error(f"card lock {path}: cannot write the holder's pid: {exc.strerror or exc}") from None
    return fd


def acquire_all(lock_dir: str | os.PathLike, keys: list[str]) -> list[int]:
    """Lock every card of ``keys`` (in order) or none: on a refusal the ones already taken are
    released before :class:`CardBusy` / :class:`Dsv41Error` propagates. Returns the descriptors."""
    fds: list[int] = []
    try:
        for key in keys:
            fds.append(acquire(lock_dir, key))
    except Dsv41Error:
        release(fds)
        raise
    return fds


def release(fds: list[int]) -> None:
    """Close lock descriptors (idempotent per list: the list is emptied)."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass
