"""NIXL backend (UCX over TCP on loopback): handshake, identity refusal before any descriptor is
shared, local bounds check before a READ, exact rows, quarantine of abandoned READs."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

os.environ.setdefault("UCX_TLS", "tcp")

from dsv41.transport import (  # noqa: E402
    Refused,
    TransportError,
    TransportTimeout,
    open_client,
    parse_url,
    protocol as P,  # noqa: E402
)
from dsv41.transport.nixl_backend import NixlClient, NixlExporter  # noqa: E402
from dsv41.transport.server import RowServer, RowTable  # noqa: E402

ROWS = 40000


def make_table(seed, layer):
    rng = np.random.default_rng(seed)
    return RowTable(
        hashlib.sha256(f"n{seed}".encode()).digest(),
        layer,
        rng.integers(0, 256, (ROWS, 256), dtype=np.uint8),
        rng.integers(0, 256, (ROWS, 8), dtype=np.uint8),
    )


def expected(t, rows):
    r = np.asarray(rows, dtype=np.int64)
    return np.concatenate([t.weight[r], t.scale[r]], axis=1)


@pytest.fixture(scope="module")
def nixl_server():
    tables = [make_table(1, 1), make_table(2, 14)]
    ex = NixlExporter(tables)
    srv = RowServer(tables, [parse_url("nixl://127.0.0.1:0"), parse_url("tcp://127.0.0.1:0")], nixl_provider=ex)
    eps = srv.start()
    yield srv, eps[0], eps[1], tables
    srv.stop(2)
    ex.close()


def test_exact_rows_both_tables(nixl_server):
    srv, nep, _, tables = nixl_server
    c = open_client(nep, [t.identity for t in tables])
    assert isinstance(c, NixlClient)
    rng = np.random.default_rng(3)
    for t in tables:
        for n in (1, 24, 96, 20000):  # 20000 > staging_rows: chunked READs
            rows = rng.integers(0, ROWS, n).astype(np.uint64)
            rows[-1] = ROWS - 1
            out = np.zeros((n, 264), np.uint8)
            c.lookup_into(t.identity, rows, [out], 20.0)
            np.testing.assert_array_equal(out, expected(t, rows))
    dests = [np.zeros((k, 264), np.uint8) for k in (3, 0, 5)]
    c.lookup_into(tables[0].identity, np.arange(8, dtype=np.uint64), dests, 5.0)
    np.testing.assert_array_equal(np.concatenate(dests), expected(tables[0], range(8)))
    c.close()
    c.close()  # idempotent
    with pytest.raises(TransportError, match="not connected"):
        c.lookup_into(tables[0].identity, np.arange(2, dtype=np.uint64), [np.zeros((2, 264), np.uint8)], 1.0)


def test_wrong_identity_refused_before_descriptors(nixl_server):
    srv, nep, _, tables = nixl_server
    before = srv.snapshot()["nixl_handshakes"]
    with pytest.raises(Refused) as ei:
        NixlClient(nep, [tables[0].identity, hashlib.sha256(b"wrong").digest()])
    assert ei.value.reason == "wrong_identity"
    snap = srv.snapshot()
    assert snap["nixl_handshakes"] == before  # no metadata or descriptor left the server
    assert snap["refusals"].get("wrong_identity", 0) >= 1


def test_out_of_range_and_unknown_table_checked_before_read(nixl_server):
    srv, nep, _, tables = nixl_server
    c = NixlClient(nep, [tables[0].identity])
    out = np.full((2, 264), 9, np.uint8)
    with pytest.raises(Refused) as ei:
        c.lookup_into(tables[0].identity, np.array([0, ROWS], np.uint64), [out], 1.0)
    assert ei.value.reason == "out_of_range"
    with pytest.raises(Refused) as ei:
        c.lookup_into(tables[1].identity, np.array([0, 1], np.uint64), [out], 1.0)  # not in handshake
    assert ei.value.reason == "wrong_identity"
    assert (out == 9).all()
    c.close()


class _FirstReadInFlight:
    """The client's NIXL agent, except that the first ``transfer`` reports "PROC" (in flight).

    With server and client agents in one process UCX may finish a READ inside ``transfer``; a
    real remote READ is still in flight at a short deadline. The READ is really posted (and lands
    in staging); only its first status is held back, so the deadline path runs for real.
    """

    def __init__(self, agent):
        self._agent = agent
        self.transfers = 0

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def transfer(self, handle):
        st = self._agent.transfer(handle)
        self.transfers += 1
        return "PROC" if self.transfers == 1 else st


def test_abandoned_read_quarantines_its_slot(nixl_server):
    srv, nep, _, tables = nixl_server
    c = NixlClient(nep, [tables[0].identity], staging_rows=16384, slots=1)
    c.agent = _FirstReadInFlight(c.agent)
    rows = np.arange(16384, dtype=np.uint64)
    out = np.zeros((16384, 264), np.uint8)
    with pytest.raises(TransportTimeout):
        c.lookup_into(tables[0].identity, rows, [out], 1e-6)
    assert c.quarantined == 1
    small = np.zeros((2, 264), np.uint8)
    try:
        c.lookup_into(tables[0].identity, np.array([1, 2], np.uint64), [small], 5.0)
        reaped = True  # the READ had already finished: slot reaped and reused
    except TransportError as exc:
        assert "quarantined" in str(exc)
        reaped = False
    deadline = time.monotonic() + 20
    while not reaped and time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            c.lookup_into(tables[0].identity, np.array([1, 2], np.uint64), [small], 5.0)
            reaped = True
        except TransportError:
            pass
    assert reaped and c.quarantined == 0
    np.testing.assert_array_equal(small, expected(tables[0], [1, 2]))
    assert not out.any()  # the abandoned READ landed in staging, never in the caller's buffer
    c.close()


def test_nixl_hello_on_plain_tcp_listener_not_supported(nixl_server):
    srv, _, tep, tables = nixl_server
    with pytest.raises(Refused) as ei:
        NixlClient(parse_url(f"nixl://{tep.host}:{tep.port}"), [tables[0].identity])
    assert ei.value.reason == "not_supported"


def test_nixl_control_channel_serves_tcp_lookups_too(nixl_server):
    srv, nep, _, tables = nixl_server
    c = open_client(parse_url(f"tcp://{nep.host}:{nep.port}"), [tables[1].identity])
    out = np.zeros((3, 264), np.uint8)
    c.lookup_into(tables[1].identity, np.array([5, 6, 7], np.uint64), [out], 2.0)
    np.testing.assert_array_equal(out, expected(tables[1], [5, 6, 7]))
    c.close()


def test_handshake_bad_frame(nixl_server):
    srv, nep, _, tables = nixl_server
    from dsv41.transport.tcp import TcpClient

    c = TcpClient(nep)
    with pytest.raises(Refused) as ei:
        c.request(P.OP_NIXL_HELLO, bytes(32), 2, tables[0].identity, 1.0)  # count says 2, one given
    assert ei.value.reason == "bad_frame"
    with pytest.raises(Refused):
        c.request(P.OP_NIXL_HELLO, bytes(32), 0, b"", 1.0)
    c.close()


def test_pure_python_server_answers_handshake(nixl_server):
    srv0, _, _, tables = nixl_server
    srv = RowServer(tables, [parse_url("nixl://127.0.0.1:0")], nixl_provider=srv0.nixl_provider, native=False)
    ep = srv.start()[0]
    with pytest.raises(Refused) as ei:
        NixlClient(ep, [hashlib.sha256(b"wrong").digest()])
    assert ei.value.reason == "wrong_identity"
    c = NixlClient(ep, [tables[1].identity])
    out = np.zeros((4, 264), np.uint8)
    c.lookup_into(tables[1].identity, np.array([3, 1, 4, 1], np.uint64), [out], 5.0)
    np.testing.assert_array_equal(out, expected(tables[1], [3, 1, 4, 1]))
    c.close()
    srv.stop(1)
    assert srv.snapshot()["nixl_handshakes"] == 1


def test_server_agent_progress_thread_gets_a_delay():
    """The wrapper's hard-coded pthrDelay=0 (a busy-spinning progress thread) is overridden."""
    from dsv41.transport import nixl_backend as nb

    seen = {}

    class Cfg:
        pthrDelay = 0

    class Real:
        other = 5

        @staticmethod
        def nixlAgent(name, cfg):  # noqa: N802
            seen["delay"] = cfg.pthrDelay
            return "agent"

    proxy = nb._BindWithDelay(Real, 1000)
    assert proxy.nixlAgent("a", Cfg()) == "agent" and seen["delay"] == 1000 and proxy.other == 5
    api = nb._nixl_api()
    real = api.nixlBind
    ex = NixlExporter([make_table(5, 1)])
    assert api.nixlBind is real  # the binding module is restored after building the agent
    ex.close()


