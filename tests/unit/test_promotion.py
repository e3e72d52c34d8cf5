"""Promotion packages (dsv41.promotion.package), the journal (dsv41.promotion.journal) and
``dsv41 package``: id stability, schema errors, tamper detection, diff, replay decisions."""

from __future__ import annotations

import json
import tarfile

import pytest

from dsv41.cli import main
from dsv41.errors import VerificationError
from dsv41.promotion import journal, package as pkg
from promotionpkgutil import PROV, _hosts  # noqa: E402


@pytest.fixture
def stored(tmp_path):
    doc, blobs = pkg.build(_hosts(), PROV, b'{"refs": []}\n')
    pid, created = pkg.write(tmp_path, doc, blobs)
    assert created
    return tmp_path, pid, doc


def test_id_is_stable_and_content_addressed(tmp_path):
    d1, _ = pkg.build(_hosts(), PROV, b"r")
    # dict insertion order of the input does not matter
    h = _hosts()
    d2, _ = pkg.build(dict(reversed(list(h.items()))), PROV, b"r")
    assert pkg.package_id(d1) == pkg.package_id(d2)
    d3, _ = pkg.build(_hosts(b"DSV41_DRAFTER_ASYNC=1\n"), PROV, b"r")
    assert pkg.package_id(d3) != pkg.package_id(d1)
    d4, _ = pkg.build(_hosts(), {**PROV, "reason": "forced"}, b"r")
    assert pkg.package_id(d4) != pkg.package_id(d1)


def test_write_is_immutable_and_idempotent(stored):
    root, pid, doc = stored
    assert (root / pid / "package.json").is_file()
    assert json.loads((root / pid / "package.json").read_text()) == doc
    before = (root / f"{pid}.tar.gz").read_bytes()
    again, created = pkg.write(root, *pkg.build(_hosts(), PROV, b'{"refs": []}\n'))
    assert (again, created) == (pid, False)
    assert (root / f"{pid}.tar.gz").read_bytes() == before
    with tarfile.open(root / f"{pid}.tar.gz") as tar:
        names = tar.getnames()
    assert f"{pid}/files/sparkhead/etc/dsv41/serve.env" in names and f"{pid}/package.json" in names


def test_window_snapshot_of_an_undrifted_production_is_its_package(stored):
    root, pid, _ = stored
    refs = b'{"refs": []}\n'
    same, _ = pkg.build(_hosts(), {"op": "window", "parent": pid, "window": "w1"}, refs)
    assert pkg.package_id(same) != pid  # provenance differs, the production does not
    assert pkg.same_production(root, same) == pid
    for drifted in (
        pkg.build(_hosts(b"DSV41_DRAFTER_ASYNC=1\n"), {"op": "window", "parent": pid}, refs)[0],
        pkg.build(_hosts(), {"op": "window", "parent": pid}, b"other refs")[0],
    ):
        assert pkg.same_production(root, drifted) is None
    assert pkg.same_production(root, pkg.build(_hosts(), {"op": "window", "parent": None}, refs)[0]) is None
    with pytest.raises(pkg.PackageError, match="unknown package"):
        pkg.same_production(root, pkg.build(_hosts(), {"op": "window", "parent": "ab" * 32}, refs)[0])


