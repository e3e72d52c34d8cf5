"""The staged bring-up's logic (dsv41.promotion.bringup): which stage runs next from the journal,
the journal step, stage-name validation, the role variables of each stage, and every gate's
failing decision as the one line naming stage, host and measured value."""

from __future__ import annotations

import pytest

from dsv41.cli import main as cli_main
from dsv41.harness.components import ROLE_VARS
from dsv41.promotion import bringup, journal

RANKS = ["0", "1"]


def _stage_op(path, run: str, stage: str, *, passed: bool = True) -> None:
    op = journal.new_op_id() + "-" + stage
    journal.append(path, op, "begin", kind=bringup.KIND, bringup=run, stage=stage)
    if passed:
        journal.append(path, op, "done", result="passed")
        journal.append(path, op, bringup.STEP, stage=stage, bringup=run)


def _refs(identical=6, total=6, delta=None, drafter=None) -> dict:
    return {
        "identical": identical,
        "total": total,
        "counters_delta": delta if delta is not None else {r: {"lookups": 10.0, "fallbacks": 0.0} for r in RANKS},
        "drafter_delta": drafter
        if drafter is not None
        else {"rounds": 4.0, "identity_refusals": 0.0, "fail_closed_rounds": 0.0},
    }


# ---- journal and plan --------------------------------------------------------------------------


def test_stage_passed_is_a_journal_step(tmp_path):
    assert bringup.STEP in journal.STEPS
    e = journal.append(tmp_path / "j.jsonl", "op1", bringup.STEP, stage="stock", bringup="r1")
    assert e["step"] == "stage_passed" and e["stage"] == "stock"


def test_a_passed_stage_leaves_the_replay_decision_none(tmp_path):
    """stage_passed comes after the stage's done: the journal replay has nothing to finish."""
    j = tmp_path / "j.jsonl"
    _stage_op(j, "r1", "stock")
    assert journal.decide(journal.read(j)).action == "none"


def test_empty_journal_runs_every_stage(tmp_path):
    p = bringup.plan(journal.read(tmp_path / "none.jsonl"))
    assert p["new"] and p["passed"] == [] and p["stages"] == list(bringup.STAGES)


@pytest.mark.parametrize("n", range(len(bringup.STAGES) + 1))
def test_rerun_continues_after_the_last_passed_stage(tmp_path, n):
    j = tmp_path / "j.jsonl"
    for s in bringup.STAGES[:n]:
        _stage_op(j, "r1", s)
    p = bringup.plan(journal.read(j))
    assert (p["run"] == "r1" and not p["new"]) if n else p["new"]
    assert p["passed"] == list(bringup.STAGES[:n])
    assert p["stages"] == list(bringup.STAGES[n:])


def test_a_stage_killed_inside_runs_again(tmp_path):
    """begin without stage_passed (killed inside the stage, or its gate failed): it runs again."""
    j = tmp_path / "j.jsonl"
    _stage_op(j, "r1", "stock")
    _stage_op(j, "r1", "links_rows", passed=False)
    assert bringup.plan(journal.read(j))["stages"] == list(bringup.STAGES[1:])


def test_only_the_latest_run_counts_and_other_ops_are_ignored(tmp_path):
    j = tmp_path / "j.jsonl"
    for s in bringup.STAGES:
        _stage_op(j, "old", s)
    _stage_op(j, "new", "stock")
    # a promote between stages, and a stage_passed of an op that is not a bring-up: ignored
    journal.append(j, "p1", "begin", kind="promote", prev="x")
    journal.append(j, "p1", "done")
    journal.append(j, "p2", bringup.STEP, stage="links_rows", bringup="new")
    p = bringup.plan(journal.read(j))
    assert p["run"] == "new" and p["passed"] == ["stock"] and p["stages"] == list(bringup.STAGES[1:])


def test_restart_starts_over(tmp_path):
    j = tmp_path / "j.jsonl"
    for s in bringup.STAGES[:3]:
        _stage_op(j, "r1", s)
    p = bringup.plan(journal.read(j), restart=True)
    assert p["new"] and p["run"] != "r1" and p["stages"] == list(bringup.STAGES)


