"""The ``dsv41`` command never prints a traceback, whatever its argument bytes (issue 10).

In-process (``dsv41.errors.run_app``, what the console entry runs) for speed, with bounded
examples; arguments are decoded from bytes the way Python decodes ``sys.argv`` (surrogateescape).
Each example ends with two junk words so that no example ever runs a command for real (a
command without positional arguments refuses them; one with a path gets a path that does not
exist).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv41.cli import _register, app
from dsv41.errors import run_app

COMMANDS = [
    [],
    ["engram"],
    ["engine"],
    ["drafter"],
    ["proxy"],
    ["refs"],
    ["version"],
    ["engram", "hash"],
    ["engram", "make-tables"],
    ["engram", "manifest"],
    ["engram", "verify"],
    ["engram", "read-rows"],
    ["engine", "init-weights"],
    ["engine", "identity"],
    ["engine", "generate"],
    ["engine", "serve"],
    ["drafter", "serve"],
    ["drafter", "identity"],
    ["drafter", "train"],
    ["proxy", "run"],
    ["proxy", "self-test"],
    ["refs", "record"],
    ["refs", "verify"],
    ["env"],
    ["env", "check"],
    ["drafter", "status"],
    ["metrics"],
    ["metrics", "get"],
    ["monitor"],
    ["monitor", "exporter"],
    ["monitor", "rules"],
    ["monitor", "dashboard"],
    ["monitor", "render"],
    ["nope"],
]
OPTIONS = [
    "--help",
    "--config",
    "--out",
    "--weights",
    "--manifest",
    "--data",
    "--rank",
    "--tp",
    "--port",
    "--max-tokens",
    "--device",
    "--json",
    "--seed",
    "--timeout-ms",
    "--endpoint",
    "--refs",
    "--remote",
    "--layer",
    "--rows",
    "--threads",
    "--quiet",
    "--force",
    "--shm",
    "--master",
    "--listen",
    "--overrides",
    "--ranks",
    "--prometheus",
    "--minutes",
    "-x",
    "--",
]

arg_bytes = st.binary(max_size=24).map(os.fsdecode)  # what sys.argv holds for arbitrary bytes
words = st.one_of(
    st.text(max_size=24),
    arg_bytes,
    st.sampled_from(OPTIONS),
    st.builds(lambda o, v: f"{o}={v}", st.sampled_from(OPTIONS), st.text(max_size=12) | arg_bytes),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["nan", "inf", "-1", "0", "1e999", "9" * 5000]),
)
junk = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="-"), min_size=1, max_size=8).map(
    lambda s: "zz" + s
)

_register()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cmd=st.sampled_from(COMMANDS), args=st.lists(words, max_size=6), tail=st.tuples(junk, junk))
def test_cli_never_prints_a_traceback(cmd, args, tail, capsys, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.getbasetemp())
    argv = [*cmd, *args, *tail]
    try:
        rc = run_app(app, argv)
    except SystemExit as exc:  # typer's --help path inside standalone_mode=False
        rc = exc.code or 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err, (argv, out.err[-2000:])
    assert isinstance(rc, int) and rc in (0, 1, 2), (argv, rc, out.err[-500:])
    if rc:
        assert out.err.strip(), argv  # a failure always says why


@pytest.mark.parametrize(
    "argv",
    [
        [b"engine", b"serve", b"--port", b"\xff\xfe", b"--manifest", b"\xed\xa0\x80"],
        [b"engram", b"hash", b"\xff" * 3],
        [b"\xc3\x28", b"--help"],
        [b"engine", b"generate", b"--max-tokens", b"9" * 5000, b"--prompt", b"x", b"--manifest", b"/nonexistent"],
    ],
)
def test_cli_subprocess_with_raw_argument_bytes(argv, tmp_path):
    """The real console entry with undecodable argument bytes: one clear line, exit 1 or 2."""
    r = subprocess.run([sys.executable, "-m", "dsv41.cli", *argv], capture_output=True, timeout=120, cwd=tmp_path)
    assert b"Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    assert r.returncode in (1, 2) and r.stderr.strip(), (r.returncode, r.stderr[-500:])
