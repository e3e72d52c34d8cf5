"""Errors the ``dsv41`` command turns into one clear line and exit code 1.

Raise :class:`Dsv41Error` (or a subclass) for any bad input or failed check that an operator
should read as a sentence, never as a traceback.
"""

from __future__ import annotations


class Dsv41Error(Exception):
    """A user-facing failure: bad input, a failed verification, an unreachable peer.

    ``str(exc)`` is printed as ``dsv41: error: <message>`` and the command exits with
    ``exit_code`` (default 1).
    """

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(Dsv41Error):
    """A model or deployment configuration is missing keys or is inconsistent."""


class VerificationError(Dsv41Error):
    """Data on disk or on the wire does not match what a manifest or reference says."""
