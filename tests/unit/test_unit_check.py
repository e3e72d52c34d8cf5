"""``dsv41 env unit`` (dsv41.entrypoints.unit_check): a rendered systemd unit passes only when
``systemd-analyze verify`` reports nothing; every message kind it prints while exiting 0 (an
unknown key, a bad value, a missing executable) is a failure, in one line, and bad input to the
command itself (a name that is not a service unit, a missing or unreadable file) is one line too."""

from __future__ import annotations

import shutil

import pytest

from dsv41.cli import main
from dsv41.entrypoints.unit_check import verify_unit

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (Debian package systemd)"
)

GOOD = """[Unit]
Description=dsv41 test unit
After=network-online.target

[Service]
Type=simple
ExecStart=/bin/true
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
"""

BROKEN = {
    "unknown key": ("Restart=on-failure", "Restart=on-failure\nRestartt=always", "Unknown key"),
    "bad value": ("RestartSec=5", "RestartSec=five", "Failed to parse"),
    "bad section": ("[Install]", "[Instal]", "Instal"),
    "missing executable": ("ExecStart=/bin/true", "ExecStart=/opt/dsv41-nonexistent/bin/x", "not executable"),
}


def test_a_clean_unit_gives_no_message():
    assert verify_unit(GOOD, "dsv41-test.service") == []


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_every_message_kind_is_a_failure(kind, tmp_path, capsys):
    old, new, expect = BROKEN[kind]
    text = GOOD.replace(old, new)
    assert text != GOOD
    assert any(expect in m for m in verify_unit(text, "dsv41-test.service")), kind
    f = tmp_path / "source"
    f.write_text(text)
    assert main(["env", "unit", str(f), "--name", "dsv41-test.service"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dsv41-test.service" in err[0] and expect in err[0], err


def test_the_cli_passes_a_clean_unit(tmp_path, capsys):
    f = tmp_path / "source"
    f.write_text(GOOD)
    assert main(["env", "unit", str(f), "--name", "dsv41-test.service"]) == 0
    assert "ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--name", "dsv41-test"], "NAME.service"),
        (["--name", "../x.service"], "NAME.service"),
        (["--name", "a b.service"], "NAME.service"),
    ],
)
def test_bad_names_are_one_line(argv, expect, tmp_path, capsys):
    f = tmp_path / "source"
    f.write_text(GOOD)
    assert main(["env", "unit", str(f), *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


@pytest.mark.parametrize("what", ["missing", "directory", "binary"])
def test_bad_files_are_one_line(what, tmp_path, capsys):
    f = tmp_path / "unit"
    if what == "directory":
        f.mkdir()
    elif what == "binary":
        f.write_bytes(b"\xff\xfe\x00")
    assert main(["env", "unit", str(f), "--name", "dsv41-test.service"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0], err
