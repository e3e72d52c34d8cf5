"""``dsv41 proxy ...``: the torch-free async drafting proxy (spawned by the engine's async
speculator; ``self-test`` checks a host before enabling ``DSV41_DRAFTER_ASYNC``).

Runnable as ``python -m dsv41.drafter.proxy_cli`` without importing the rest of the CLI (whose
groups import torch).
"""

from __future__ import annotations

import logging
import sys

import typer

from dsv41 import fileio
from dsv41.errors import Dsv41Error, run_app

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="The async drafting proxy (torch-free).",
)


def _hex_or_empty(name: str, v: str) -> str:
    if v and (len(v) != 64 or any(c not in "0123456789abcdef" for c in v)):
        raise Dsv41Error(f"--{name} {v!r} is not a lowercase hex sha256")
    return v


@app.command("run")
def run(
    shm: str = typer.Option(..., help="Name of the shared-memory ring the engine created."),
    remote: str = typer.Option(..., help="Drafter worker URL, tcp://HOST:PORT."),
    drafter_identity: str = typer.Option("", help="Expected drafter identity (hex sha256)."),
    markov_identity: str = typer.Option("", help="Expected Markov head identity (hex sha256)."),
    target_identity: str = typer.Option("", help="Expected target identity (hex sha256)."),
    timeout_ms: float = typer.Option(100.0, min=1.0, help="Per-round timeout (ms)."),
    nap_us: float = typer.Option(50.0, min=0.0, help="First sleep between idle polls (µs)."),
    nap_max_us: float = typer.Option(
        1000.0, min=0.0, help="Longest sleep between idle polls (µs); naps double while idle."
    ),
    engine_timeout_s: float = typer.Option(
        10.0, min=0.1, help="Without --parent-pid: exit when the engine heartbeat is older (s)."
    ),
    parent_pid: int = typer.Option(0, help="Exit when this parent process is gone (0 = do not check)."),
    memlock: bool = typer.Option(
        True, "--memlock/--no-memlock", help="Lock the proxy's memory (mlockall) and publish the result in the ring."
    ),
) -> None:
    """Serve drafting rounds from the ring until the engine stops us."""
    from dsv41.drafter.protocol import parse_url
    from dsv41.drafter.proxy import run_proxy

    parse_url(remote)
    expected = {
        "drafter": _hex_or_empty("drafter-identity", drafter_identity),
        "markov": _hex_or_empty("markov-identity", markov_identity),
        "target": _hex_or_empty("target-identity", target_identity),
    }
    logging.basicConfig(level=logging.INFO, format="%(asctime)s dsv41-proxy %(levelname)s %(message)s")
    run_proxy(
        shm,
        remote,
        expected,
        timeout_ms=timeout_ms,
        nap_us=nap_us,
        nap_max_us=nap_max_us,
        engine_timeout_s=engine_timeout_s,
        parent_pid=parent_pid or None,
        memlock=memlock,
    )


@app.command("self-test")
def self_test_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    memlock: bool = typer.Option(
        True, "--memlock/--no-memlock", help="Also probe the memory locking the proxy does (mlockall), then undo it."
    ),
    require_memlock: bool = typer.Option(False, help="Exit 1 when memory locking is refused (implies --memlock)."),
) -> None:
    """Check shared memory, host flags, memory locking and that the proxy runs without torch."""
    from dsv41.drafter.proxy import self_test

    rep = self_test(memlock=memlock or require_memlock)
    refused = "mlock" in rep and rep["mlock"] != "ok"
    if as_json:
        print(fileio.dumps_json(rep, nonfinite="null"))
    elif refused:
        print(f"proxy self-test: ring, host flags, torch-free ok; memory locking refused: {rep['mlock']}")
    else:
        locked = ", memory locking" if "mlock" in rep else ""
        print(f"proxy self-test: ok (ring, host flags, torch-free{locked})")
    if refused and require_memlock:
        raise Dsv41Error(f"proxy self-test: memory locking refused: {rep['mlock']}")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m dsv41.drafter.proxy_cli``): one line and exit 1 on errors."""
    return run_app(app, argv)


if __name__ == "__main__":
    sys.exit(main())