def test_tarball_is_reproducible(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    pa, _ = pkg.write(a, *pkg.build(_hosts(), PROV, None))
    pb, _ = pkg.write(b, *pkg.build(_hosts(), PROV, None))
    assert pa == pb and (a / f"{pa}.tar.gz").read_bytes() == (b / f"{pb}.tar.gz").read_bytes()


def test_verify_ok(stored):
    root, pid, _ = stored
    r = pkg.verify(root, pid)
    assert r["files"] == 4 and r["hosts"] == {"sparkhead": 2, "x86host": 1}


@pytest.mark.parametrize(
    "tamper, needle",
    [
        (
            lambda d: (d / "files/sparkhead/etc/dsv41/serve.env").write_bytes(b"DSV41_DRAFTER_ASYNC=1\n"),
            "/etc/dsv41/serve.env of sparkhead has sha256",
        ),
        (lambda d: (d / "files/x86host/etc/dsv41/engram-server.env").unlink(), "is missing"),
        (lambda d: (d / "files/x86host/etc/dsv41/extra.env").write_bytes(b"x"), "unrecorded file"),
        (lambda d: (d / "refs/greedy_refs.json").write_bytes(b"{}"), "greedy references"),
        (
            lambda d: (d / "package.json").write_text((d / "package.json").read_text().replace('"0600"', '"0644"')),
            "package.json hashes to",
        ),
    ],
)
def test_tamper_is_detected(stored, tamper, needle):
    root, pid, _ = stored
    tamper(root / pid)
    with pytest.raises(VerificationError, match="tampered") as ei:
        pkg.verify(root, pid)
    assert needle in str(ei.value)
    # a stored copy that fails verification is never silently overwritten
    with pytest.raises(VerificationError):
        pkg.write(root, *pkg.build(_hosts(), PROV, b'{"refs": []}\n'))


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda d: d.update(format=2), "format"),
        (lambda d: d["provenance"].update(op="bogus"), "provenance/op"),
        (lambda d: d["hosts"]["sparkhead"]["files"]["/etc/dsv41/serve.env"].update(sha256="xyz"), "sha256"),
        (
            lambda d: d["hosts"]["sparkhead"]["files"].update(
                {"relative/path": {"sha256": "0" * 64, "size": 0, "mode": "0644"}}
            ),
            "files",
        ),
        (lambda d: d.update(extra=1), "(top)"),
    ],
)
def test_schema_errors_name_the_place(mutate, where):
    doc, _ = pkg.build(_hosts(), PROV, None)
    mutate(doc)
    with pytest.raises(pkg.PackageError, match="fails its schema") as ei:
        pkg.validate(doc)
    assert where in str(ei.value)


def test_paths_must_be_absolute_and_plain():
    h = _hosts()
    h["x86host"]["files"]["/etc/dsv41/../passwd"] = {"content": b"", "mode": "0644"}
    with pytest.raises(pkg.PackageError, match="absolute and plain"):
        pkg.build(h, PROV, None)


def test_unknown_and_malformed_ids(stored):
    root, pid, _ = stored
    with pytest.raises(pkg.PackageError, match="unknown package"):
        pkg.load(root, "f" * 64)
    with pytest.raises(pkg.PackageError, match="not a package id"):
        pkg.load(root, "../etc")
    assert pkg.resolve(root, pid[:10]) == pid
    with pytest.raises(pkg.PackageError, match="matches 0 packages"):
        pkg.resolve(root, "0" * 12 if not pid.startswith("0" * 12) else "1" * 12)


def test_diff_names_hosts_files_and_facts():
    a, _ = pkg.build(_hosts(), PROV, b"r")
    h = _hosts(b"DSV41_DRAFTER_ASYNC=1\n")
    h["sparkhead"]["files"]["/opt/dsv41/overlay/drafter.env"] = {"content": b"A=1\n", "mode": "0644"}
    del h["sparkhead"]["files"]["/opt/dsv41/model/config.json"]
    h["sparkhead"]["kv_budget"] = 32768
    b, _ = pkg.build(h, {"op": "promote", "parent": pkg.package_id(a), "candidate": "async-drafter"}, b"r")
    d = pkg.diff(a, b)
    assert list(d["hosts"]) == ["sparkhead"]
    s = d["hosts"]["sparkhead"]
    assert s["changed"] == ["/etc/dsv41/serve.env"]
    assert s["added"] == ["/opt/dsv41/overlay/drafter.env"]
    assert s["removed"] == ["/opt/dsv41/model/config.json"]
    assert s["facts"] == {"kv_budget": [65536, 32768]}
    assert d["provenance"]["op"] == ["deploy", "promote"]
    assert pkg.diff(a, a) == {"hosts": {}, "provenance": {}, "greedy_refs": None}


def test_installed_diff():
    doc, _ = pkg.build(_hosts(), PROV, None)
    f = doc["hosts"]["sparkhead"]["files"]
    installed = {
        "/etc/dsv41/serve.env": "0" * 64,
        "/opt/dsv41/model/config.json": f["/opt/dsv41/model/config.json"]["sha256"],
        "/etc/dsv41/stray.env": "1" * 64,
    }
    assert pkg.installed_diff(doc, "sparkhead", installed) == {
        "write": ["/etc/dsv41/serve.env"],
        "remove": ["/etc/dsv41/stray.env"],
        "same": 1,
    }


