"""The overlay worker's C++ core plan, without a server: the pipelined piece plan equals the
all-at-once plan, the tail piece layout is the core's and Python's (``RemoteRows._piece_keys``)
and plans exactly, a negative tail is refused, and an owned id past the table is flagged in either
plan order. The core against a real table server: test_overlay_worker_native.py."""

from __future__ import annotations

import numpy as np
import pytest

from dsv41.overlay import core as overlay_core, engram_rows as ER, engram_worker as EW
from dsv41.transport import native

pytestmark = pytest.mark.skipif(
    overlay_core._core is None or native._fastrow is None, reason="the C++ extensions are not built"
)


def _piece_reference(ids: np.ndarray, lo: int, hi: int, piece_rows: int) -> tuple[list, np.ndarray, list]:
    """plan_rows' arithmetic per piece in numpy: owned ids per piece, the selectors (relative to
    the piece) and each piece's fetch list."""
    sel = np.full(ids.size, -1, np.int32)
    ns, fetches = [], []
    for r0 in range(0, ids.size, piece_rows):
        v = ids[r0 : r0 + piece_rows]
        own = (v >= lo) & (v < hi)
        sel[r0 : r0 + v.size][own] = np.arange(int(own.sum()), dtype=np.int32)
        ns.append(int(own.sum()))
        fetches.append(v[own])
    return ns, sel, fetches


@pytest.mark.parametrize(
    "rows,piece_rows,lo,hi,seed",
    [
        (600, 100, 1000, 3000, 1),  # six full pieces, about half the ids owned
        (655, 100, 1000, 3000, 2),  # a short last piece
        (100, 100, 1000, 3000, 3),  # one piece: no planner thread
        (1, 100, 1000, 3000, 4),
        (0, 100, 1000, 3000, 5),  # no ids
        (700, 64, 0, 10**12, 6),  # every id owned
        (700, 64, 5000, 6000, 7),  # pieces with no owned id
        (393216, 65536, 0, 1 << 20, 8),  # a 32K chunk of one layer in the production layout
    ],
)
def test_the_pipelined_piece_plan_equals_the_all_at_once_plan(rows, piece_rows, lo, hi, seed) -> None:
    """The core's plan of a multi-piece job with the planner thread ahead of the requests (piece 0
    first, pieces 1.. while the requests before are in flight) gives the same per-piece counts,
    selectors and fetch lists as planning every piece before the first request, and both equal
    plan_rows' arithmetic piece by piece; ids of other ranks, -1 padding, negative and huge ids
    included."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 4000 if hi < 10**6 else 1 << 21, rows).astype(np.int64)
    if rows:
        ids[rng.random(rows) < 0.1] = -1
        ids[rng.random(rows) < 0.01] = np.iinfo(np.int64).min
        ids[rng.random(rows) < 0.01] = np.iinfo(np.int64).max
    want_ns, want_sel, want_fetch = _piece_reference(ids, lo, hi, piece_rows)
    got = {}
    # (ahead, head): all at once; piece 0 then the rest ahead; piece 0's head first
    # (1 row, a typical head, all of piece 0 but one row, and heads that are no split)
    orders = [(False, 0), (True, 0)] + [(True, h) for h in (1, piece_rows // 8, piece_rows - 1, piece_rows, 10**9)]
    for ahead, head in orders:
        sel = np.full(rows, 7, np.int32)
        fetch = np.full(rows, -7, np.int64)
        ns, bad = overlay_core._core.plan_pieces(ids, lo, hi, 1 << 62, piece_rows, sel, fetch, ahead, head)
        assert not bad
        got[ahead, head] = (
            list(ns),
            sel,
            [fetch[r0 : r0 + n] for r0, n in zip(range(0, rows, piece_rows), ns, strict=False)],
        )
    for order in orders:
        ns, sel, fetches = got[order]
        assert ns == want_ns and np.array_equal(sel, want_sel)
        assert len(fetches) == len(want_fetch) and all(
            np.array_equal(a, b) for a, b in zip(fetches, want_fetch, strict=False)
        )
    if rows:
        flat_sel = np.full(rows, 7, np.int32)
        flat_fetch = np.empty(rows, np.int64)
        n = overlay_core._core.plan_rows(ids, lo, hi, flat_sel, flat_fetch)  # the same arithmetic, one piece
        own = (ids >= lo) & (ids < hi)
        assert n == int(own.sum()) and np.array_equal(flat_fetch[:n], ids[own])
        assert np.array_equal(flat_sel[own], np.arange(n)) and (flat_sel[~own] == -1).all()


def test_the_tail_piece_layout_is_the_cores_and_pythons_and_plans_exactly(monkeypatch) -> None:
    """``TAIL_ROWS``: each tail in turn cuts the last piece's last rows into a
    piece of their own in a job of several pieces (Python's ``_piece_keys`` as the core's
    ``piece_layout``): the production 32K chunk at TP2 is 5 x 65,536 + 49,152 + 14,336 + 2,048
    rows; a one-piece job is not split, nor a last piece no longer than a tail (by that tail);
    the plan in that layout, in every order and for one tail or two, equals numpy's piece by piece."""
    assert EW.TAIL_ROWS == ER.TAIL_ROWS == (16384, 2048)
    assert ER.RemoteRows._piece_keys(393216) == (
        [(k * 65536, 65536) for k in range(5)] + [(327680, 49152), (376832, 14336), (391168, 2048)]
    )
    assert ER.RemoteRows._piece_keys(65536) == [(0, 65536)]
    assert ER.RemoteRows._piece_keys(65536 + 16384) == [(0, 65536), (65536, 14336), (79872, 2048)]
    assert ER.RemoteRows._piece_keys(65536 + 2048) == [(0, 65536), (65536, 2048)]
    assert ER.RemoteRows._piece_keys(65536 + 100) == [(0, 65536), (65536, 100)]
    monkeypatch.setattr(ER, "PIECE_ROWS", 100)
    rng = np.random.default_rng(11)
    for tails in ((30,), (30, 10), (0, 10), ()):
        monkeypatch.setattr(ER, "TAIL_ROWS", tails)
        for rows in (655, 600, 630, 120, 105):
            keys = ER.RemoteRows._piece_keys(rows)
            assert [r0 for r0, _ in keys] == sorted({r0 for r0, _ in keys}) and sum(m for _, m in keys) == rows
            ids = rng.integers(0, 4000, rows).astype(np.int64)
            want = [(int(((v := ids[r0 : r0 + m]) >= 1000).__and__(v < 3000).sum()), r0, m) for r0, m in keys]
            for ahead, head in ((False, 0), (True, 0), (True, 30)):
                sel = np.full(rows, 7, np.int32)
                fetch = np.full(rows, -7, np.int64)
                ns, bad = overlay_core._core.plan_pieces(
                    ids, 1000, 3000, 1 << 62, 100, sel, fetch, ahead, head, list(tails)
                )
                assert not bad and list(ns) == [n for n, _, _ in want], (tails, rows)
                for n, r0, m in want:
                    v = ids[r0 : r0 + m]
                    own = (v >= 1000) & (v < 3000)
                    assert np.array_equal(fetch[r0 : r0 + n], v[own])
                    assert np.array_equal(sel[r0 : r0 + m][own], np.arange(n)) and (sel[r0 : r0 + m][~own] == -1).all()


