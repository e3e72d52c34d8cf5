"""The one ``dsv41`` command; each subpackage contributes a sub-command group.

Contract (docs/architecture.md): every command has ``--help``, exits 0 on success and exits 1
with one clear line on bad input or a failed check (never a traceback).  Sub-command groups
live next to the code they drive (``dsv41/<subpackage>/cli.py`` exposing ``app``) and import
heavy dependencies (torch, NIXL) inside the commands, so ``dsv41 --help`` stays fast.
"""

from __future__ import annotations

import importlib
import sys

import typer

from dsv41.errors import run_app

app = typer.Typer(
    name="dsv41",
    help="dsv41-offload: Engram tables, transport, engine, drafter and measurement tools.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# (group name, module path, help). A group whose module is absent is skipped, so a host that
# installs only part of the stack still gets a working command.
_GROUPS = [
    ("engram", "dsv41.engram.cli", "Engram layout, hashing, tables, manifest, rows, server."),
    ("engine", "dsv41.engine.cli", "The local stand-in serving engine (TP over torch.distributed)."),
    ("drafter", "dsv41.drafter.cli", "Remote drafter worker and tools."),
    ("proxy", "dsv41.drafter.proxy_cli", "The async drafting proxy (torch-free)."),
    ("bench", "dsv41.harness.bench_cli", "Benchmark client: TTFT, step_ms, tok/s, acceptance."),
    ("window", "dsv41.harness.window_cli", "Fenced windows and the WIN2 decision rule."),
    ("refs", "dsv41.harness.refs_cli", "Greedy reference prompts: record and verify."),
    ("status", "dsv41.harness.status_cli", "Is production healthy, and what is it running? (exit 1 with reasons)"),
]


def _register() -> None:
    for name, module, help_text in _GROUPS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue  # that part of the stack is not built yet / not installed here
            raise
        app.add_typer(mod.app, name=name, help=help_text)


@app.callback()
def _root() -> None:
    """dsv41-offload command line."""


@app.command()
def version() -> None:
    """Print the dsv41 package version."""
    from dsv41 import __version__

    print(__version__)


_register()


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the command, turning expected failures into one line and exit 1."""
    return run_app(app, argv)


if __name__ == "__main__":
    sys.exit(main())
