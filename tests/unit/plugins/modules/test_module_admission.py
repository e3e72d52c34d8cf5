"""plugins/modules/admission.py: status, HOLD/release, idempotence, check mode, diff, errors."""

from __future__ import annotations

import pytest
from ansible_collections.dsv41.offload.plugins.modules import admission  # noqa: E402

from serverutil import FakeServing  # noqa: E402


@pytest.fixture
def serving():
    s = FakeServing()
    yield s
    s.close()


def test_status_reads_only(serving, run_module):
    kind, res = run_module(admission, {"endpoint": serving.url})
    assert kind == "exit" and res == {"changed": False, "previous": "open", "state": "open"}
    assert not any(c.startswith("POST") for c in serving.calls)


def test_hold_then_idempotent_then_release(serving, run_module):
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "held"})
    assert kind == "exit" and res["changed"] and res["previous"] == "open" and serving.paused
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "held"})
    assert kind == "exit" and not res["changed"] and res["previous"] == "held"
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "open"})
    assert res["changed"] and not serving.paused


def test_check_mode_and_diff_send_nothing(serving, run_module):
    kind, res = run_module(
        admission, {"endpoint": serving.url, "state": "held", "_ansible_check_mode": True, "_ansible_diff": True}
    )
    assert kind == "exit" and res["changed"] and res["state"] == "held"
    assert res["diff"]["before"] == "admission: open\n" and res["diff"]["after"] == "admission: held\n"
    assert not serving.paused and not any(c.startswith("POST") for c in serving.calls)


def test_unreachable_endpoint_fails_with_one_line(run_module):
    kind, res = run_module(admission, {"endpoint": "http://127.0.0.1:9", "state": "open"})
    assert kind == "fail" and "cannot read admission state at http://127.0.0.1:9" in res["msg"]


def test_bad_state_rejected(run_module):
    kind, res = run_module(admission, {"endpoint": "http://x", "state": "closed"})
    assert kind == "fail" and "state" in res["msg"] and "closed" in res["msg"]


def test_a_fenced_hold_is_resent_with_its_token_when_already_held(serving, run_module, monkeypatch):
    # a killed run left the engine held for its token; the next run's HOLD must name its own
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "held"})
    assert kind == "exit" and res["changed"]
    monkeypatch.setenv("DSV41_WINDOW_TOKEN", "next-run-token")
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "held"})
    assert kind == "exit" and not res["changed"] and res["previous"] == "held"
    assert serving.calls[-2].startswith("POST /pause?mode=wait") and serving.pause_query.endswith(
        "&window=next-run-token"
    )
    # check mode still sends nothing
    n = len(serving.calls)
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "held", "_ansible_check_mode": True})
    assert kind == "exit" and not any(c.startswith("POST") for c in serving.calls[n:])


def test_the_window_token_option_wins_over_the_environment(serving, run_module, monkeypatch):
    monkeypatch.setenv("DSV41_WINDOW_TOKEN", "from-env")
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "held", "window_token": "explicit"})
    assert kind == "exit" and serving.pause_query.endswith("&window=explicit")
    # "" sends no token even while the environment has one
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "open"})
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "held", "window_token": ""})
    assert kind == "exit" and "window=" not in serving.pause_query


def test_the_window_token_falls_back_to_the_environment(serving, run_module, monkeypatch):
    monkeypatch.setenv("DSV41_WINDOW_TOKEN", "from-env")
    kind, res = run_module(admission, {"endpoint": serving.url, "state": "held"})
    assert kind == "exit" and serving.pause_query.endswith("&window=from-env")


def test_the_token_does_not_outlive_the_module_call(serving, run_module, monkeypatch):
    from dsv41.harness import http

    monkeypatch.delenv("DSV41_WINDOW_TOKEN", raising=False)
    run_module(admission, {"endpoint": serving.url, "state": "held", "window_token": "once"})
    assert http.window_headers() == {}
