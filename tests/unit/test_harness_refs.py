"""dsv41.harness.refs / admission / refs_cli against a fake rank 0 endpoint on 127.0.0.1."""

from __future__ import annotations

import pytest

from dsv41.harness import admission, refs
from serverutil import FakeServing


@pytest.fixture
def serving():
    s = FakeServing()
    yield s
    s.close()


def test_first_diff():
    assert refs.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert refs.first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert refs.first_diff([1, 2], [1, 2, 3]) == 2
    assert refs.first_diff([], [7]) == 0


def test_record_then_verify_identical(serving, tmp_path):
    doc = refs.run_prompts(serving.url, max_tokens=8)
    assert doc["model"] == "dsv41-lab" and len(doc["prompts"]) == 6
    assert all(len(p["token_ids"]) == 8 for p in doc["prompts"])
    path = tmp_path / "r" / "refs.json"
    refs.save_refs(doc, path)
    cmp = refs.verify(serving.url, refs.load_refs(path))
    assert (cmp.identical, cmp.total) == (6, 6) and cmp.summary() == "6/6 identical"


def test_verify_reports_first_differing_position(serving, tmp_path):
    doc = refs.run_prompts(serving.url, max_tokens=8)
    serving.shift_names = {"repeat", "digits"}
    serving.shift_at = 5
    cmp = refs.verify(serving.url, doc)
    assert cmp.identical == 4
    diffs = {r.name: r.first_diff for r in cmp.results}
    assert diffs["repeat"] == 5 and diffs["digits"] == 5 and diffs["plain"] is None
    assert "repeat differs at 5" in cmp.summary()


def test_missing_token_ids_is_one_clear_error(serving):
    serving.no_token_ids = True
    with pytest.raises(refs.RefsError, match="token_ids"):
        refs.run_prompts(serving.url, max_tokens=4)


def test_unreachable_endpoint():
    with pytest.raises(refs.RefsError, match="cannot list models"):
        refs.run_prompts("http://127.0.0.1:9", max_tokens=4)


@pytest.mark.parametrize(
    "content,match",
    [
        ("{", "not JSON"),
        ('{"format": "other"}', "is not a"),
        ('{"format": "dsv41-greedy-refs/1", "prompts": []}', "no valid prompts"),
        ('{"format": "dsv41-greedy-refs/1", "prompts": [{"name": "a", "prompt": "b", "token_ids": []}]}', "max_tokens"),
    ],
)
def test_load_refs_rejects_bad_files(tmp_path, content, match):
    p = tmp_path / "refs.json"
    p.write_text(content)
    with pytest.raises(refs.RefsError, match=match):
        refs.load_refs(p)


def test_load_refs_missing_file(tmp_path):
    with pytest.raises(refs.RefsError, match="cannot read refs"):
        refs.load_refs(tmp_path / "nope.json")


def test_engram_counters_and_delta():
    text = (
        "# TYPE dsv41_engram_lookups_total counter\n"
        'dsv41_engram_lookups_total{rank="0"} 10\n'
        'dsv41_engram_lookups_total{rank="1"} 12\n'
        'dsv41_engram_lookups_created{rank="0"} 1.7e9\n'
        'dsv41_engram_fallbacks_total{rank="1"} 2\n'
        'dsv41_engram_latency_sum_s{rank="0"} 0.5\n'
        "dsv41_engram_lookups_total 99\n"
    )
    c = refs.engram_counters(text)
    with pytest.raises(refs.RefsError, match="not Prometheus text exposition"):
        refs.engram_counters(text + "garbage line\n")  # parsed by prometheus_client: refused, not skipped
    assert c == {"0": {"lookups": 10.0, "latency_sum_s": 0.5}, "1": {"lookups": 12.0, "fallbacks": 2.0}}
    after = {"0": {"lookups": 15.0, "latency_sum_s": 0.7}, "1": {"lookups": 20.0, "fallbacks": 2.0}}
    d = refs.counter_delta(c, after)
    assert d["0"]["lookups"] == 5 and d["1"]["fallbacks"] == 0
    assert refs.check_remote_engram(d, ["0", "1"]) is None
    assert refs.check_remote_engram({"0": {"lookups": 1, "fallbacks": 3}}, ["0"]) == "rank 0: 3 Engram fallbacks"
    assert refs.check_remote_engram({"0": {"lookups": 0}}, ["0"]) == "rank 0: no Engram lookups counted"
    assert refs.check_remote_engram({}, ["1"]) == "rank 1: no Engram counters on /metrics"


def test_flat_values():
    text = 'dsv41_drafter_rounds 4\ndsv41_drafter_drafts_total 9\ndsv41_drafter_x{a="1"} 3\nother 1\n'
    assert refs.flat_values(text, "dsv41_drafter_") == {"rounds": 4.0, "drafts": 9.0}


def test_check_drafter():
    assert refs.check_drafter({"rounds": 3, "identity_refusals": 0}) is None
    assert refs.check_drafter({"rounds": 3, "identity_refusals": 2}) == "drafter: 2 identity refusals"
    assert refs.check_drafter({"rounds": 0, "fail_closed_rounds": 7}) == "drafter: no drafting rounds (7 failed closed)"
    assert refs.check_drafter({}) == "drafter: no drafting rounds"


def test_fetch_engram_counters(serving):
    serving.lookups = 3
    assert refs.fetch_engram_counters(serving.url + "/metrics")["1"]["lookups"] == 3


def test_admission_status_hold_release_idempotent(serving):
    assert admission.status(serving.url) == "open"
    assert admission.set_state(serving.url, "held") == "open"
    assert serving.paused
    # vLLM's default mode is abort: the HOLD must ask for a drain explicitly
    assert serving.pause_query == "mode=wait&timeout_s=600"
    n = len(serving.calls)
    assert admission.set_state(serving.url, "held") == "held"
    assert not any(c.startswith("POST") for c in serving.calls[n:])  # idempotent: no request
    assert admission.set_state(serving.url, "open") == "held" and not serving.paused


def test_admission_errors(serving):
    with pytest.raises(admission.AdmissionError, match="must be"):
        admission.set_state(serving.url, "closed")
    with pytest.raises(admission.AdmissionError, match="cannot read admission"):
        admission.status("http://127.0.0.1:9")


def test_refs_cli_record_verify(serving, tmp_path, capsys):
    from dsv41.cli import main as cli_main

    out = tmp_path / "refs.json"
    assert cli_main(["refs", "record", "--endpoint", serving.url, "--out", str(out), "--max-tokens", "4"]) == 0
    assert cli_main(["refs", "record", "--endpoint", serving.url, "--out", str(out)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert cli_main(["refs", "verify", "--endpoint", serving.url, "--refs", str(out)]) == 0
    assert "6/6 identical" in capsys.readouterr().out
    serving.shift_names = {"code"}
    serving.shift_at = 1
    assert cli_main(["refs", "verify", "--endpoint", serving.url, "--refs", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsv41: error: greedy references differ: 5/6 identical; code differs at 1")
