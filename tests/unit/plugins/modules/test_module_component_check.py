"""plugins/modules/component_check.py: name validation, check mode sends nothing, a check run
against fake endpoints, and a failed check naming itself."""

from __future__ import annotations

import pytest
from ansible_collections.dsv41.offload.plugins.modules import component_check  # noqa: E402

from dsv41.harness import refs
from serverutil import FakeServing  # noqa: E402


def test_validate_known_names(run_module):
    for name in ("async_handoff", "remote_drafter", "remote_engram"):
        kind, res = run_module(component_check, {"component": name})
        assert kind == "exit" and not res["changed"] and res["behaviour"]


def test_unknown_name_is_one_line(run_module):
    kind, res = run_module(component_check, {"component": "bogus"})
    assert kind == "fail" and res["component"] == "bogus"
    assert res["msg"] == "unknown component 'bogus': choose one of async_handoff, remote_drafter, remote_engram"


def test_check_stage_needs_its_endpoints(run_module):
    kind, res = run_module(component_check, {"component": "remote_engram", "stage": "check"})
    assert kind == "fail" and "endpoint" in res["msg"] and "refs_path" in res["msg"]


@pytest.fixture
def serving(tmp_path):
    s = FakeServing()
    path = tmp_path / "refs.json"
    refs.save_refs(refs.run_prompts(s.url, max_tokens=8), path)
    yield s, path
    s.close()


def _args(serving, **kw):
    s, path = serving
    # the fake rank 0 serves every metric the checks read; as worker and table server it shows
    # counters that do not move (no dsv41_drafter_rounds growth there is irrelevant for remote_engram)
    args = {
        "component": "remote_engram",
        "stage": "check",
        "endpoint": s.url,
        "refs_path": str(path),
        "worker_metrics_url": s.url + "/metrics",
        "server_metrics_url": s.url + "/metrics",
        "envs": {"sparkhead": "# off\n", "sparkworker": ""},
        "burst": 2,
        "max_tokens": 8,
    }
    args.update(kw)
    return args


def test_check_mode_sends_no_traffic(serving, run_module):
    s = serving[0]
    calls = len(s.calls)
    kind, res = run_module(component_check, dict(_args(serving), _ansible_check_mode=True))
    assert kind == "exit" and not res["changed"] and "checks" not in res
    assert s.calls[calls:] == []


def test_check_passes_and_reports_counters(serving, run_module):
    kind, res = run_module(component_check, _args(serving))
    assert kind == "exit" and res["ok"] and not res["changed"], res.get("msg")
    assert res["sent_requests"] == 8 and res["failed_requests"] == 0
    assert {c["name"]: c["ok"] for c in res["checks"]}["local reader serves"]


def test_failed_check_is_named(serving, run_module):
    kind, res = run_module(component_check, _args(serving, envs={"sparkhead": "DSV41_ENGRAM_REMOTE=tcp://h:1\n"}))
    assert kind == "fail" and not res["ok"]
    assert res["msg"] == (
        "remote_engram rollback check failed: configuration: sparkhead: "
        "DSV41_ENGRAM_REMOTE=tcp://h:1 (remote Engram overlay env still present)"
    )
