"""Errors raised by the row transport (all ``Dsv41Error`` so the CLI prints one line)."""

from __future__ import annotations

from dsv41.errors import Dsv41Error


class TransportError(Dsv41Error):
    """The peer is unreachable, closed the connection, or broke the protocol."""


class TransportTimeout(TransportError):
    """A request did not complete before its deadline (the connection is torn down)."""


class Refused(TransportError):
    """The server answered with a refusal status (wrong identity, out of range, ...).

    ``status`` is the numeric code, ``reason`` its name (``dsv41.transport.protocol``).
    """

    def __init__(self, status: int, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"server refused the request: {reason}")
        self.status = status
        self.reason = reason
