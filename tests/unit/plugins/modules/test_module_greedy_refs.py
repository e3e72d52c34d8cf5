"""plugins/modules/greedy_refs.py: record on first run, verify after, first differing position, counters."""

from __future__ import annotations

import json

import pytest
from ansible_collections.dsv41.offload.plugins.modules import greedy_refs  # noqa: E402

from serverutil import FakeServing  # noqa: E402


@pytest.fixture
def serving():
    s = FakeServing()
    yield s
    s.close()


def test_auto_records_then_verifies(serving, tmp_path, run_module):
    path = tmp_path / "refs" / "greedy.json"
    args = {"endpoint": serving.url, "path": str(path), "max_tokens": 6, "metrics_url": serving.url + "/metrics"}
    kind, res = run_module(greedy_refs, args)
    assert kind == "exit" and res["changed"] and res["action"] == "recorded"
    assert json.loads(path.read_text())["max_tokens"] == 6
    kind, res = run_module(greedy_refs, args)
    assert kind == "exit" and not res["changed"] and res["action"] == "verified"
    assert (res["identical"], res["total"], res["summary"]) == (6, 6, "6/6 identical")
    assert res["counters_delta"]["0"]["lookups"] == 6 and res["counters_delta"]["1"]["fallbacks"] == 0
    assert res["drafter_delta"] == {"rounds": 12.0, "identity_refusals": 0.0}


def test_mismatch_fails_with_first_position(serving, tmp_path, run_module):
    path = tmp_path / "greedy.json"
    run_module(greedy_refs, {"endpoint": serving.url, "path": str(path), "max_tokens": 6})
    serving.shift_names, serving.shift_at = {"casefold"}, 2
    kind, res = run_module(greedy_refs, {"endpoint": serving.url, "path": str(path)})
    assert kind == "fail" and res["identical"] == 5
    assert "casefold differs at 2" in res["msg"] and str(path) in res["msg"]
    assert [p["first_diff"] for p in res["prompts"] if p["name"] == "casefold"] == [2]


def test_check_mode_records_nothing(serving, tmp_path, run_module):
    path = tmp_path / "greedy.json"
    kind, res = run_module(greedy_refs, {"endpoint": serving.url, "path": str(path), "_ansible_check_mode": True})
    assert kind == "exit" and res["changed"] and not path.exists()


def test_verify_mode_needs_the_file(serving, tmp_path, run_module):
    kind, res = run_module(greedy_refs, {"endpoint": serving.url, "path": str(tmp_path / "x.json"), "mode": "verify"})
    assert kind == "fail" and "cannot read refs" in res["msg"]


def test_endpoint_without_token_ids_fails_clearly(serving, tmp_path, run_module):
    serving.no_token_ids = True
    kind, res = run_module(greedy_refs, {"endpoint": serving.url, "path": str(tmp_path / "r.json")})
    assert kind == "fail" and "token_ids" in res["msg"]


def test_counter_requirements_retry_then_fail_naming_rank(serving, tmp_path, run_module):
    path = tmp_path / "greedy.json"
    run_module(greedy_refs, {"endpoint": serving.url, "path": str(path), "max_tokens": 4})
    serving.fallbacks_per_call = 1  # every completion also counts a fallback on both ranks
    kind, res = run_module(
        greedy_refs,
        {
            "endpoint": serving.url,
            "path": str(path),
            "metrics_url": serving.url + "/metrics",
            "require_ranks": ["0", "1"],
            "require_drafter": True,
            "attempts": 2,
            "delay": 0,
        },
    )
    assert kind == "fail" and res["attempts"] == 2
    assert res["msg"] == "counters while the references ran (2 attempt(s)): rank 0: 6 Engram fallbacks"


def test_counter_requirements_met(serving, tmp_path, run_module):
    path = tmp_path / "greedy.json"
    kind, res = run_module(
        greedy_refs,
        {
            "endpoint": serving.url,
            "path": str(path),
            "max_tokens": 4,
            "metrics_url": serving.url + "/metrics",
            "require_ranks": ["0", "1"],
            "require_drafter": True,
            "attempts": 3,
        },
    )
    assert kind == "exit" and res["attempts"] == 1 and res["action"] == "recorded" and path.exists()


def test_missing_rank_and_no_drafting(serving, tmp_path, run_module):
    path = tmp_path / "greedy.json"
    serving.drafter_rounds_per_call = 0
    kind, res = run_module(
        greedy_refs,
        {
            "endpoint": serving.url,
            "path": str(path),
            "max_tokens": 4,
            "metrics_url": serving.url + "/metrics",
            "require_ranks": ["2"],
            "require_drafter": True,
        },
    )
    assert kind == "fail" and "rank 2: no Engram counters on /metrics" in res["msg"]
    assert "drafter: no drafting rounds" in res["msg"] and path.exists()  # recorded before the check


def test_require_ranks_needs_metrics_url(serving, tmp_path, run_module):
    kind, res = run_module(
        greedy_refs, {"endpoint": serving.url, "path": str(tmp_path / "g.json"), "require_ranks": ["0"]}
    )
    assert kind == "fail" and res["msg"] == "require_ranks needs metrics_url"