def test_one_stage_needs_the_earlier_ones_passed(tmp_path):
    j = tmp_path / "j.jsonl"
    _stage_op(j, "r1", "stock")
    assert bringup.plan(journal.read(j), stage="links_rows")["stages"] == ["links_rows"]
    assert bringup.plan(journal.read(j), stage="stock")["stages"] == ["stock"]
    with pytest.raises(bringup.BringupError, match="stage remote_engram needs stage links_rows passed first"):
        bringup.plan(journal.read(j), stage="remote_engram")
    with pytest.raises(bringup.BringupError, match="needs stage stock"):
        bringup.plan([], stage="links_rows")
    assert bringup.plan([], stage="stock")["stages"] == ["stock"]


def test_restart_with_a_stage_is_refused():
    with pytest.raises(bringup.BringupError, match="not both"):
        bringup.plan([], stage="stock", restart=True)


@pytest.mark.parametrize("bad", ["", "Stock", "stock ", "sto*", "../stock", "stock/links_rows", "links", None, 3])
def test_stage_names_are_names(bad):
    with pytest.raises(bringup.BringupError, match="unknown bring-up stage"):
        bringup.stage_name(bad)
    if isinstance(bad, str) and bad:
        with pytest.raises(bringup.BringupError):
            bringup.plan([], stage=bad)


# ---- role variables ---------------------------------------------------------------------------


def test_stock_switches_every_component_off_and_async_is_deploys_production():
    every = {k: v for comp in ROLE_VARS.values() for k, v in comp.items()}
    assert bringup.role_vars("stock") == every
    assert bringup.role_vars("links_rows") == every
    assert bringup.role_vars("async") == {} and bringup.role_vars("window") == {}


def test_each_change_stage_switches_on_exactly_its_component():
    for stage, comp in bringup.ENABLES.items():
        before = bringup.role_vars(bringup.STAGES[bringup.STAGES.index(stage) - 1])
        after = bringup.role_vars(stage)
        assert set(before) - set(after) == set(ROLE_VARS[comp]), stage
    assert set(bringup.ENABLES.values()) == set(ROLE_VARS)


# ---- gates: pass, and every failing decision names stage, host and value ----------------------


def test_every_stage_but_stock_has_a_gate():
    assert set(bringup.GATES) == set(bringup.STAGES) - {"stock"}
    with pytest.raises(bringup.BringupError, match="no gate"):
        bringup.gate("stock", "h", {})


def test_links_rows_passes_and_a_bad_row_stops_it():
    ok = [
        {"id": "links.mtu[ofl0]", "status": "pass"},
        {"link": "ofl0", "check": "up", "ok": True},
        {"id": "exactness.bad_rows[rank 0 layer 2]", "status": "pass", "value": {"bad_rows": 0}},
    ]
    assert bringup.gate("links_rows", "spark1", {"records": ok})["checks"] == 3
    bad = ok + [
        {
            "id": "exactness.bad_rows[rank 0 layer 15]",
            "status": "fail",
            "reason": "rank 0 layer 15: 3 bad rows of 419520, 0 fallbacks",
        }
    ]
    with pytest.raises(bringup.GateError) as e:
        bringup.gate("links_rows", "spark1", {"records": bad})
    assert str(e.value) == (
        "bring-up stopped at stage links_rows on spark1: exactness.bad_rows[rank 0 layer 15]: "
        "rank 0 layer 15: 3 bad rows of 419520, 0 fallbacks"
    )
    with pytest.raises(bringup.GateError, match="links_rows on spark2: ofl0.mtu: value 1500, expected 9000"):
        bringup.gate(
            "links_rows",
            "spark2",
            {"records": [{"link": "ofl0", "check": "mtu", "ok": False, "value": 1500, "expected": 9000}]},
        )
    skipped = [{"id": "exactness.bad_rows[rank 1]", "status": "skipped", "reason": "remote Engram is off on rank 1"}]
    with pytest.raises(
        bringup.GateError, match="links_rows on spark2: exactness.bad_rows\\[rank 1\\]: remote Engram is off"
    ):
        bringup.gate("links_rows", "spark2", {"records": ok + skipped})
    assert bringup.gate(
        "links_rows",
        "x86",
        {"records": [{"id": "links.rdma_port[ofl0]", "status": "skipped", "reason": "no RDMA device"}]},
    )
    with pytest.raises(bringup.GateError, match="no link or exactness check ran"):
        bringup.gate("links_rows", "spark1", {"records": []})


