"""Read-modify-write of one state file by many processes without a lost update: an exclusive
``fcntl.flock`` on ``<file>.lock`` held from the read until the new version is renamed into place
(``fileio.stage`` + ``commit``), so concurrent writers queue instead of overwriting each other.

:func:`locked` is the context manager; :class:`LockedStage` carries the lock inside a staged write
(``fileio.Staged``) whose ``commit()`` or ``discard()`` releases it, for callers that put several
staged files in place together (``harness.window.write_report``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from dsv41.errors import Dsv41Error

#: How long a writer waits for the lock before giving up with one clear error (seconds).
DEFAULT_TIMEOUT_S = 60.0


class StateLockError(Dsv41Error):
    """The state file's lock cannot be opened or was not granted in time."""


def acquire(
    target: str | os.PathLike,
    what: str = "state file",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    error: type[Dsv41Error] = StateLockError,
) -> int:
    """Lock ``<target>.lock`` (created mode 0600 beside ``target``); returns its descriptor (close
    it to release). Raises ``error`` (one line naming ``what``) when it cannot be opened or is
    not granted within ``timeout_s`` seconds."""
    lock = Path(f"{os.fspath(target)}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise error(f"cannot lock the {what} ({lock}): {exc.strerror or exc}") from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise error(f"the {what} ({lock}) stayed locked by another writer for {timeout_s:g} s") from None
            time.sleep(0.01)
        except OSError as exc:
            os.close(fd)
            raise error(f"cannot lock the {what} ({lock}): {exc.strerror or exc}") from None


@contextlib.contextmanager
def locked(
    target: str | os.PathLike,
    what: str = "state file",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    error: type[Dsv41Error] = StateLockError,
) -> Iterator[None]:
    """Hold the lock of ``target`` (:func:`acquire`) for the block."""
    fd = acquire(target, what, timeout_s, error)
    try:
        yield
    finally:
        os.close(fd)


class LockedStage:
    """A staged write (``fileio.Staged``) that holds its file's lock (descriptor ``fd``) until
    :meth:`commit` or :meth:`discard`, which release it (each may be called once)."""

    def __init__(self, staged, fd: int) -> None:
        self.staged, self.fd = staged, fd

    def _release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def commit(self):
        """Put the staged file in place, then release the lock; returns what ``Staged.commit`` does."""
        try:
            return self.staged.commit()
        finally:
            self._release()

    def discard(self) -> None:
        """Drop the staged file and release the lock."""
        try:
            self.staged.discard()
        finally:
            self._release()
