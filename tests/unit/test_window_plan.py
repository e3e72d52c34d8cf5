"""window.yml's pre-HOLD plan (refusals, arm variables, switch tags), its fault trigger, the
window token on the harness's requests and in the engine's /pause, and the switch readiness check."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dsv41.harness import admission, http, win2_cap, window, window_plan
from dsv41.harness.window import WindowError

ROOT = Path(__file__).resolve().parents[2]
CANDS = str(ROOT / "candidates")


def _cand(tmp_path: Path, name: str, body: str) -> str:
    d = tmp_path / "cands"
    d.mkdir(exist_ok=True)
    (d / f"{name}.yml").write_text(body)
    return str(d)


BASE = "name: {n}\nquestion: q\nkind: plain\nprimary_metric: step_ms_p50\nmin_effect: 0.05\n"


def test_shipped_plan_aa_has_no_switch(tmp_path):
    p = window_plan.plan(["aa"], root=CANDS, windows_dir=str(tmp_path))
    (w,) = p["windows"]
    assert p["control"] == "production" and w["roles"] == [] and w["switch_roles"] == []
    assert w["arms"] == {"control": {}, "candidate": {}} and w["window_number"] == 1


def test_plan_switch_reruns_the_union_of_both_arms_roles(tmp_path):
    p = window_plan.plan(["slow-rows", "aa"], control="sync-drafter", root=CANDS, windows_dir=str(tmp_path))
    slow, aa = p["windows"]
    assert slow["roles"] == ["serve", "spec_decode"] and aa["roles"] == ["spec_decode"]
    assert slow["switch_roles"] == ["serve", "spec_decode"] and aa["switch_roles"] == ["serve", "spec_decode"]
    assert slow["arms"]["control"] == {"spec_decode_async": False}
    assert slow["arms"]["candidate"] == {"serve_extra_env": {"DSV41_ENGRAM_FAULT_DELAY_MS": "20"}}
    only_serve = window_plan.plan(["slow-rows"], root=CANDS, windows_dir=str(tmp_path))["windows"][0]
    assert only_serve["switch_roles"] == ["serve"]  # drafting is not re-applied when no arm changes it


@pytest.mark.parametrize(
    "names,control,msg",
    [
        (["nope"], "production", "unknown candidate 'nope'"),
        (["aa"], "nope", "unknown candidate 'nope'"),
        (["aa"], "aa", "both the control and a candidate"),
    ],
)
def test_plan_refusals(tmp_path, names, control, msg):
    with pytest.raises(WindowError, match=msg):
        window_plan.plan(names, control=control, root=CANDS, windows_dir=str(tmp_path))


@pytest.mark.parametrize(
    "text,msg", [("", "no candidate given"), (" , ", "no candidate given"), ("aa,aa", "named twice: aa")]
)
def test_split_names_refusals(text, msg):
    with pytest.raises(WindowError, match=msg):
        window_plan.split_names(text)
    assert window_plan.split_names(" aa, slow-rows ") == ["aa", "slow-rows"]


def test_schema_error_is_refused(tmp_path):
    root = _cand(tmp_path, "bad", BASE.format(n="bad") + "roles:\n  serve:\n    image: x\n")
    with pytest.raises(WindowError, match="fails its schema at roles/serve"):
        window_plan.plan(["bad"], root=root, windows_dir=str(tmp_path))


@pytest.mark.parametrize(
    "var,msg",
    [
        ("DSV41_NOT_A_VARIABLE", "not a dsv41 variable"),
        ("DSV41_SERVE_INPUTS_SHA256", "derived by the role"),
        ("DSV41_WINDOW_TOKEN", "derived by the role"),
    ],
)
def test_unrestorable_delta_is_refused(tmp_path, var, msg):
    root = _cand(tmp_path, "c", BASE.format(n="c") + f"roles:\n  serve:\n    env:\n      {var}: '1'\n")
    with pytest.raises(WindowError, match=msg):
        window_plan.plan(["c"], root=root, windows_dir=str(tmp_path))


def test_malformed_spec_is_refused(tmp_path):
    (tmp_path / "spec.json").write_text("{not json")
    root = _cand(tmp_path, "c", BASE.format(n="c") + "spec: spec.json\nroles: {}\n")
    with pytest.raises(Exception, match="not JSON"):
        window_plan.plan(["c"], root=root, windows_dir=str(tmp_path))
    with pytest.raises(Exception, match="cannot read"):
        window_plan.plan(["aa"], root=CANDS, windows_dir=str(tmp_path), spec=str(tmp_path / "missing.json"))


def test_candidate_spec_is_resolved_and_checked(tmp_path):
    spec = json.loads((ROOT / "candidates/specs/drill.json").read_text())
    (tmp_path / "s.json").write_text(json.dumps(spec))
    root = _cand(tmp_path, "c", BASE.format(n="c") + "spec: s.json\nroles: {}\n")
    (w,) = window_plan.plan(["c"], root=root, windows_dir=str(tmp_path))["windows"]
    assert w["spec"] == str((tmp_path / "s.json").resolve())


def test_third_window_on_a_question_is_refused_before_the_hold(tmp_path):
    win2_cap.record_window(str(tmp_path), "aa", "step_ms_p50", "w1", "UNRESOLVED")
    assert window_plan.plan(["aa"], root=CANDS, windows_dir=str(tmp_path))["windows"][0]["window_number"] == 2
    win2_cap.record_window(str(tmp_path), "aa", "step_ms_p50", "w2", "UNRESOLVED")
    with pytest.raises(win2_cap.CapError, match="refuses a third"):
        window_plan.plan(["aa"], root=CANDS, windows_dir=str(tmp_path))


def test_fault_trigger_strikes_after_n_cells(tmp_path):
    trig, mark = tmp_path / "t", tmp_path / "fired"
    cmd = f"while [ ! -e {{trigger}} ]; do sleep 0.05; done; echo x >> {mark}"
    t = window.FaultTrigger(2, cmd, str(trig))
    t.start()
    t.cell_done()
    time.sleep(0.3)
    assert not mark.exists() and not trig.exists()
    for _ in range(3):
        t.cell_done()
    t.join(30)
    assert mark.read_text() == "x\n" and t.rc == 0 and not trig.exists()


def test_fault_trigger_waits_for_a_slow_strike_before_the_next_cell(tmp_path):
    """The fault lands before the next cell starts: creating the trigger waits for a command
    still striking (bounded by strike_wait_s), so a slow controller cannot let it land later."""
    trig, mark = tmp_path / "t", tmp_path / "fired"
    cmd = f"while [ ! -e {{trigger}} ]; do sleep 0.05; done; sleep 1; echo x >> {mark}"
    t = window.FaultTrigger(1, cmd, str(trig), strike_wait_s=30)
    t.start()
    t.cell_done()  # trigger created; waits for the strike
    assert mark.read_text() == "x\n"
    t.join(30)
    # bounded: a command that never strikes delays the window by strike_wait_s only
    t = window.FaultTrigger(1, "sleep 60", str(tmp_path / "t2"), strike_wait_s=0.5)
    t.start()
    t0 = time.monotonic()
    t.cell_done()
    assert 0.4 <= time.monotonic() - t0 < 10
    t.join(0.5)


@pytest.mark.parametrize(
    "arms,after,at",
    [
        (["control", "candidate", "candidate", "control"], 2, 2),  # next cell same arm: as asked
        (["control", "candidate", "candidate", "control"], 1, 2),  # 1 -> 2 is a switch: moved on
        (["control", "candidate", "control", "control"], 1, 3),
        (["control", "candidate", "control", "candidate"], 1, 1),  # no same-arm boundary: as asked
        ([], 2, 2),
    ],
)
def test_fault_trigger_strikes_where_no_arm_switch_heals_it(tmp_path, arms, after, at):
    """An arm switch restarts the TP pair: the trigger moves to the first boundary at or after
    after_cells whose next cell is of the same arm (the plan's own arms)."""
    t = window.FaultTrigger(after, "true", str(tmp_path / "t"), arms=arms or None)
    assert t.at_cell == at
    for _ in range(at - 1):
        t.cell_done()
    assert not (tmp_path / "t").exists()
    t.cell_done()
    assert (tmp_path / "t").exists() and t.record()["at_cell"] == at


def test_fault_trigger_join_kills_a_command_that_never_ends(tmp_path):
    t = window.FaultTrigger(5, "sleep 60", str(tmp_path / "t"))
    t.start()
    t0 = time.monotonic()
    t.join(0.5)
    assert t.rc is not None and t.rc != 0 and time.monotonic() - t0 < 10


def test_window_headers():
    assert http.window_headers({}) == {}
    assert http.window_headers({"DSV41_WINDOW_TOKEN": "w1"}) == {"X-DSV41-Window": "w1"}


def test_admission_hold_names_the_window(monkeypatch):
    sent = []
    state = {"v": "held"}
    monkeypatch.setattr(admission, "status", lambda ep, t=10.0: state["v"])
    monkeypatch.setattr(admission.http, "request", lambda m, url, **kw: sent.append(url))
    monkeypatch.delenv("DSV41_WINDOW_TOKEN", raising=False)
    admission.set_state("http://h:1", "held")
    assert sent == []  # already held, no window: nothing sent
    monkeypatch.setenv("DSV41_WINDOW_TOKEN", "wtok")
    admission.set_state("http://h:1", "held")
    assert sent == ["http://h:1/pause?mode=wait&timeout_s=600&window=wtok"]


def test_wait_ready_success_and_timeout(monkeypatch):
    from dsv41.harness import refs

    counts = iter([{"0": {"lookups": 1}, "1": {"lookups": 1}}, {"0": {"lookups": 5}, "1": {"lookups": 3}}])
    monkeypatch.setattr(refs, "served_model", lambda base: "m")
    monkeypatch.setattr(refs, "generate", lambda *a, **k: [1, 2])
    monkeypatch.setattr(refs, "fetch_engram_counters", lambda url: next(counts))
    r = window_plan.wait_ready("http://h:1", ["0", "1"], timeout_s=1)
    assert r["attempts"] == 1 and r["delta"]["1"]["lookups"] == 2
    monkeypatch.setattr(refs, "fetch_engram_counters", lambda url: {"0": {"lookups": 1}})
    t0 = time.monotonic()
    with pytest.raises(WindowError, match="rank 0: no Engram lookups counted"):
        window_plan.wait_ready("http://h:1", ["0", "1"], timeout_s=0.2, poll_s=0.05)
    assert time.monotonic() - t0 < 5


def test_engine_admits_only_the_window_while_held():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dsv41.engine.server import create_app

    class Sched:
        def counts(self):
            return 0, 0

    class Eng:
        fatal = None
        sched = Sched()

        def submit(self, ids, params, sink):
            sink({"type": "tokens", "ids": [5], "prompt_tokens": len(ids), "completion_tokens": 1})
            sink({"type": "finish", "reason": "length", "prompt_tokens": len(ids), "completion_tokens": 1})

            class R:
                request_id = "r"

            return R()

        def abort(self, rid=None):
            pass

        def idle(self):
            return True

        def freeze(self, on):
            pass

    from authutil import OP_HEADERS, OPERATOR, TEST_HOSTS

    c = TestClient(
        create_app(Eng(), "m", 64, operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS),
        raise_server_exceptions=False,
        headers=OP_HEADERS,
    )
    body = {"prompt": "x", "max_tokens": 1}
    assert c.post("/pause?mode=wait&window=bad token").status_code == 400
    assert c.post("/pause?mode=wait&window=w-1").status_code == 200
    assert c.post("/v1/completions", json=body).status_code == 503
    assert c.post("/v1/completions", json=body, headers={"X-DSV41-Window": "other"}).status_code == 503
    assert c.post("/v1/completions", json=body, headers={"X-DSV41-Window": "w-1"}).status_code == 200
    assert c.post("/pause?mode=wait").status_code == 200  # a plain HOLD drops the window
    assert c.post("/v1/completions", json=body, headers={"X-DSV41-Window": "w-1"}).status_code == 503
    c.post("/pause?mode=wait&window=w-1")
    assert c.post("/resume").status_code == 200
    assert c.post("/v1/completions", json=body).status_code == 200
    c.post("/pause?mode=wait")
    assert c.post("/v1/completions", json=body, headers={"X-DSV41-Window": "w-1"}).status_code == 503


def test_fault_trigger_keeps_its_output_and_says_when_it_did_not_strike(tmp_path):
    """A drill that did not do its job is named (never triggered, or its command failed), with
    the command's own output in fault.log next to the trigger."""
    ok = window.FaultTrigger(1, "while [ ! -e {trigger} ]; do sleep 0.02; done; echo struck", str(tmp_path / "t"))
    ok.start()
    ok.cell_done()
    ok.join(30)
    assert ok.failure() is None and (tmp_path / "fault.log").read_text() == "struck\n"
    assert ok.record() == {"after_cells": 1, "at_cell": 1, "triggered": True, "rc": 0, "log": "fault.log"}

    bad = window.FaultTrigger(
        1,
        "while [ ! -e {trigger} ]; do sleep 0.02; done; echo no host >&2; exit 4",
        str(tmp_path / "t2"),
        log_path=str(tmp_path / "f2.log"),
    )
    bad.start()
    bad.cell_done()
    bad.join(30)
    assert bad.failure() == f"fault drill command failed (rc 4); its output is in {tmp_path / 'f2.log'}"
    assert (tmp_path / "f2.log").read_text() == "no host\n"

    never = window.FaultTrigger(3, "sleep 60", str(tmp_path / "t3"))
    never.start()
    never.cell_done()
    never.join(0.5)
    assert never.failure() == "fault drill never triggered: the window ended after 1 cell(s), the fault was due after 3"
    assert never.record()["triggered"] is False


def test_vllm_arguments_switch_serve_and_are_refused_on_the_stand_in(tmp_path, capsys):
    """A window on vLLM serving arguments re-applies serve only; under the stand-in engine
    (``--serve-runtime lab``) it is refused before any HOLD, as candidate or as control."""
    (w,) = window_plan.plan(["vllm-seqs"], root=CANDS, windows_dir=str(tmp_path), serve_runtime="vllm")["windows"]
    assert w["roles"] == ["serve"] and w["switch_roles"] == ["serve"]
    assert w["arms"] == {"control": {}, "candidate": {"serve_vllm_max_num_seqs": 2}}
    for names, control in ((["vllm-seqs"], "production"), (["aa"], "vllm-seqs")):
        with pytest.raises(WindowError, match="dsv41_serve_runtime=lab: nothing would change"):
            window_plan.plan(names, control=control, root=CANDS, windows_dir=str(tmp_path), serve_runtime="lab")
    from dsv41.cli import main

    argv = ["window", "plan", "--candidates", "vllm-seqs", "--root", CANDS, "--windows-dir", str(tmp_path)]
    assert main([*argv, "--serve-runtime", "lab"]) == 1
    err = capsys.readouterr().err
    assert "nothing would change" in err and len(err.strip().splitlines()) == 1
    assert main([*argv, "--serve-runtime", "vllm"]) == 0
