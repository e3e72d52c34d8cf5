"""Transport URLs: ``tcp://HOST:PORT[@LOCAL_ADDR]`` and ``nixl://HOST:PORT[@LOCAL_ADDR]``."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from dsv41.errors import Dsv41Error

SCHEMES = ("tcp", "nixl")


@dataclass(frozen=True)
class Endpoint:
    """A parsed transport URL.

    ``scheme``: ``"tcp"`` or ``"nixl"``; ``host``/``port``: the server's control/data address;
    ``local_host``/``local_port``: address the client socket binds to (``None`` / 0 = any).
    """

    scheme: str
    host: str
    port: int
    local_host: str | None = None
    local_port: int = 0

    def __str__(self) -> str:
        s = f"{self.scheme}://{_fmt_host(self.host)}:{self.port}"
        if self.local_host:
            s += "@" + _fmt_host(self.local_host) + (f":{self.local_port}" if self.local_port else "")
        return s


def check_host(h: str, url: str) -> None:
    """Raise ``Dsv41Error`` unless ``h`` is an IP address or a DNS name (labels of letters,
    digits and inner hyphens, <= 63 characters each)."""
    try:
        ipaddress.ip_address(h)
        return
    except ValueError:
        pass
    labels = h.split(".")
    if not all(
        lab
        and len(lab) <= 63
        and lab.replace("-", "").isalnum()
        and lab.isascii()
        and not lab.startswith("-")
        and not lab.endswith("-")
        for lab in labels
    ):
        raise Dsv41Error(f"bad transport URL {url!r}: bad host {h!r}")


def _fmt_host(h: str) -> str:
    return f"[{h}]" if ":" in h else h


def _split_hostport(text: str, url: str, need_port: bool) -> tuple[str, int]:
    if not need_port and text.count(":") > 1:
        try:  # a bare IPv6 local address (as rowsource.RemoteURL writes it)
            return str(ipaddress.ip_address(text)), 0
        except ValueError:
            pass
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise Dsv41Error(f"bad transport URL {url!r}: unclosed '['")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise Dsv41Error(f"bad transport URL {url!r}")
        port_s = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, port_s = text.split(":")
    elif ":" not in text:
        host, port_s = text, ""
    else:
        raise Dsv41Error(f"bad transport URL {url!r}: put IPv6 addresses in [brackets]")
    if not host:
        raise Dsv41Error(f"bad transport URL {url!r}: empty host")
    check_host(host, url)
    if not port_s:
        if need_port:
            raise Dsv41Error(f"bad transport URL {url!r}: missing :PORT")
        return host, 0
    try:
        port = int(port_s)
    except ValueError:
        raise Dsv41Error(f"bad transport URL {url!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise Dsv41Error(f"bad transport URL {url!r}: port {port} out of range")
    return host, port


def parse_url(url: str) -> Endpoint:
    """Parse ``scheme://HOST:PORT[@LOCAL_ADDR[:PORT]]`` (IPv6 in brackets; port 0 = ephemeral,
    for listen addresses).  The one URL parser of the package: ``engram.rowsource`` and every
    CLI option taking a URL go through it.  Raises ``Dsv41Error`` on bad input."""
    if not isinstance(url, str) or "://" not in url:
        raise Dsv41Error(f"bad transport URL {url!r}: expected tcp://HOST:PORT or nixl://HOST:PORT")
    scheme, rest = url.strip().split("://", 1)
    if scheme not in SCHEMES:
        raise Dsv41Error(f"bad transport URL {url!r}: scheme must be one of {', '.join(SCHEMES)}")
    local = None
    if "@" in rest:
        rest, local = rest.split("@", 1)
        if not local:
            raise Dsv41Error(f"bad transport URL {url!r}: empty local address after '@'")
    host, port = _split_hostport(rest, url, need_port=True)
    lh, lp = (None, 0)
    if local is not None:
        lh, lp = _split_hostport(local, url, need_port=False)
    return Endpoint(scheme, host, port, lh, lp)
