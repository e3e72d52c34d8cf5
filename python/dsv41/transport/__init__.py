"""Row transport: one request/response interface, two backends chosen by URL scheme.

- ``tcp://HOST:PORT[@LOCAL]``: own compact framing (``protocol``), C++ hot path when built
  (``native``), rows read straight into caller-owned buffers.
- ``nixl://HOST:PORT[@LOCAL]``: TCP control channel for the handshake, then NIXL one-sided READs
  of the server's registered tables (``nixl_backend``).

``open_client(url_or_endpoint, identities, timeout_s)`` returns an object with
``lookup_into(identity, rows, dests, timeout_s)``, ``lookup_segs(segs, timeout_s)`` (several
tables in one request when ``multi_table``) and ``close()`` for either scheme, after checking
that the server holds every expected table identity.
"""

from __future__ import annotations

from dsv41.transport import protocol
from dsv41.transport.errors import Refused, TransportError, TransportTimeout
from dsv41.transport.url import Endpoint, parse_url

__all__ = [
    "Endpoint",
    "Refused",
    "TransportError",
    "TransportTimeout",
    "open_client",
    "parse_url",
    "protocol",
]


def open_client(url: str | Endpoint, identities: list[bytes], timeout_s: float = 1.0, spin_us: float | None = None):
    """Connect to a row server and check it serves every table in ``identities`` (raw 32 B).

    Returns a ``TcpClient`` or ``NixlClient``.  A tcp client asks HELLO in a protocol-version-2
    frame; a version-1 server refuses it (``bad_version``, connection closed), so the client
    reconnects and keeps to version-1 frames (``multi_table`` False).  Raises ``Refused`` (reason
    ``wrong_identity``) when a table is missing or differs, ``TransportError`` /
    ``TransportTimeout`` otherwise.  ``spin_us``: the tcp client's busy-poll budget per receive
    (``TcpClient``; None: ``DSV41_TRANSPORT_CLIENT_SPIN_US``); a nixl client polls its transfers
    itself and ignores it.
    """
    ep = parse_url(url) if isinstance(url, str) else url
    if ep.scheme == "nixl":
        from dsv41.transport.nixl_backend import NixlClient

        return NixlClient(ep, identities, timeout_s=timeout_s)
    from dsv41.transport.tcp import TcpClient

    c = TcpClient(ep, connect_timeout_s=timeout_s, spin_us=spin_us)
    try:
        try:
            tables = c.hello(timeout_s, version=protocol.MAX_VERSION)
        except Refused as exc:
            if exc.status != protocol.ST_BAD_VERSION:
                raise
            c.close()
            c = TcpClient(ep, connect_timeout_s=timeout_s, spin_us=c.spin_us)  # a version-1 server
            tables = c.hello(timeout_s)
        served = {bytes.fromhex(t["identity"]) for t in tables}
        missing = [i for i in identities if i not in served]
        if missing:
            raise Refused(
                protocol.ST_WRONG_IDENTITY, "wrong_identity", f"{ep} does not serve table {missing[0].hex()[:16]}..."
            )
    except BaseException:
        c.close()
        raise
    return c
