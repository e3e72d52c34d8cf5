"""plugins/modules/qualify_report.py: assembles the registered results into report.json + summary.md
(dsv41.entrypoints.qualify) and fails naming each failed check; also in check mode."""

from __future__ import annotations

import json

from ansible_collections.dsv41.offload.plugins.modules import qualify_report  # noqa: E402


def _version():
    return {"rc": 0, "stdout": json.dumps({"dsv41": "0.1.0"})}


def _links(ok):
    return {
        "checks": [
            {
                "check": "mtu",
                "ok": ok,
                "value": 9000 if ok else 1500,
                "expected": 9000,
                "link": "ofl0",
                "reason": "" if ok else "ofl0: MTU 1500, expected 9000",
                "rdma_source": "sysfs",
            }
        ]
    }


def _hosts(ok=True):
    return {
        "sparkhead": {
            "version": _version(),
            "done": True,
            "steps": [
                {"name": "rdma_link", "group": "links", "kind": "rdma_link", "result": _links(ok), "checks": ["mtu"]}
            ],
        }
    }


def test_pass_writes_report_and_summary(tmp_path, run_module):
    kind, res = run_module(
        qualify_report,
        {
            "hosts": _hosts(),
            "out_dir": str(tmp_path / "q"),
            "meta": {"id": "q"},
            "controller": [
                {
                    "name": "vllm-tiny",
                    "group": "serving",
                    "kind": "command",
                    "result": {"skipped": True},
                    "checks": ["vllm_tiny"],
                    "skip_reason": "no CUDA host",
                }
            ],
        },
    )
    assert kind == "exit" and res["result"] == "PASS" and res["counts"] == {"pass": 1, "fail": 0, "skipped": 1}
    doc = json.loads((tmp_path / "q" / "report.json").read_text())
    assert [c["status"] for c in doc["checks"]] == ["pass", "skipped"] and doc["checks"][1]["reason"] == "no CUDA host"
    assert res["lines"][0] == "# Qualification q: PASS" and (tmp_path / "q" / "summary.md").exists()


def test_fail_names_each_failed_check_and_still_writes_the_report(tmp_path, run_module):
    hosts = _hosts(ok=False)
    hosts["x86host"] = {"version": {"unreachable": True, "msg": "holder gone"}}
    kind, res = run_module(qualify_report, {"hosts": hosts, "out_dir": str(tmp_path / "q")})
    assert kind == "fail"
    assert res["msg"].startswith("qualification FAIL: links.mtu[ofl0]@sparkhead, links.reachable@x86host (summary: ")
    assert json.loads((tmp_path / "q" / "report.json").read_text())["result"] == "FAIL"


def test_unwritable_report_dir_is_one_line(tmp_path, run_module):
    f = tmp_path / "file"
    f.write_text("x")
    kind, res = run_module(qualify_report, {"hosts": _hosts(), "out_dir": str(f / "q")})
    assert kind == "fail" and res["msg"].startswith(f"report directory {f}/q cannot be written")


def test_check_mode_writes_the_report_too(tmp_path, run_module):
    kind, res = run_module(
        qualify_report, {"hosts": _hosts(), "out_dir": str(tmp_path / "q"), "_ansible_check_mode": True}
    )
    assert kind == "exit" and (tmp_path / "q" / "report.json").exists()
