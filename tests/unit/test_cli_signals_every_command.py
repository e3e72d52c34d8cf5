"""Every ``dsv41`` command, signalled in its first instant, ends with one line and exit 130
(SIGINT) or 143 (SIGTERM): no ``KeyboardInterrupt`` traceback with rc -2, no silent rc -15.

The commands and groups are enumerated from the typer app (``dsv41.cli.app`` and its ``GROUPS``).
Each child process is a real ``dsv41`` run that sends itself the signal at a fixed moment, so
the moment is deterministic, not a race with the interpreter's speed on a loaded machine:

* ``import``: while the command's group module is being imported (``dsv41.cli`` imports every
  group before any command runs; a meta-path hook signals when the group's module is looked up);
* ``parse``: while the command parses its arguments (inside ``run_app``, before its own code).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsv41 import cli
from dsv41.errors import _walk

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, signal, sys, time
moment, sig, target = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3]
path = sys.argv[4:]

def fire():
    os.kill(os.getpid(), sig)
    time.sleep(30)  # the signal's handler raises before this ends
    raise SystemExit(99)

if moment == "import":
    class Hook:
        def find_spec(self, name, p=None, t=None):
            if name == target:
                fire()
            return None
    sys.meta_path.insert(0, Hook())
    from dsv41 import cli
else:
    from dsv41 import cli
    from typer.main import get_command
    from dsv41.errors import run_app
    tree = get_command(cli.app)
    cmd = tree
    for name in path:
        cmd = cmd.commands[name]
    cmd.parse_args = lambda ctx, args: fire()
    sys.argv = ["dsv41", *path]
    rc = run_app(cli.app, None, command=tree)
    cli.quiet_after_exit()
    sys.exit(rc)
"""

LINES = {signal.SIGINT: ("dsv41: error: interrupted", 130), signal.SIGTERM: ("dsv41: error: terminated (SIGTERM)", 143)}


def _commands() -> list[tuple[str, ...]]:
    from typer.main import get_command

    return [p for p, c in _walk(get_command(cli.app), ()) if p and not getattr(c, "commands", None)]


def _default_signals() -> None:
    for s in LINES:
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(LINES))


def _run(moment: str, sig: signal.Signals, target: str, path: tuple[str, ...]) -> tuple[str, int, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-c", CHILD, moment, sig.name, target, *path],
        capture_output=True,
        timeout=60,
        env=env,
        preexec_fn=_default_signals,
    )
    return " ".join(path) or target, p.returncode, p.stderr.decode(errors="replace")


def _check(runs, sig) -> None:
    line, rc = LINES[sig]
    bad = [f"{what}: rc {code}, stderr {err!r}" for what, code, err in runs if code != rc or err.splitlines() != [line]]
    assert not bad, "\n".join(bad)


def test_the_commands_are_enumerated() -> None:
    cmds = _commands()
    assert len(cmds) >= len(cli.GROUPS) and ("version",) in cmds and ("engine", "serve") in cmds


@pytest.mark.parametrize("sig", list(LINES), ids=lambda s: s.name)
def test_a_signal_while_a_group_is_imported(sig) -> None:
    with ThreadPoolExecutor(4) as ex:
        runs = list(ex.map(lambda g: _run("import", sig, g[1], ()), cli.GROUPS))
    _check(runs, sig)


@pytest.mark.parametrize("sig", list(LINES), ids=lambda s: s.name)
def test_a_signal_while_every_command_parses_its_arguments(sig) -> None:
    with ThreadPoolExecutor(4) as ex:
        runs = list(ex.map(lambda path: _run("parse", sig, "-", path), _commands()))
    _check(runs, sig)
