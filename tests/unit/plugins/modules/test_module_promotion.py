"""plugins/modules/promotion_package.py and promotion_journal.py: gate, record (check mode,
idempotence, diff), read/verify/plan, tampered and unknown packages, journal append/decide."""

from __future__ import annotations

import base64
import json

from ansible_collections.dsv41.offload.plugins.modules import promotion_journal, promotion_package  # noqa: E402


def _hosts(text: str = "A=1\n") -> dict:
    return {
        "sparkhead": {
            "groups": ["spark"],
            "rank": 0,
            "dsv41": "0.1.0",
            "services": ["dsv41-serve"],
            "files": {"/etc/dsv41/a.env": {"content": base64.b64encode(text.encode()).decode(), "mode": "0644"}},
        }
    }


def _record(run_module, root, text="A=1\n", **extra):
    return run_module(
        promotion_package,
        {
            "action": "record",
            "root": str(root),
            "hosts": _hosts(text),
            "provenance": {"op": "deploy", "parent": None},
            **extra,
        },
    )


def test_record_check_mode_writes_nothing_then_records_idempotently(tmp_path, run_module):
    kind, res = _record(run_module, tmp_path, _ansible_check_mode=True, _ansible_diff=True)
    assert kind == "exit" and res["changed"] and not (tmp_path / res["id"]).exists()
    assert "/etc/dsv41/a.env" in res["diff"]["after"]
    kind, res2 = _record(run_module, tmp_path)
    assert kind == "exit" and res2["changed"] and res2["id"] == res["id"] and res2["verified"]["files"] == 1
    kind, res3 = _record(run_module, tmp_path)
    assert not res3["changed"] and res3["id"] == res["id"]


def test_read_verify_plan_and_tamper(tmp_path, run_module):
    rec = _record(run_module, tmp_path)[1]
    pid = rec["id"]
    kind, res = run_module(
        promotion_package,
        {
            "action": "plan",
            "root": str(tmp_path),
            "id": pid[:10],
            "hosts": {"sparkhead": {"/etc/dsv41/a.env": "0" * 64, "/etc/dsv41/x.env": "1" * 64}},
        },
    )
    assert kind == "exit" and res["id"] == pid
    assert res["plan"]["sparkhead"] == {"write": ["/etc/dsv41/a.env"], "remove": ["/etc/dsv41/x.env"], "same": 0}
    (tmp_path / pid / "files/sparkhead/etc/dsv41/a.env").write_text("A=2\n")
    kind, res = run_module(promotion_package, {"action": "read", "root": str(tmp_path), "id": pid})
    assert kind == "fail" and "tampered" in res["msg"] and "/etc/dsv41/a.env of sparkhead" in res["msg"]
    kind, res = run_module(promotion_package, {"action": "verify", "root": str(tmp_path), "id": "f" * 64})
    assert kind == "fail" and "unknown package" in res["msg"]


def test_gate(tmp_path, run_module):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "decision.json").write_text(json.dumps({"verdict": "LOSS"}))
    kind, res = run_module(
        promotion_package, {"action": "gate", "root": str(tmp_path), "windows_dir": str(tmp_path), "window": "w"}
    )
    assert kind == "fail" and "decided 'LOSS', not WIN" in res["msg"]
    kind, res = run_module(
        promotion_package,
        {
            "action": "gate",
            "root": str(tmp_path),
            "windows_dir": str(tmp_path),
            "window": "w",
            "force": True,
            "reason": "drill",
        },
    )
    assert kind == "exit" and res["gate"]["force"] and res["gate"]["verdict"] == "LOSS"


def test_journal_append_check_mode_and_decide(tmp_path, run_module):
    j = str(tmp_path / "journal.jsonl")
    kind, res = run_module(
        promotion_journal,
        {
            "action": "append",
            "path": j,
            "op": "o1",
            "step": "begin",
            "fields": {"kind": "promote", "prev": "a" * 64},
            "_ansible_check_mode": True,
        },
    )
    assert kind == "exit" and not (tmp_path / "journal.jsonl").exists()
    run_module(
        promotion_journal,
        {"action": "append", "path": j, "op": "o1", "step": "begin", "fields": {"kind": "promote", "prev": "a" * 64}},
    )
    kind, res = run_module(promotion_journal, {"action": "decide", "path": j})
    assert kind == "exit" and not res["changed"] and res["decision"]["action"] == "revert"
    kind, res = run_module(promotion_journal, {"action": "append", "path": j, "op": "o1", "step": "bogus"})
    assert kind == "fail" and "unknown journal step" in res["msg"]


def test_a_deploy_of_an_unchanged_production_keeps_its_package(tmp_path, run_module):
    """deploy.yml names the package production points at as the parent: the same files keep that
    package (whatever recorded it: a bring-up stage, a promotion), changed files make a new one."""
    staged = run_module(
        promotion_package,
        {
            "action": "record",
            "root": str(tmp_path),
            "hosts": _hosts(),
            "provenance": {"op": "deploy", "parent": None, "reason": "bring-up b1 stage async"},
        },
    )[1]
    pid = staged["id"]
    kind, same = _record(run_module, tmp_path, provenance={"op": "deploy", "parent": pid})
    assert kind == "exit" and not same["changed"] and same["id"] == pid
    kind, drifted = _record(run_module, tmp_path, text="A=2\n", provenance={"op": "deploy", "parent": pid})
    assert kind == "exit" and drifted["changed"] and drifted["id"] != pid
    assert drifted["package"]["provenance"]["parent"] == pid
