"""The one ``dsv41`` command; each subpackage contributes a sub-command group.

Contract (docs/architecture.md): every command has ``--help``, exits 0 on success and exits 1
with one clear line on bad input or a failed check (never a traceback).  Sub-command groups
live next to the code they drive (``dsv41/<subpackage>/cli.py`` exposing ``app``) and import
heavy dependencies (torch, NIXL) inside the commands, so ``dsv41 --help`` stays fast.
"""

from __future__ import annotations

from dsv41.errors import quiet_after_exit, run_app, signals_from_start

# Everything up to main() runs in a command's first instant: a SIGINT or SIGTERM there ends in
# one line and 130/143 too, not a KeyboardInterrupt traceback (rc -2) or a silent rc -15.
with signals_from_start():
    import importlib
    import sys

    import typer

    from dsv41 import fileio

    app = typer.Typer(
        name="dsv41",
        help="dsv41-offload: Engram tables, transport, engine, drafter and measurement tools.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    # (group name, module path, help). Every module exists (tests/unit/test_cli_groups.py); a helper
    # adding a group adds its module in the same change.
    GROUPS = [
        (
            "env",
            "dsv41.entrypoints.env_cli",
            "Check what the roles write for a service: env files (dsv41.envs), systemd units.",
        ),
        ("engram", "dsv41.engram.cli", "Engram layout, hashing, tables, manifest, rows, server."),
        ("engine", "dsv41.entrypoints.engine_serve", "The local stand-in serving engine (TP over torch.distributed)."),
        ("drafter", "dsv41.drafter.cli", "Remote drafter worker and tools."),
        ("proxy", "dsv41.drafter.proxy_cli", "The async drafting proxy (torch-free)."),
        ("refs", "dsv41.harness.refs_cli", "Greedy reference prompts: record and verify."),
        ("bench", "dsv41.harness.bench_cli", "Benchmark client: TTFT, step_ms, tok/s, acceptance."),
        ("window", "dsv41.harness.window_cli", "Fenced-window cells, the WIN2 R3 decision, calibration, candidates."),
        ("drill", "dsv41.harness.drill_cli", "Fault drills under load on the lab: run, clear, check."),
        ("metrics", "dsv41.harness.metrics_cli", "Read a Prometheus /metrics endpoint as JSON."),
        (
            "oplock",
            "dsv41.promotion.oplock_cli",
            "The controller's change lock: one window/promote/rollback at a time.",
        ),
        ("package", "dsv41.promotion.cli", "Promotion packages: show, diff, verify (exact production records)."),
        ("monitor", "dsv41.monitoring.cli", "Monitoring: the operations exporter, alert rules, Grafana dashboard."),
        (
            "status",
            "dsv41.entrypoints.status_cli",
            "Is production healthy, and what is it running? (exit 1 with reasons)",
        ),
        ("qualify", "dsv41.entrypoints.qualify_cli", "Hardware qualification probes and report (qualify.yml)."),
        ("overlay", "dsv41.overlay.cli", "The vLLM overlay: compare an installed vLLM or an image with its contracts."),
    ]

    def _register() -> None:
        for name, module, help_text in GROUPS:
            app.add_typer(importlib.import_module(module).app, name=name, help=help_text)

    @app.callback()
    def _root(
        follow_symlinks: bool = typer.Option(
            False,
            "--follow-symlinks",
            help="An output path that is a symlink replaces the file it points to (refused by default).",
        ),
    ) -> None:
        """dsv41-offload command line."""

        fileio.FOLLOW_SYMLINKS = follow_symlinks  # set on every run: in-process callers run many

    @app.command()
    def version(
        as_json: bool = typer.Option(False, "--json", help="Also the Python and the transport path, as JSON."),
    ) -> None:
        """Print the dsv41 package version."""
        from dsv41.version import version_info

        info = version_info()
        print(fileio.dumps_json(info) if as_json else info["dsv41"])

    _register()


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the command, turning expected failures into one line and exit 1. Called
    with no ``argv`` (the ``dsv41`` process itself), SIGINT and SIGTERM are ignored once the exit
    code is known (:func:`dsv41.errors.quiet_after_exit`)."""
    rc = run_app(app, argv)
    if argv is None:
        quiet_after_exit()
    return rc


if __name__ == "__main__":
    sys.exit(main())
