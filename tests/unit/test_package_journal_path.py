"""``dsv41 package journal --path FILE`` on a regular file that is not a promotion journal says so
in one line and exits 1 (it said "nothing interrupted", rc 0); a real journal, an empty one and a
missing one still read as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv41.cli import main

NOT_JOURNALS = {
    "text": b"hello\nworld\n",
    "json-object-without-op": b'{"a": 1}\n',
    "json-array": b"[1, 2, 3]\n",
    "binary": bytes(range(256)),
    "yaml": b"op: x\nstep: begin\n",
    "one-torn-line": b'{"op": "x", "st',
}


@pytest.mark.parametrize("name", sorted(NOT_JOURNALS))
def test_a_file_that_is_not_a_journal_is_one_error_line(name, tmp_path: Path, capsys) -> None:
    f = tmp_path / name
    f.write_bytes(NOT_JOURNALS[name])
    assert main(["package", "journal", "--path", str(f)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"dsv41: error: {f} is not a promotion journal: no line of it is a "
        "journal entry (a JSON object with op and step)"
    ]


def test_a_journal_an_empty_file_and_a_missing_one_still_read(tmp_path: Path, capsys) -> None:
    j = tmp_path / "journal.jsonl"
    j.write_text(
        json.dumps({"op": "p1", "step": "begin", "kind": "promote", "package": "a", "ts": 1.0})
        + "\n"
        + '{"op": "p1", "st'
    )  # a torn last line, as a kill inside a write leaves
    assert main(["package", "journal", "--path", str(j), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["op"] == "p1"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for p in (empty, tmp_path / "missing.jsonl"):
        assert main(["package", "journal", "--path", str(p)]) == 0
        assert "nothing interrupted" in capsys.readouterr().out
