"""Transport URL parsing: tcp/nixl, IPv6, @LOCAL_ADDR, one clear error for bad input."""

from __future__ import annotations

import pytest

from dsv41.errors import Dsv41Error
from dsv41.transport import parse_url


@pytest.mark.parametrize(
    "url,parts",
    [
        ("tcp://127.0.0.1:18600", ("tcp", "127.0.0.1", 18600, None, 0)),
        ("nixl://198.18.1.1:18610@198.18.1.2", ("nixl", "198.18.1.1", 18610, "198.18.1.2", 0)),
        ("tcp://[::1]:5@[::1]:7", ("tcp", "::1", 5, "::1", 7)),
        ("tcp://localhost:0", ("tcp", "localhost", 0, None, 0)),
        ("tcp://[::1]:9@::1", ("tcp", "::1", 9, "::1", 0)),
    ],
)
def test_parse(url, parts):
    ep = parse_url(url)
    assert (ep.scheme, ep.host, ep.port, ep.local_host, ep.local_port) == parts
    assert parse_url(str(ep)) == ep


@pytest.mark.parametrize(
    "url,msg",
    [
        ("127.0.0.1:1", "expected tcp"),
        ("rdma://h:1", "scheme"),
        ("tcp://h", "missing :PORT"),
        ("tcp://h:x", "not a number"),
        ("tcp://h:70000", "out of range"),
        ("tcp://:5", "empty host"),
        ("tcp://::1:5", "brackets"),
        ("tcp://[::1:5", "unclosed"),
        (None, "expected tcp"),
        ("tcp://a b:5", "bad host"),  # the host check merged in from engram.rowsource
        ("tcp://h:5@", "empty local address"),
    ],
)
def test_bad_urls(url, msg):
    with pytest.raises(Dsv41Error, match=msg):
        parse_url(url)


def test_rowsource_url_form_round_trips():
    """URLs as dsv41.engram.rowsource.parse_remote_url writes them parse here unchanged."""
    from dsv41.engram.rowsource import parse_remote_url

    for u in ("tcp://198.18.1.1:18610@198.18.1.2", "nixl://[fe80::1]:18611@fe80::2", "tcp://host-a:1"):
        r = parse_remote_url(u)
        ep = parse_url(str(r))
        assert (ep.scheme, ep.host, ep.port, ep.local_host) == (r.scheme, r.host, r.port, r.local_addr)
