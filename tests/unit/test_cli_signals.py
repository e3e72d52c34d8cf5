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
import time
from pathlib import Path

import pytest

# A one-command app run through run_app whose write blocks half way, after the temporary file exists.
SCRIPT = r"""
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
"""


STOPPERS = (signal.SIGINT, signal.SIGTERM)


def _default_signals() -> None:
    """``preexec_fn``: the child starts with SIGINT and SIGTERM at their default dispositions and
    unblocked, whatever the runner's are. A runner that ignores SIGINT (a CI job started in the
    background of a script, where POSIX shells ignore SIGINT) passes the ignore on through
    ``exec`` (``restore_signals`` restores only SIGPIPE, SIGXFZ and SIGXFSZ); the child's Python
    then keeps it and Ctrl-C never reaches the command: the SIGINT case hung for 30 s."""
    for sig in STOPPERS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOPPERS))


def _ignore_sigint() -> None:
    """``preexec_fn``: as a script's background job starts (SIGINT ignored, SIGTERM default)."""
    _default_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _names(mask_hex: str) -> str:
    """The signals of a /proc status mask (bit n-1 is signal n), e.g. ``SIGINT,SIGQUIT``."""
    bits = int(mask_hex, 16)
    return (
        ",".join(
            signal.Signals(n).name if n in signal.Signals._value2member_map_ else str(n)
            for n in range(1, 65)
            if bits >> (n - 1) & 1
        )
        or "-"
    )


def _hang_report(p: subprocess.Popen, sig: signal.Signals) -> str:
    """Why a child did not end after ``sig``: its signal masks (/proc/<pid>/status), every thread's
    stack (SIGUSR1: dsv41.errors.stacks_on_sigusr1) and its stderr. Ends the child."""
    try:
        status = Path(f"/proc/{p.pid}/status").read_text().splitlines()
        masks = [
            f"{k}: {v.strip()} ({_names(v.strip())})"
            for k, _, v in (ln.partition(":") for ln in status)
            if k in ("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")
        ]
    except OSError as exc:
        masks = [f"no /proc status: {exc}"]
    p.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    p.kill()
    _out, err = p.communicate(timeout=30)
    return (
        f"the child (pid {p.pid}) did not end within 30 s of {sig.name}; its signal masks:\n  "
        + "\n  ".join(masks)
        + "\nits stderr (thread stacks after SIGUSR1):\n"
        + err.decode(errors="replace")
    )


def _start_writing(out: Path, cwd: Path, preexec=_default_signals) -> subprocess.Popen:
    """The write command of SCRIPT on ``out``, once its temporary file exists."""
    p = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "write", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        preexec_fn=preexec,
    )
    assert p.stdout.readline() == b"writing\n"
    return p


def _wait(p: subprocess.Popen, sig: signal.Signals) -> bytes:
    """``p``'s stderr once it ended after ``sig``; a test failure with :func:`_hang_report` if it hangs."""
    try:
        return p.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        pytest.fail(_hang_report(p, sig), pytrace=False)


@pytest.mark.parametrize(
    "sig,rc,line",
    [(signal.SIGTERM, 143, "dsv41: error: terminated (SIGTERM)"), (signal.SIGINT, 130, "dsv41: error: interrupted")],
)
def test_a_signal_mid_write_keeps_the_old_file_and_leaves_no_temporary(sig, rc, line, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    out.write_text("old\n")
    p = _start_writing(out, tmp_path)
    try:
        assert len(list(tmp_path.iterdir())) == 2  # the temporary file exists now
        p.send_signal(sig)
        err = _wait(p, sig)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == rc, err
    assert err.decode().splitlines() == [line], err
    assert out.read_text() == "old\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["result.json"]


def test_an_inherited_ignored_sigint_is_kept_and_sigterm_still_stops(tmp_path: Path) -> None:
    """The choice documented in dsv41.errors.run_app: a command started with SIGINT ignored (a
    script's background job) keeps ignoring it; SIGTERM still unwinds it."""
    out = tmp_path / "result.json"
    out.write_text("old\n")
    p = _start_writing(out, tmp_path, _ignore_sigint)
    try:
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert p.poll() is None, "SIGINT ended a command started with SIGINT ignored"
        p.send_signal(signal.SIGTERM)
        err = _wait(p, signal.SIGTERM)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143 and err.decode().splitlines() == ["dsv41: error: terminated (SIGTERM)"], err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["result.json"] and out.read_text() == "old\n"


def test_sigusr1_prints_every_threads_stack_and_the_command_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    p = _start_writing(out, tmp_path)
    try:
        p.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert p.poll() is None, "SIGUSR1 ended the command"
        p.send_signal(signal.SIGTERM)
        err = _wait(p, signal.SIGTERM).decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert "most recent call first" in err and "in fill" in err, err
    assert err.splitlines()[-1] == "dsv41: error: terminated (SIGTERM)" and p.returncode == 143, err


def test_the_hang_report_names_the_masks_and_the_stacks(tmp_path: Path) -> None:
    """The failure message of a hung child (what the SIGINT case printed when it hung): a child
    that ignores SIGINT, reported after a SIGINT."""
    p = _start_writing(tmp_path / "r.json", tmp_path, _ignore_sigint)
    try:
        p.send_signal(signal.SIGINT)
        report = _hang_report(p, signal.SIGINT)
    finally:
        if p.poll() is None:
            p.kill()
    assert "SIGINT" in report.split("SigIgn:")[1].splitlines()[0], report
    assert "did not end within 30 s of SIGINT" in report and "most recent call first" in report, report


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