def test_window_gate(tmp_path):
    (tmp_path / "w1").mkdir()
    (tmp_path / "w1" / "decision.json").write_text(json.dumps({"verdict": "WIN"}))
    (tmp_path / "w2").mkdir()
    (tmp_path / "w2" / "decision.json").write_text(json.dumps({"verdict": "NO-CHANGE"}))
    assert pkg.check_window(tmp_path, "w1", False, None)["verdict"] == "WIN"
    with pytest.raises(pkg.PackageError, match="decided 'NO-CHANGE', not WIN"):
        pkg.check_window(tmp_path, "w2", False, None)
    with pytest.raises(pkg.PackageError, match="no decision"):
        pkg.check_window(tmp_path, "w9", False, None)
    with pytest.raises(pkg.PackageError, match="needs reason"):
        pkg.check_window(tmp_path, "w2", True, "  ")
    with pytest.raises(pkg.PackageError, match="plain name"):
        pkg.check_window(tmp_path, "../w1", False, None)
    with pytest.raises(pkg.PackageError, match="needs window=ID"):
        pkg.check_window(tmp_path, None, False, None)
    g = pkg.check_window(tmp_path, "w2", True, "lab drill")
    assert g == {"window": "w2", "verdict": "NO-CHANGE", "force": True, "reason": "lab drill"}


def test_window_gate_reads_what_dsv41_window_run_writes(tmp_path):
    # harness/window.py write_report: {"decision": {"verdict": ...}, "candidate": NAME, ...}
    (tmp_path / "w3").mkdir()
    (tmp_path / "w3" / "decision.json").write_text(
        json.dumps(
            {
                "decision": {"verdict": "WIN", "metric": "step_ms_p50"},
                "candidate": "async-drafter",
                "control": "production",
            }
        )
    )
    g = pkg.check_window(tmp_path, "w3", False, None, "async-drafter")
    assert g == {"window": "w3", "verdict": "WIN", "force": False, "reason": None}
    with pytest.raises(pkg.PackageError, match="window w3 measured candidate 'async-drafter', not 'sync-drafter'"):
        pkg.check_window(tmp_path, "w3", False, None, "sync-drafter")
    (tmp_path / "w4").mkdir()
    (tmp_path / "w4" / "decision.json").write_text(json.dumps({"decision": {"verdict": "LOSS"}, "candidate": "x"}))
    with pytest.raises(pkg.PackageError, match="decided 'LOSS', not WIN"):
        pkg.check_window(tmp_path, "w4", False, None, "x")
    assert pkg.window_verdict({"decision": "WIN"}) is None and pkg.window_verdict([]) is None


# ---- journal ---------------------------------------------------------------------------------

P0, P1, P2 = "a" * 64, "b" * 64, "c" * 64


def _run(path, op, steps):
    for step, fields in steps:
        journal.append(path, op, step, **fields)


def test_journal_append_read_and_torn_line(tmp_path):
    j = tmp_path / "j" / "journal.jsonl"
    _run(j, "op1", [("begin", {"kind": "promote", "prev": P0}), ("held", {})])
    with open(j, "ab") as fh:  # a kill inside a write leaves a torn line
        fh.write(b'{"op":"op1","st')
    assert [e["step"] for e in journal.read(j)] == ["begin", "held"]
    with pytest.raises(journal.JournalError, match="unknown journal step"):
        journal.append(j, "op1", "nope")


@pytest.mark.parametrize(
    "steps, want",
    [
        ([], ("none", None)),
        ([("begin", {"kind": "promote", "prev": P0}), ("held", {})], ("revert", P0)),
        ([("begin", {"kind": "promote", "prev": P0}), ("held", {}), ("applied", {"host": "x86host"})], ("revert", P0)),
        ([("begin", {"kind": "promote", "prev": P0}), ("recorded", {"package": P1})], ("revert", P0)),
        (
            [("begin", {"kind": "promote", "prev": P0}), ("recorded", {"package": P1}), ("verified", {"package": P1})],
            ("finish", P1),
        ),
        (
            [("begin", {"kind": "promote", "prev": P0}), ("verified", {"package": P1}), ("pointer", {"package": P1})],
            ("finish", P1),
        ),
        (
            [("begin", {"kind": "promote", "prev": P0}), ("failed", {"why": "refs"}), ("rolled_back", {"package": P0})],
            ("revert", P0),
        ),
        ([("begin", {"kind": "promote", "prev": P0}), ("verified", {"package": P1}), ("done", {})], ("none", None)),
        ([("begin", {"kind": "rollback", "prev": P1, "target": P0}), ("held", {})], ("finish", P0)),
        ([("begin", {"kind": "deploy", "prev": None})], ("none", None)),
        # a window journals its package as prev and target: every kill point restores production to it
        ([("begin", {"kind": "window", "prev": P0, "target": P0})], ("finish", P0)),
        ([("begin", {"kind": "window", "prev": P0, "target": P0}), ("held", {})], ("finish", P0)),
        (
            [("begin", {"kind": "window", "prev": P0, "target": P0}), ("held", {}), ("applied", {"package": P0})],
            ("finish", P0),
        ),
        (
            [
                ("begin", {"kind": "window", "prev": P0, "target": P0}),
                ("held", {}),
                ("applied", {"package": P0}),
                ("verified", {"package": P0}),
            ],
            ("finish", P0),
        ),
        (
            [("begin", {"kind": "window", "prev": P0, "target": P0}), ("verified", {"package": P0}), ("done", {})],
            ("none", None),
        ),
    ],
)
def test_journal_replay_decision(tmp_path, steps, want):
    j = tmp_path / "journal.jsonl"
    _run(j, "old", [("begin", {"kind": "promote", "prev": P2}), ("done", {})])
    _run(j, "op2", steps)
    d = journal.decide(journal.read(j))
    assert (d.action, d.package) == want


