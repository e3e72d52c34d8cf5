"""Every value of every parameter of every ``dsv41`` command is checked before any command sees it
(issue 25 item 3): bytes that are not UTF-8, an empty value and an over-long one each give one line
``dsv41: error: <command> <option>: ...`` and exit 2, never a traceback.

The class is enumerated from the command tree the ``dsv41`` command itself builds
(``typer.main.get_command(dsv41.cli.app)``, walked by ``dsv41.errors.iter_parameters``), so a new
command or option is covered the day it is added. Runs in-process (what the console entry runs);
the issue's named examples also run as real processes with raw argv bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.main import get_command

from dsv41 import cli, errors
from dsv41.errors import MAX_PATH_BYTES, MAX_VALUE_BYTES, run_app

UNDECODABLE = os.fsdecode(b"\xff\xfe")  # what sys.argv holds for these bytes (PEP 383 surrogateescape)
LONG = "x" * 100_000


def _value_parameters() -> list[tuple[tuple[str, ...], object]]:
    """(command path, parameter) for every parameter that takes a value (not a bare flag)."""
    cmd = get_command(cli.app)
    out = []
    for path, p in errors.iter_parameters(cmd):
        if getattr(p, "is_flag", False) or getattr(p, "count", False):
            continue
        out.append((path, p))
    return out


PARAMS = _value_parameters()
COMMAND = get_command(cli.app)  # built once: run_app builds the same tree on every call


def _argv(path: tuple[str, ...], param, value: str) -> list[str]:
    """The command line giving ``value`` to ``param`` (positional arguments before it get a filler)."""
    if param.param_type_name == "argument":
        parent = get_command(cli.app)
        for name in path:
            parent = parent.commands[name]
        before = []
        for q in parent.params:
            if q is param or q.name == param.name:
                break
            if q.param_type_name == "argument":
                before.append("filler")
        return [*path, *before, value]
    opt = max((o for o in param.opts if o.startswith("--")), key=len, default=param.opts[0])
    return [*path, opt, value]


def test_the_tree_is_the_whole_command() -> None:
    """The enumeration sees every group and the options the issue named."""
    names = {(" ".join(path), errors.option_name(p)) for path, p in PARAMS}
    for want in [
        ("engine generate", "--prompt"),
        ("engine serve", "--host"),
        ("engine serve", "--master"),
        ("drafter serve", "--listen"),
        ("drafter serve", "--metrics"),
        ("engram verify", "--manifest"),
        ("window decide", "CELLS"),
        ("env check", "FILE"),
        ("engram layout", "CONFIG"),
    ]:
        assert want in names, want
    groups = {path[0] for path, _ in PARAMS if path}
    assert {g for g, _, _ in cli.GROUPS} <= groups, {g for g, _, _ in cli.GROUPS} - groups
    assert len(PARAMS) > 120


@pytest.mark.parametrize(
    "kind,value,text",
    [
        ("undecodable", UNDECODABLE, "not valid UTF-8"),
        ("empty", "", "empty value"),
        ("over-long", LONG, "longer than"),
    ],
)
def test_every_parameter_refuses_malformed_values(kind: str, value: str, text: str, capsys) -> None:
    failures = []
    for path, p in PARAMS:
        argv = _argv(path, p, value)
        try:
            rc = run_app(cli.app, argv, command=COMMAND)
        except SystemExit as exc:  # would be a defect: the contract returns, it does not exit
            rc = ("SystemExit", exc.code)
        out = capsys.readouterr()
        name = f"{' '.join(path)} {errors.option_name(p)}".strip()
        lines = out.err.splitlines()
        ok = (
            rc == 2
            and len(lines) == 1
            and lines[0].startswith(f"dsv41: error: {name}: ")
            and text in lines[0]
            and "Traceback" not in out.err + out.out
            and out.out == ""
        )
        if not ok:
            failures.append((argv[:-1], rc, out.err[-300:]))
    assert not failures, f"{len(failures)} of {len(PARAMS)} parameters: {failures[:5]}"


def test_limits_are_bytes_and_depend_on_the_kind(capsys) -> None:
    """A value at the limit passes the check (whatever the command then says); one byte more does not.
    Paths are bounded by PATH_MAX, other strings by 64 KiB; multi-byte UTF-8 counts in bytes."""
    errors.check_argument("é" * (MAX_VALUE_BYTES // 2), "--x", is_path=False)
    with pytest.raises(errors.ArgumentError, match="65538 bytes"):
        errors.check_argument("é" * (MAX_VALUE_BYTES // 2 + 1), "--x", is_path=False)
    errors.check_argument("/" + "a" * (MAX_PATH_BYTES - 1), "--p", is_path=True)
    with pytest.raises(errors.ArgumentError, match="longer than the 4095"):
        errors.check_argument("/" + "a" * MAX_PATH_BYTES, "--p", is_path=True)
    with pytest.raises(errors.ArgumentError, match="NUL"):
        errors.check_argument("a\x00b", "--x", is_path=False)
    errors.check_argument("line one\nline two", "--prompt", is_path=False)  # newlines are text, not an error
    # ...but an error naming such a value stays one line
    assert run_app(cli.app, ["engram", "verify", "--manifest", "/nonexistent\n/second line"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\\x0a" in err, err


def test_defaults_are_not_checked_and_explicit_values_are(capsys) -> None:
    """An option left out keeps its default, even an empty one (e.g. ``window decide --gate``)."""
    assert run_app(cli.app, ["window", "decide", "/nonexistent/cells.jsonl"]) == 1
    err = capsys.readouterr().err
    assert "cells file" in err and "--gate" not in err


@pytest.mark.parametrize(
    "argv",
    [
        [b"engine", b"generate", b"--prompt", b"\xff\xfe"],
        [b"engine", b"serve", b"--host", b"\xff\xfe"],
        [b"engine", b"serve", b"--master", b"\xc3\x28:1"],
        [b"drafter", b"serve", b"--listen", b"tcp://\xff:1"],
        [b"drafter", b"serve", b"--metrics", b"\xed\xa0\x80"],
        [b"window", b"decide", b"\xff.jsonl"],
    ],
)
def test_raw_argv_bytes_in_a_real_process(argv, tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "dsv41.cli", *argv], capture_output=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(b"dsv41: error: ") and b"not valid UTF-8" in lines[0], r.stderr
    assert argv[-2] in lines[0] or argv[1] in lines[0]
    assert b"Traceback" not in r.stderr and r.stdout == b""


FLOATS = [(path, p) for path, p in PARAMS if p.type_descriptor.annotation is float]


@pytest.mark.parametrize("value", ["nan", "-NaN", "inf", "-Infinity", "1e999"])
def test_every_float_parameter_refuses_non_finite_values(value: str, capsys) -> None:
    """NaN passes every ``<``/``>`` range check and an infinity every one-sided one
    (``window simulate --sigma inf`` printed a table of zeros and exited 0): every ``float``
    parameter of the tree refuses them before its command runs, one line, exit 2."""
    assert len(FLOATS) > 30, len(FLOATS)
    failures = []
    for path, p in FLOATS:
        argv = _argv(path, p, value)
        rc = run_app(cli.app, argv, command=COMMAND)
        out = capsys.readouterr()
        name = f"{' '.join(path)} {errors.option_name(p)}".strip()
        lines = out.err.splitlines()
        if not (
            rc == 2
            and len(lines) == 1
            and lines[0] == f"dsv41: error: {name}: {value!r} is not a finite number"
            and out.out == ""
        ):
            failures.append((argv, rc, out.err[-300:]))
    assert not failures, f"{len(failures)} of {len(FLOATS)} float parameters: {failures[:5]}"


def test_finite_floats_and_non_numbers_are_left_to_the_command(capsys) -> None:
    """Only non-finite numbers are refused here: ``1e308`` passes the guard, ``abc`` gets typer's
    own conversion error (exit 1, one line)."""
    errors.check_finite("1e308", "--x")
    errors.check_finite("abc", "--x")
    assert run_app(cli.app, ["status", "--window", "abc"], command=COMMAND) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--window" in err and "Traceback" not in err, err
