"""The ``dsv41`` command: every command group's module exists and is listed, and
``dsv41 env check FILE`` validates env files with one clear line and exit 1 on bad input."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41 import cli
from dsv41.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_every_group_module_exists_and_has_an_app() -> None:
    assert cli.GROUPS
    for name, module, help_text in cli.GROUPS:
        assert importlib.util.find_spec(module) is not None, f"dsv41 {name}: module {module} does not exist"
        assert hasattr(importlib.import_module(module), "app"), module
        assert help_text.strip()
    names = [g[0] for g in cli.GROUPS]
    assert len(names) == len(set(names))


def test_help_lists_every_group(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, _, _ in cli.GROUPS:
        assert f" {name} " in out, name
    assert main(["engine", "--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("init-weights", "identity", "generate", "serve"):
        assert cmd in out


def _one_error(capsys, argv: list[str], text: str) -> str:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert err.startswith("dsv41: error: ") and "\n" not in err and "Traceback" not in err, err
    assert text in err, err
    return err


GOOD = """# written by roles/engram_overlay
DSV41_ENGRAM_REMOTE=tcp://198.18.1.1:7441@198.18.1.2,tcp://198.18.2.1:7441@198.18.2.2
DSV41_ENGRAM_REMOTE_TIMEOUT_MS=250

DSV41_ENGRAM_REMOTE_REQUIRED=0
DSV41_RUNTIME_ROOT="/opt/dsv41/runtime"
UCX_TLS=tcp
"""


def test_env_check_accepts_a_good_file(tmp_path: Path, capsys) -> None:
    f = tmp_path / "engram.env"
    f.write_text(GOOD)
    assert main(["env", "check", str(f), "--tp", "2"]) == 0
    assert capsys.readouterr().out.strip() == f"{f}: ok (4 dsv41 variable(s), 1 other)"
    assert main(["env", "check", str(f), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] is True and got["other"] == ["UCX_TLS"]
    assert got["variables"] == {
        "DSV41_ENGRAM_REMOTE": GOOD.splitlines()[1].split("=", 1)[1],
        "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": 250,
        "DSV41_ENGRAM_REMOTE_REQUIRED": False,
        "DSV41_RUNTIME_ROOT": "/opt/dsv41/runtime",
    }
    empty = tmp_path / "empty.env"
    empty.write_text("# nothing\n\n")
    assert main(["env", "check", str(empty)]) == 0


@pytest.mark.parametrize(
    "text,argv,msg",
    [
        ("DSV41_DRAFTER_K=x\n", [], "DSV41_DRAFTER_K must be an integer"),
        ("DSV41_DRAFTER_K=3\nDSV41_DRAFTER_K=4\n", [], ":2: DSV41_DRAFTER_K is set twice"),
        ("just words\n", [], ":1: not KEY=VALUE"),
        ("=1\n", [], ":1: not KEY=VALUE"),
        ("DSV41_DRAFTR_K=3\n", [], "DSV41_DRAFTR_K is not a dsv41 variable"),
        ("VLLM_ENGRAM_REMOTE=tcp://h:1\n", [], "VLLM_ENGRAM_REMOTE was renamed: set DSV41_ENGRAM_REMOTE"),
        ("VLLM_ENGRAM_REMOTE_TIMEOUT_MS=5\n", [], "set DSV41_ENGRAM_REMOTE_TIMEOUT_MS"),
        ("VLLM_ENGRAM_REMOTE_REQUIRED=0\n", [], "set DSV41_ENGRAM_REMOTE_REQUIRED"),
        ("DSV41_ENGRAM_REMOTE_REQUIRED=1\n", [], "DSV41_ENGRAM_REMOTE is empty"),
        ("DSV41_ENGRAM_REMOTE=tcp://h:1\n", ["--tp", "2"], "names 1 URL(s) but tp is 2"),
        ("DSV41_ENGRAM_REMOTE=http://h:1,tcp://h:2\n", ["--tp", "2"], "DSV41_ENGRAM_REMOTE"),
        ("DSV41_DRAFTER_REMOTE=tcp://h:1\n", [], "needs DSV41_DRAFTER_DIR"),
    ],
)
def test_env_check_refuses_bad_files(tmp_path: Path, capsys, text: str, argv: list[str], msg: str) -> None:
    f = tmp_path / "bad.env"
    f.write_text(text)
    before = f.read_bytes()
    _one_error(capsys, ["env", "check", *argv, f], msg)
    assert f.read_bytes() == before  # a check never rewrites the file


def test_env_check_bad_paths(tmp_path: Path, capsys) -> None:
    _one_error(capsys, ["env", "check", tmp_path / "nope.env"], "does not exist")
    _one_error(capsys, ["env", "check", tmp_path], "is a directory")
    (tmp_path / "bin.env").write_bytes(b"\xff\xfe\x00junk")
    _one_error(capsys, ["env", "check", tmp_path / "bin.env"], "not UTF-8 text")
    _one_error(capsys, ["env", "check", "--tp", "0", tmp_path / "x"], "--tp")


def test_env_check_from_the_shell(tmp_path: Path) -> None:
    """As the role runs it: a process, exit 1 and one line on stderr."""
    f = tmp_path / "e.env"
    f.write_text("DSV41_DRAFTER_TIMEOUT_MS=0\n")
    p = subprocess.run(
        [sys.executable, "-m", "dsv41.cli", "env", "check", str(f)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        f"dsv41: error: env file {f}: DSV41_DRAFTER_TIMEOUT_MS must be a number in [1, 60000] ms, got '0'"
    ]