def test_a_negative_tail_is_refused_by_the_core_and_the_plan() -> None:
    """A tail of fewer than 0 rows is a caller's error: ``EngramCore`` and ``plan_pieces`` raise
    ValueError naming it, before anything runs."""
    with pytest.raises(ValueError, match="tail_rows entries must be >= 0"):
        overlay_core._core.EngramCore(64, 100, 60.0, 30, [30, -1])
    with pytest.raises(ValueError, match="tail_rows entries must be >= 0"):
        overlay_core._core.plan_pieces(
            np.arange(10, dtype=np.int64), 0, 10, 10, 4, np.empty(10, np.int32), np.empty(10, np.int64), False, 0, [-2]
        )


@pytest.mark.parametrize("ahead", [False, True])
def test_an_owned_id_past_the_table_is_flagged_in_either_plan_order(ahead) -> None:
    """An owned id at or past the table's row count (or a negative one in a range that starts
    below 0) sets the plan's flag, in either order; an id outside the range never does."""
    ids = np.arange(0, 500, dtype=np.int64)
    assert (
        overlay_core._core.plan_pieces(
            ids, 0, 1000, 1000, 100, np.empty(500, np.int32), np.empty(500, np.int64), ahead
        )[1]
        is False
    )
    ids[437] = 1000  # owned ([0, 2000)), past a 1000-row table
    assert (
        overlay_core._core.plan_pieces(
            ids, 0, 2000, 1000, 100, np.empty(500, np.int32), np.empty(500, np.int64), ahead
        )[1]
        is True
    )
    ids[437] = -5  # owned by a range from -10, negative: past the table as an unsigned row
    assert (
        overlay_core._core.plan_pieces(
            ids, -10, 1000, 1000, 100, np.empty(500, np.int32), np.empty(500, np.int64), ahead
        )[1]
        is True
    )