def test_lookup_segs_both_tables_one_read(nixl_server, monkeypatch):
    """Several tables in one READ (the engine's two Engram layers per step): exact rows, one
    transfer posted, checks before any READ, larger requests table by table."""
    srv, nep, _, tables = nixl_server
    c = open_client(nep, [t.identity for t in tables])
    assert c.multi_table
    posted = []
    real = c.agent.make_prepped_xfer
    monkeypatch.setattr(c.agent, "make_prepped_xfer", lambda *a, **k: posted.append(len(a[2])) or real(*a, **k))
    rng = np.random.default_rng(5)
    for n0, n1 in ((24, 24), (96, 3), (0, 7), (10000, 9000)):  # last: more than one staging slot
        ids = [rng.integers(0, ROWS, n0), rng.integers(0, ROWS, n1)]
        outs = [np.zeros((n0, 264), np.uint8), np.zeros((n1, 264), np.uint8)]
        posted.clear()
        segs = tuple((t.identity, r, ROWS, o) for t, r, o in zip(tables, ids, outs, strict=False))
        assert c.lookup_segs(segs, 20.0) == (0, n0 + n1, 0)
        for t, r, o in zip(tables, ids, outs, strict=False):
            np.testing.assert_array_equal(o, expected(t, r))
        if n0 + n1 <= c.staging_rows:
            assert posted == [2 * (n0 + n1)]  # one READ, two descriptors per row
    out = np.zeros((2, 264), np.uint8)
    posted.clear()
    ok = (tables[0].identity, np.array([1], np.int64), ROWS, np.zeros((1, 264), np.uint8))
    assert c.lookup_segs((ok, (tables[1].identity, np.array([1, ROWS], np.int64), ROWS, out)), 1.0) == (3, 1, 1)
    assert c.lookup_segs((ok, (tables[1].identity, np.array([1, 2], np.int32), ROWS, out)), 1.0) == (2, 1, 0)
    with pytest.raises(Refused) as e:  # a limit above the table: the client's own table check
        c.lookup_segs((ok, (tables[1].identity, np.array([1, ROWS], np.int64), 1 << 40, out)), 1.0)
    assert e.value.reason == "out_of_range"
    with pytest.raises(Refused) as e:
        c.lookup_segs((ok, (bytes(32), np.array([1, 2], np.int64), ROWS, out)), 1.0)
    assert e.value.reason == "wrong_identity"
    assert posted == [] and (out == 0).all()  # nothing was READ
    c.close()
