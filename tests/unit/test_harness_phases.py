"""dsv41.harness.phases: layer 1's exposed time in a prefill step taken apart."""

import pytest

from dsv41.errors import Dsv41Error
from dsv41.harness import phases as P

MS = 1_000_000  # ns per ms


def _trace(t0, pieces=3, fetch_ms=5.0, launch_ms=0.03, wait_ms=0.01):
    """A synthetic job: submitted 0.1 ms after t0, then every phase a known length."""
    t_sub = t0 + int(0.1 * MS)
    t_deq = t_sub + int(0.04 * MS)
    t_ids = t_deq + int(0.02 * MS)
    t_plan0 = t_ids + int(0.2 * MS)
    f0, f1, l1 = [], [], []
    t = t_plan0 + int(0.005 * MS)
    for k in range(pieces):
        if k:
            t += int(wait_ms * MS)
        f0.append(t)
        t += int(fetch_ms * MS)
        f1.append(t)
        t += int(launch_ms * MS)
        l1.append(t)
    t_done = t + int(0.01 * MS)
    return {
        "key": 1,
        "gen": 1,
        "rows": pieces * 65536,
        "t_sub": t_sub,
        "t_deq": t_deq,
        "t_ids": t_ids,
        "t_plan0": t_plan0,
        "t_done": t_done,
        "fetch0": f0,
        "fetch1": f1,
        "launch1": l1,
    }


def test_phases_sum_to_the_critical_path_and_give_the_excess():
    t0 = 10_000 * MS
    tr = _trace(t0)
    done_ms = (tr["t_done"] - t0) / MS
    gms = {"l0_start": 0.05, "l0_end": 0.05 + 12.5, "a": 0.05 + 12.5, "b": done_ms + 0.4}
    ph = P.layer1_phases(tr, t0, gms, 12.54)
    assert ph["fetch"] == pytest.approx(15.0)
    assert ph["submit_after_l0"] == pytest.approx(0.05)
    assert ph["wake"] == pytest.approx(0.04) and ph["ids_wait"] == pytest.approx(0.02)
    assert ph["plan0"] == pytest.approx(0.2) and ph["plan0_to_fetch"] == pytest.approx(0.005)
    assert ph["launches"] == pytest.approx(0.06) and ph["plan_waits"] == pytest.approx(0.02)
    assert ph["last_launch"] == pytest.approx(0.04) and ph["tail"] == pytest.approx(0.4)
    assert sum(ph[k] for k in P.PHASES) == pytest.approx(ph["critical"])
    assert ph["layer0"] == pytest.approx(12.5)
    assert ph["stall"] == pytest.approx(gms["b"] - gms["a"])
    # a follows layer 0 at once: the excess over the bound is the non-fetch critical path
    assert ph["excess"] == pytest.approx(ph["critical"])
    assert ph["excess_target"] == pytest.approx(ph["excess"] + 0.04)
    assert ph["a_after_l0"] == pytest.approx(0.0)


def test_a_later_than_layer0_end_is_taken_off_the_excess():
    t0 = 5 * MS
    tr = _trace(t0, pieces=2)
    gms = {"l0_start": 0.0, "l0_end": 3.0, "a": 3.5, "b": (tr["t_done"] - t0) / MS + 0.3}
    ph = P.layer1_phases(tr, t0, gms, 3.0)
    assert ph["excess"] == pytest.approx(ph["critical"] - 0.5)


def test_a_piece_without_a_request_takes_no_fetch_time():
    t0 = 7 * MS
    tr = _trace(t0, pieces=3)
    tr["fetch0"][1] = tr["fetch1"][1] = 0  # piece 1 had no owned id
    gms = {"l0_start": 0.0, "l0_end": 1.0, "a": 1.0, "b": (tr["t_done"] - t0) / MS + 0.1}
    ph = P.layer1_phases(tr, t0, gms, 1.0)
    assert ph["fetch"] == pytest.approx(10.0)
    assert sum(ph[k] for k in P.PHASES) == pytest.approx(ph["critical"])


