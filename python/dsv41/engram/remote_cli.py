"""``dsv41 engram serve`` and ``dsv41 engram sweep`` (registered by ``dsv41.engram.cli``).

Also runnable alone (``python -m dsv41.engram.remote_cli serve ...``), which is how tests start
the server as a separate process.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer

from dsv41 import fileio
from dsv41.errors import Dsv41Error, run_app


class _Terminated(BaseException):
    """SIGTERM/SIGINT arrived while the tables were still loading."""


def serve(
    manifest: Annotated[Path, typer.Option("--manifest", help="manifest.json of the tables.")],
    data: Annotated[
        Path | None, typer.Option("--data", help="Directory of the shards (default: the manifest's).")
    ] = None,
    listen: Annotated[
        list[str] | None,
        typer.Option("--listen", help="tcp://A:P or nixl://A:P (repeat for several; port 0 = ephemeral)."),
    ] = None,
    metrics: Annotated[str | None, typer.Option("--metrics", help="A:P for Prometheus /metrics and /ready.")] = None,
    ready_file: Annotated[
        Path | None, typer.Option("--ready-file", help="Written (JSON: pid, bound URLs) once listening.")
    ] = None,
    drain_timeout: Annotated[
        float, typer.Option("--drain-timeout", help="Seconds SIGTERM waits for in-flight requests.")
    ] = 5.0,
) -> None:
    """Load every table into RAM, verify it against the manifest, then serve rows until SIGTERM."""
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.server import EngramServer, clear_stale_ready_file, write_ready_file

    if not 0 <= drain_timeout <= 3600:  # checked now, not at SIGTERM (join() overflows on huge values)
        raise Dsv41Error(f"--drain-timeout must be in [0, 3600] seconds, got {drain_timeout}")
    m = load_manifest(manifest)
    data_dir = data if data is not None else manifest.parent
    es = EngramServer(m, data_dir, list(listen or []), metrics)
    if ready_file is not None:
        # Checked before the (long) load; a stale ready file of an earlier run is removed now so
        # a watcher never takes it for this run's readiness.
        clear_stale_ready_file(ready_file)
    wrote_ready = False
    stop = threading.Event()
    serving = threading.Event()

    def on_signal(signum, frame):
        stop.set()
        if not serving.is_set():
            raise _Terminated()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            es.start_metrics()
            report = es.load()
            addrs = es.listen()
            serving.set()
        except _Terminated:
            print("dsv41 engram serve: terminated while loading", file=sys.stderr)
            es.stop(0)
            return
        info = es.ready_info()
        if ready_file is not None:
            write_ready_file(ready_file, info)
            wrote_ready = True
        print(
            fileio.dumps_json(
                {
                    "event": "listening",
                    "listen": [str(a) for a in addrs],
                    "load_seconds": round(report["seconds"], 3),
                    "implementation": info["implementation"],
                }
            ),
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        es.stop(drain_timeout)
        print(fileio.dumps_json({"event": "stopped", **es.rowserver.snapshot()}, nonfinite="null"), flush=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if wrote_ready:  # only ever remove the file this process wrote
            try:
                os.unlink(ready_file)
            except OSError:
                pass


def sweep(
    manifest: Annotated[Path, typer.Option("--manifest", help="manifest.json of the tables.")],
    remote: Annotated[
        str, typer.Option("--remote", help="tcp://H:P[@LOCAL] or nixl://H:P[@LOCAL] of this rank's server.")
    ],
    rank: Annotated[int, typer.Option("--rank", help="This rank (0-based).")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")] = 2,
    data: Annotated[
        Path | None, typer.Option("--data", help="Local shards (default: the manifest's directory).")
    ] = None,
    lookups: Annotated[int, typer.Option("--lookups", help="Row ids to look up (both layers together).")] = 839040,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the token sequences.")] = 0,
    timeout_ms: Annotated[int, typer.Option("--timeout-ms", help="Per-request timeout before local fallback.")] = 1000,
    required: Annotated[bool, typer.Option("--required", help="Fail instead of falling back to local rows.")] = False,
    token_map: Annotated[
        Path | None, typer.Option("--token-map", help="Token map (default: the lab tokenizer's, if it fits).")
    ] = None,
) -> None:
    """Compare remote rows with local rows over hashed token sequences; prints JSON.

    Exit 1 if any row differs or if no row at all came from the server (fallbacks are counted,
    not failed, unless --required)."""
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.sweep import run_sweep
    from dsv41.transport import parse_url

    parse_url(remote)
    if not 0 <= seed < (1 << 63):
        raise Dsv41Error(f"--seed must be in [0, 2^63), got {seed}")
    m = load_manifest(manifest)
    report = run_sweep(
        m,
        data,
        remote,
        tp,
        rank,
        lookups=lookups,
        seed=seed,
        timeout_ms=timeout_ms,
        required=required,
        token_map=str(token_map) if token_map else None,
    )
    print(fileio.dumps_json(report, nonfinite="null"))
    if report["bad_rows"]:
        raise Dsv41Error(f"sweep found {report['bad_rows']} bad rows")
    if report["remote_rows"] == 0:
        raise Dsv41Error(
            f"sweep compared no remote rows: all {report['lookups']} lookups fell back to local "
            f"({report['fallbacks']} fallbacks); is {remote} up?"
        )


def register(app: typer.Typer) -> None:
    """Add ``serve`` and ``sweep`` to the ``dsv41 engram`` typer app."""
    app.command("serve")(serve)
    app.command("sweep")(sweep)


def _standalone() -> int:
    app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    register(app)

    return run_app(app, sys.argv[1:])


if __name__ == "__main__":
    sys.exit(_standalone())