# ---- CLI ------------------------------------------------------------------------------------


def test_cli_show_diff_verify(stored, capsys):
    root, pid, _ = stored
    assert main(["package", "verify", pid[:12], "--root", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 4
    assert main(["package", "show", pid, "--root", str(root)]) == 0
    assert "/etc/dsv41/serve.env" in capsys.readouterr().out
    doc, blobs = pkg.build(_hosts(b"DSV41_DRAFTER_ASYNC=1\n"), {"op": "promote", "parent": pid, "candidate": "x"}, None)
    pid2, _ = pkg.write(root, doc, blobs)
    assert main(["package", "diff", pid, pid2, "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "~ /etc/dsv41/serve.env" in out and "sparkhead:" in out and "x86host:" not in out
    assert main(["package", "list", "--root", str(root)]) == 0
    assert pid2 in capsys.readouterr().out


def test_cli_journal_decision(tmp_path, capsys):
    j = tmp_path / "journal.jsonl"
    _run(j, "op1", [("begin", {"kind": "promote", "prev": P0}), ("held", {})])
    assert main(["package", "journal", "--path", str(j), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "action": "revert",
        "package": P0,
        "op": "op1",
        "kind": "promote",
        "last_step": "held",
        "result_package": None,
        "windows_dir": None,
    }


def test_journal_window_names_its_windows_dir(tmp_path):
    j = tmp_path / "journal.jsonl"
    _run(j, "w1", [("begin", {"kind": "window", "prev": P0, "target": P0, "windows_dir": "/tmp/w"}), ("held", {})])
    d = journal.decide(journal.read(j))
    assert (d.action, d.package, d.kind, d.windows_dir) == ("finish", P0, "window", "/tmp/w")
    assert d.as_dict()["windows_dir"] == "/tmp/w"


def test_journal_last_finished_operation_names_its_package(tmp_path):
    j = tmp_path / "journal.jsonl"
    _run(
        j,
        "r1",
        [
            ("begin", {"kind": "rollback", "prev": P1, "target": P0}),
            ("verified", {"package": P0}),
            ("done", {"result": "rolled_back", "package": P0}),
        ],
    )
    d = journal.decide(journal.read(j))
    assert (d.action, d.kind, d.result_package) == ("none", "rollback", P0)


def test_cli_tampered_and_unknown_are_one_line(stored, capsys):
    root, pid, _ = stored
    (root / pid / "files/sparkhead/etc/dsv41/serve.env").write_bytes(b"evil\n")
    assert main(["package", "verify", pid, "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tampered" in err and "Traceback" not in err
    assert main(["package", "show", "0123456789abcdef", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matches 0 packages" in err


def test_kv_budget_read_from_the_service_definition():
    h = _hosts()
    h["sparkhead"]["kv_budget"] = None
    h["sparkhead"]["files"]["/etc/systemd/system/dsv41-serve.service"] = {
        "content": b"ExecStart=/opt/dsv41/venv/bin/dsv41 engine serve --threads 1 --kv-cache-tokens 32768\n",
        "mode": "0644",
    }
    doc, _ = pkg.build(h, PROV, None)
    assert doc["hosts"]["sparkhead"]["kv_budget"] == 32768
    assert doc["hosts"]["x86host"]["kv_budget"] is None