def test_remote_engram_passes_and_a_fallback_stops_it():
    assert bringup.gate("remote_engram", "spark1", {"refs": _refs(), "ranks": RANKS})["ranks"]["1"]["lookups"] == 10
    delta = {"0": {"lookups": 10.0, "fallbacks": 0.0}, "1": {"lookups": 10.0, "fallbacks": 2.0}}
    with pytest.raises(
        bringup.GateError,
        match=r"^bring-up stopped at stage remote_engram on spark1: "
        r"rank 1: 2 Engram fallbacks in the interval$",
    ):
        bringup.gate("remote_engram", "spark1", {"refs": _refs(delta=delta), "ranks": RANKS})
    with pytest.raises(bringup.GateError, match="rank 1: no Engram counters"):
        bringup.gate("remote_engram", "spark1", {"refs": _refs(delta={"0": {"lookups": 1.0}}), "ranks": RANKS})
    with pytest.raises(bringup.GateError, match="rank 0: 0 Engram lookups"):
        bringup.gate(
            "remote_engram",
            "spark1",
            {"refs": _refs(delta={"0": {"lookups": 0.0}, "1": {"lookups": 1.0}}), "ranks": RANKS},
        )
    with pytest.raises(bringup.GateError, match="remote_engram on spark1: greedy references 5/6 identical"):
        bringup.gate("remote_engram", "spark1", {"refs": _refs(identical=5), "ranks": RANKS})


def test_remote_drafter_passes_and_a_parity_miss_or_kv_miss_stops_it():
    r = bringup.gate("remote_drafter", "spark1", {"refs": _refs(), "kv_tokens": 65536.0, "kv_expected": 65536})
    assert r["kv_tokens"] == 65536
    assert bringup.gate("remote_drafter", "spark1", {"refs": _refs(), "kv_tokens": None, "kv_expected": 65536})
    with pytest.raises(bringup.GateError, match="remote_drafter on spark1: greedy references 4/6"):
        bringup.gate("remote_drafter", "spark1", {"refs": _refs(identical=4), "kv_tokens": None, "kv_expected": 1})
    with pytest.raises(bringup.GateError, match="2 drafter identity refusals"):
        bringup.gate(
            "remote_drafter",
            "spark1",
            {"refs": _refs(drafter={"rounds": 3, "identity_refusals": 2}), "kv_tokens": None, "kv_expected": 1},
        )
    with pytest.raises(bringup.GateError, match="0 drafter rounds"):
        bringup.gate(
            "remote_drafter", "spark1", {"refs": _refs(drafter={"rounds": 0}), "kv_tokens": None, "kv_expected": 1}
        )
    with pytest.raises(bringup.GateError, match="KV pool 32768 tokens, expected 65536"):
        bringup.gate("remote_drafter", "spark1", {"refs": _refs(), "kv_tokens": 32768.0, "kv_expected": 65536})


