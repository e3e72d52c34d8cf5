"""``dsv41 drafter ...``: train (distil from the engine's target), serve (the remote worker),
identity (print the identities a worker will report)."""

from __future__ import annotations

import logging

import typer

from dsv41 import fileio

app = typer.Typer(
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, help="Remote drafter worker and tools."
)


@app.command("serve")
def serve_cmd(
    listen: str = typer.Option(..., help="tcp://ADDR:PORT to listen on (port 0 = ephemeral)."),
    drafter: str = typer.Option(..., help="Drafter directory (drafter.json + drafter.safetensors)."),
    target_identity: str = typer.Option("", help="Target identity this worker serves (hex sha256)."),
    device: str = typer.Option("", help="One card: cpu or cuda[:N] (default cpu)."),
    cards: int = typer.Option(1, min=1, max=2, help="1: the one-card worker; 2: the TP2 pair on --devices."),
    devices: str = typer.Option("", help="With --cards 2: the two devices, e.g. cuda:0,cuda:1 (cpu,cpu: tests)."),
    lock_dir: str = typer.Option("", help="Directory of the per-card lifetime locks (default /run/dsv41)."),
    peer_timeout: float = typer.Option(
        5.0, min=0.001, max=3600.0, help="With --cards 2: seconds a collective waits for the other rank."
    ),
    cuda_graphs: bool | None = typer.Option(
        None, "--cuda-graphs/--no-cuda-graphs", help="Replay CUDA graphs (default: on with --device cuda)."
    ),
    backend: str = typer.Option("torch", help="Drafter backend: torch, or exl3 (EXL3 model dir, CUDA, exllamav3)."),
    metrics: str = typer.Option("", help="HOST:PORT for Prometheus /metrics (empty = off)."),
    ready_file: str = typer.Option("", help="Write the bound URL here once serving."),
    max_batch: int = typer.Option(64, min=1, max=1024, help="Largest batch accepted per round."),
    threads: int = typer.Option(1, min=1, max=256, help="torch CPU threads (each rank's, with --cards 2)."),
    delay_ms: float = typer.Option(0.0, min=0.0, help="Injected per-round delay (fault drills)."),
) -> None:
    """Serve drafting rounds until SIGTERM (one card, or the two-card TP2 pair)."""
    from dsv41.errors import Dsv41Error

    if cards == 2:
        from dsv41.drafter.pair import parse_devices

        if device:
            raise Dsv41Error("drafter serve: --device names one card; with --cards 2 name both with --devices")
        if backend != "torch":
            raise Dsv41Error(f"drafter serve: --backend {backend}: the two-card worker serves the torch backend only")
        if cuda_graphs:
            raise Dsv41Error("drafter serve: --cuda-graphs: the two-card worker runs eager (no CUDA graphs)")
        pair_devices = parse_devices(devices, 2)
    elif devices:
        raise Dsv41Error("drafter serve: --devices is for --cards 2; one card takes --device")
    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s dsv41-drafter %(levelname)s %(message)s")
    if cards == 2:
        from dsv41.drafter.worker_tp import serve_pair

        serve_pair(
            drafter,
            listen,
            pair_devices,
            target_identity=target_identity,
            metrics=metrics,
            ready_file=ready_file,
            max_batch=max_batch,
            delay_ms=delay_ms,
            threads=threads,
            lock_dir=lock_dir,
            peer_timeout_s=peer_timeout,
        )
        return
    from dsv41.drafter.worker import serve

    device = device or "cpu"
    if cuda_graphs is None:
        cuda_graphs = device.startswith("cuda")
    serve(
        drafter,
        listen,
        target_identity=target_identity,
        device=device,
        cuda_graphs=cuda_graphs,
        backend=backend,
        metrics=metrics,
        ready_file=ready_file,
        max_batch=max_batch,
        delay_ms=delay_ms,
        lock_dir=lock_dir,
    )


@app.command("identity")
def identity_cmd(drafter: str = typer.Argument(..., help="Drafter directory.")) -> None:
    """Print the drafter, Markov head and recorded target identities as JSON."""
    from dsv41.drafter.model import identities

    print(fileio.dumps_json(identities(drafter), indent=1))


@app.command("status")
def status_cmd(
    metrics: str = typer.Option(..., help="URL of the worker's /metrics, e.g. http://198.18.0.13:9451/metrics."),
    timeout: float = typer.Option(10.0, min=0.1, help="Seconds for the request."),
    as_json: bool = typer.Option(False, "--json", help="Print the state as JSON."),
) -> None:
    """Print a running worker's open connections and served identities (from its /metrics)."""
    from dsv41.drafter.status import fetch_status

    st = fetch_status(metrics, timeout)
    if as_json:
        print(fileio.dumps_json(st, indent=1, nonfinite="null"))
    else:
        ids = st["identities"]
        print(
            f"connections {st['connections']}; drafter {ids['drafter'][:16]} markov {ids['markov'][:16]} "
            f"target {ids['target'][:16]}"
        )


@app.command("train")
def train_cmd(
    config: str = typer.Option(..., help="Target model config (e.g. python/dsv41/data/lab_model.json)."),
    weights: str = typer.Option(..., help="Target weights (safetensors from `dsv41 engine init-weights`)."),
    out: str = typer.Option(..., help="Output drafter directory."),
    steps: int = typer.Option(0, min=0, help="Training steps (0 = the default in docs/drafter.md)."),
    seed: int = typer.Option(0, help="Seed (data order and initialisation)."),
    manifest: str = typer.Option("", help="Engram manifest (with --data); default: synthetic tables in memory."),
    data: str = typer.Option("", help="Engram table directory (with --manifest)."),
    tables_seed: int = typer.Option(
        41, help="Seed of the synthetic tables when no --manifest (the lab's dsv41_tables_seed)."
    ),
    threads: int = typer.Option(1, min=1, max=256, help="torch CPU threads."),
    as_json: bool = typer.Option(False, "--json", help="Print the training report as JSON."),
) -> None:
    """Distil a drafter from the target's greedy continuations (deterministic, seconds on CPU)."""
    import torch

    from dsv41.drafter.train import train_drafter

    torch.set_num_threads(threads)
    rep = train_drafter(
        config,
        weights,
        out,
        steps=steps or None,
        seed=seed,
        manifest=manifest or None,
        data=data or None,
        tables_seed=tables_seed,
    )
    if as_json:
        print(fileio.dumps_json(rep, indent=1, nonfinite="null"))
    else:
        print(
            f"drafter written to {out}: drafter {rep['identities']['drafter'][:12]} markov "
            f"{rep['identities']['markov'][:12]} target {rep['identities']['target'][:12]}; "
            f"held-out acceptance {rep['heldout_acceptance']:.2f} ({rep['seconds']:.1f} s)"
        )