@pytest.mark.parametrize("bad", ["lengths", "missing", "order", "empty"])
def test_malformed_traces_are_refused(bad):
    t0 = MS
    tr = _trace(t0)
    if bad == "lengths":
        tr["launch1"] = tr["launch1"][:-1]
    elif bad == "missing":
        tr["t_ids"] = 0
    elif bad == "order":
        tr["fetch1"][0] = tr["fetch0"][0] - 1
    else:
        tr["fetch0"] = tr["fetch1"] = tr["launch1"] = []
    with pytest.raises(Dsv41Error):
        P.layer1_phases(tr, t0, {"l0_start": 0.0, "l0_end": 1.0, "a": 1.0, "b": 20.0}, 1.0)


def test_summarize_gives_median_and_percentiles_per_key():
    steps = [{"excess": float(v), "tail": 0.4} for v in range(11)]
    s = P.summarize(steps)
    assert s["steps"] == 11
    assert s["excess"] == {"median": 5.0, "p10": 1.0, "p90": 9.0}
    assert s["tail"]["median"] == pytest.approx(0.4)
    with pytest.raises(Dsv41Error):
        P.summarize([])


def test_a_head_first_piece_0_counts_the_wait_between_its_requests_as_a_plan_wait():
    """Piece 0 requested as a head and a rest (the core's HEAD_ROWS): the wait for the rest's plan
    between them is no fetch time; the phases still sum to the critical path."""
    t0 = 3 * MS
    tr = _trace(t0, pieces=2)
    tr["t_head1"] = tr["fetch0"][0] + int(1.0 * MS)
    tr["t_rest0"] = tr["t_head1"] + int(0.05 * MS)
    gms = {"l0_start": 0.0, "l0_end": 2.0, "a": 2.0, "b": (tr["t_done"] - t0) / MS + 0.2}
    ph = P.layer1_phases(tr, t0, gms, 2.0)
    assert ph["fetch"] == pytest.approx(10.0 - 0.05)
    assert ph["plan_waits"] == pytest.approx(0.01 + 0.05)
    assert sum(ph[k] for k in P.PHASES) == pytest.approx(ph["critical"])
    tr["t_rest0"] = 0
    with pytest.raises(Dsv41Error):
        P.layer1_phases(tr, t0, gms, 2.0)
    tr["t_rest0"] = tr["t_head1"] - 1  # the rest before the head's end
    with pytest.raises(Dsv41Error):
        P.layer1_phases(tr, t0, gms, 2.0)


def test_paired_decides_the_bound_on_the_per_step_excess():
    """``paired``: the median of the per-step excess with its order-statistic interval, "met"
    only when the whole interval is at or below 0; the target-based excess decided apart."""
    over = [{"excess": 0.7 + 0.01 * i, "excess_target": -0.5 + 0.01 * i, "tail": 0.4} for i in range(24)]
    out = P.paired(over, [40.0, 42.0])
    assert out["steps"] == 24 and out["within_bound_steps"] == 0
    assert out["excess"]["decision"] == "not met" and out["excess"]["order_ci95_ms"][0] > 0
    assert out["excess_target"]["decision"] == "met" and out["excess_target"]["order_ci95_ms"][1] <= 0
    assert out["layer14_fetch_ms_median"] == pytest.approx(41.0)
    assert out["phases_ms"]["tail"]["median"] == pytest.approx(0.4)
    mixed = [{"excess": (-1) ** i * 0.1, "excess_target": 0.0} for i in range(24)]
    out = P.paired(mixed, [])
    assert out["excess"]["decision"] == "undecided" and out["within_bound_steps"] == 12
    assert out["layer14_fetch_ms_median"] is None
    with pytest.raises(Dsv41Error):
        P.paired([], [])


