"""SIGTERM and SIGINT in the middle of a write: the previous file is intact, no temporary file is
left, and the command says so in one line (exit 143 for SIGTERM, 130 for SIGINT).

Python's default SIGTERM ends the process without unwinding, so a ``dsv41 engram make-tables``
killed by a playbook timeout left a 51 MB ``.model-00047-of-00048.safetensors.tmpN``; typer turned
Ctrl-C into a silent exit 130. ``dsv41.errors.run_app`` (every ``dsv41`` entry point) now unwinds
on SIGTERM (``sigterm_unwinds``) and names both. Real processes, since signals are the subject.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

# A one-command app run through run_app whose write blocks half way, after the temporary file exists.
SCRIPT = r'''
import sys, time, typer
from dsv41 import fileio
from dsv41.errors import run_app

app = typer.Typer()

@app.command()
def write(out: str) -> None:
    def fill(f):
        f.write(b"new, half written")
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
    fileio.atomic_write(out, fill, "the output")

@app.command()
def other() -> None:
    pass

sys.exit(run_app(app))
'''


@pytest.mark.parametrize("sig,rc,line", [(signal.SIGTERM, 143, "dsv41: error: terminated (SIGTERM)"),
                                         (signal.SIGINT, 130, "dsv41: error: interrupted")])
def test_a_signal_mid_write_keeps_the_old_file_and_leaves_no_temporary(sig, rc, line, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    out.write_text("old\n")
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, "write", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        assert p.stdout.readline() == b"writing\n"
        assert len(list(tmp_path.iterdir())) == 2  # the temporary file exists now
        p.send_signal(sig)
        _out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == rc, err
    assert err.decode().splitlines() == [line], err
    assert out.read_text() == "old\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["result.json"]


def test_a_handler_installed_by_a_command_is_left_alone() -> None:
    """``sigterm_unwinds`` only replaces the default handler and restores the default after."""
    from dsv41.errors import sigterm_unwinds

    prev = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with sigterm_unwinds():
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

        def mine(signum, frame):
            pass
        signal.signal(signal.SIGTERM, mine)
        with sigterm_unwinds():
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, prev)