def test_async_passes_and_a_failed_self_test_or_fallback_stops_it():
    good = {"ring": "ok", "host_flags": "ok", "torch_loaded": False, "pid": 1}
    tests = {"spark1": good, "spark2": good}
    assert bringup.gate("async", "spark1", {"selftests": tests, "refs": _refs(), "ranks": RANKS})
    with pytest.raises(
        bringup.GateError,
        match="stage async on spark2: proxy self-test: dsv41: error: proxy self-test: ring round trip failed",
    ):
        bringup.gate(
            "async",
            "spark1",
            {
                "selftests": {"spark1": good, "spark2": "dsv41: error: proxy self-test: ring round trip failed"},
                "refs": _refs(),
                "ranks": RANKS,
            },
        )
    with pytest.raises(bringup.GateError, match="stage async on spark1: proxy self-test: .*torch_loaded"):
        bringup.gate(
            "async", "spark1", {"selftests": {"spark1": dict(good, torch_loaded=True)}, "refs": _refs(), "ranks": RANKS}
        )
    refused = dict(good, mlock="refused: RLIMIT_MEMLOCK 65536 bytes, 2097152 needed")
    with pytest.raises(bringup.GateError) as e:
        bringup.gate(
            "async", "spark1", {"selftests": {"spark1": good, "spark2": refused}, "refs": _refs(), "ranks": RANKS}
        )
    assert str(e.value) == (
        "bring-up stopped at stage async on spark2: proxy memory locking: "
        "refused: RLIMIT_MEMLOCK 65536 bytes, 2097152 needed"
    )
    assert bringup.gate(
        "async", "spark1", {"selftests": {"spark1": dict(good, mlock="ok")}, "refs": _refs(), "ranks": RANKS}
    )
    with pytest.raises(bringup.GateError, match="no proxy self-test ran"):
        bringup.gate("async", "spark1", {"selftests": {}, "refs": _refs(), "ranks": RANKS})
    delta = {"0": {"lookups": 3.0, "fallbacks": 1.0}, "1": {"lookups": 3.0, "fallbacks": 0.0}}
    with pytest.raises(bringup.GateError, match="stage async on spark1: rank 0: 1 Engram fallbacks"):
        bringup.gate("async", "spark1", {"selftests": tests, "refs": _refs(delta=delta), "ranks": RANKS})
    for key, what in (
        ("watchdog_fires", "2 watchdog fires"),
        ("proxy_respawns", "2 proxy respawns"),
        ("proxy_gave_up", "2 proxy gave up"),
    ):
        with pytest.raises(bringup.GateError, match=f"stage async on spark1: {what}"):
            bringup.gate(
                "async", "spark1", {"selftests": tests, "ranks": RANKS, "refs": _refs(drafter={"rounds": 5, key: 2})}
            )
    with pytest.raises(bringup.GateError, match="stage async on spark1: 0 drafter rounds in the interval"):
        bringup.gate("async", "spark1", {"selftests": tests, "ranks": RANKS, "refs": _refs(drafter={"rounds": 0})})
    # one slow worker round decoded target-only: recorded, not refused
    rec = bringup.gate(
        "async",
        "spark1",
        {
            "selftests": tests,
            "ranks": RANKS,
            "refs": _refs(drafter={"rounds": 40, "fail_closed_rounds": 1, "timeouts": 1}),
        },
    )
    assert (rec["rounds"], rec["fail_closed_rounds"], rec["timeouts"]) == (40, 1, 1)


def test_window_gate():
    assert bringup.gate("window", "localhost", {"rc": 0, "verdict": "LOSE"})["verdict"] == "LOSE"
    with pytest.raises(bringup.GateError, match="stage window on localhost: window exit 2, verdict None"):
        bringup.gate("window", "localhost", {"rc": 2})


@pytest.mark.parametrize("measured", [{"bogus": 1}, {"records": 5}, {"records": [1]}, [1, 2]])
def test_measured_values_of_the_wrong_shape_are_one_error(measured):
    with pytest.raises(bringup.BringupError):
        bringup.gate("links_rows", "spark1", measured)


# ---- the CLI: one line and exit 1, never a traceback -------------------------------------------


def test_cli_plan_and_gate(tmp_path, capsys):
    j = tmp_path / "j.jsonl"
    _stage_op(j, "r1", "stock")
    assert cli_main(["package", "bringup-plan", "--path", str(j)]) == 0
    out = capsys.readouterr().out
    assert '"stages": ["links_rows"' in out and '"role_vars"' in out
    assert cli_main(["package", "bringup-plan", "--path", str(j), "--stage", "stock/../async"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown bring-up stage" in err[0]
    measured = '{"refs": {"identical": 6, "total": 6, "counters_delta": {"0": {"lookups": 1, "fallbacks": 4}}}, "ranks": ["0"]}'
    assert cli_main(["package", "bringup-gate", "remote_engram", "--host", "spark1", "--measured", measured]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        ("dsv41: error: bring-up stopped at stage remote_engram on spark1: rank 0: 4 Engram fallbacks in the interval")
    ]
    assert cli_main(["package", "bringup-gate", "links_rows", "--host", "h", "--measured", "{not json"]) == 1
    assert "--measured is not JSON" in capsys.readouterr().err