def _stream(t0, idle_ms=0.03):
    """A synthetic pass-L stream trace: 3 pieces whose requests overlap; fetch 15 ms of a 15.03
    ms span (one 0.03 ms gap with nothing in flight)."""
    tr = _trace(t0)
    tr.update(stream=True, t_fetch0=tr["t_plan0"] + int(0.005 * MS))
    tr["fetch0"] = [tr["t_fetch0"] + k * int(4 * MS) for k in range(3)]
    tr["fetch1"] = [tr["t_fetch0"] + int((k + 1) * 5 * MS) for k in range(3)]
    tr["launch1"] = [f + int(0.04 * MS) for f in tr["fetch1"]]
    tr["t_fetch1"] = tr["fetch1"][-1] + int(idle_ms * MS)
    tr["idle"] = int(idle_ms * MS)
    tr["t_done"] = tr["launch1"][-1] + int(0.01 * MS)
    return tr


def test_a_stream_trace_counts_busy_time_as_the_fetch_and_launches_off_the_path():
    t0 = 10_000 * MS
    tr = _stream(t0)
    gms = {"l0_start": 0.05, "l0_end": 12.55, "a": 12.55, "b": (tr["t_done"] - t0) / MS + 0.2}
    ph = P.layer1_phases(tr, t0, gms, 12.54)
    assert ph["fetch"] == pytest.approx(15.0) and ph["span"] == pytest.approx(15.03)
    assert ph["launches"] == 0.0 and ph["plan_waits"] == pytest.approx(0.03)
    assert ph["launches_overlapped"] == pytest.approx(0.12)
    assert ph["plan0_to_fetch"] == pytest.approx(0.005) and ph["tail"] == pytest.approx(0.2)
    assert sum(ph[k] for k in P.PHASES) == pytest.approx(ph["critical"]) == pytest.approx(ph["excess"])


@pytest.mark.parametrize(
    "bad",
    [{"idle": 10**12}, {"idle": -1}, {"t_fetch0": 0}, {"launch1": []}, {"t_fetch1": 1}, {"launch1": [1, 2, 10**15]}],
)
def test_malformed_stream_traces_are_refused(bad):
    tr = _stream(10_000 * MS)
    tr.update(bad)
    with pytest.raises(Dsv41Error):
        P.layer1_phases(tr, 10_000 * MS, {"l0_start": 0, "l0_end": 1, "a": 1, "b": 30}, 1.0)


def test_trace_fetch_is_the_streams_busy_time_or_the_sum_of_requests():
    tr = _stream(10_000 * MS)
    assert P.trace_fetch_ns(tr) == 15 * MS
    old = _trace(10_000 * MS)
    assert P.trace_fetch_ns(old) == 15 * MS  # 3 pieces of 5 ms, one after the other


def test_join_return_takes_the_tail_after_the_hand_off_apart():
    t_done = 100 * MS
    wait = (7, t_done - 20 * MS, t_done + 2_000, t_done + 12_000, t_done + 15_000)
    join_ret, join1 = t_done + 40_000, t_done + 55_000
    b_ns = join1 + 10_000.0
    r = P.join_return(t_done, wait, join_ret, join1, b_ns)
    assert r["ret_seen"] == pytest.approx(0.002) and r["ret_queue"] == pytest.approx(0.010)
    assert r["ret_gil"] == pytest.approx(0.003) and r["ret_join_py"] == pytest.approx(0.025)
    assert r["ret_vllm"] == pytest.approx(0.015) and r["ret_to_b"] == pytest.approx(0.010)
    assert r["join_return"] == pytest.approx(0.055) and r["wait_lead"] == pytest.approx(20.0)
    # the return phases sum to the tail: b less the hand-off
    assert sum(r[k] for k in P.RETURN_PHASES) == pytest.approx((b_ns - t_done) * 1e-6)
    # the hand-off seen before the core read t_done (after its unlock): a small negative ret_seen
    assert P.join_return(t_done, (7, t_done - MS, t_done - 500, t_done, t_done + 1), join_ret, join1, b_ns)[
        "ret_seen"
    ] == pytest.approx(-0.0005)


@pytest.mark.parametrize("wait", [(1, 0, 5, 6, 7), (1, 4, 3, 6, 7), (1, 1, 2, 3, 10**12)])
def test_join_return_refuses_missing_or_disordered_times(wait):
    with pytest.raises(Dsv41Error):
        P.join_return(10, wait, 10**9, 10**9 + 1, 2e9)
