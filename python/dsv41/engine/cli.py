"""``dsv41 engine``: init-weights, identity, generate, serve."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsv41.errors import Dsv41Error

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

_DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "data" / "lab_model.json"


def _threads(n: int | None) -> None:
    import torch

    torch.set_num_threads(max(1, n or int(os.environ.get("DSV41_ENGINE_THREADS", "1"))))


@app.command("init-weights")
def init_weights_cmd(
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")] = _DEFAULT_CONFIG,
    out: Annotated[Path, typer.Option("--out", help="Output safetensors file.")] = Path("weights.safetensors"),
    quiet: Annotated[bool, typer.Option("--quiet", help="No training progress on stderr.")] = False,
) -> None:
    """Deterministic weights from the config seed: seeded init + a short single-threaded training
    run on the built-in toy corpus. Prints the target identity (sha256 of config + weights)."""
    from dsv41.engine.model import init_weights, load_config, save_weights, target_identity

    cfg = load_config(config)
    # Fail before the ~1 min training run, not after it.
    if not out.parent.is_dir():
        raise Dsv41Error(f"--out {out}: directory {out.parent} does not exist")
    if out.is_dir():
        raise Dsv41Error(f"--out {out} is a directory; give a file name")
    prog = None if quiet else (lambda s, l: print(f"init-weights: step {s} loss {l:.3f}", file=sys.stderr))
    w, meta = init_weights(cfg, progress=prog)
    save_weights(cfg, w, meta, out)
    print(f"{out} {target_identity(config, out)}")


@app.command("identity")
def identity_cmd(
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")] = _DEFAULT_CONFIG,
    weights: Annotated[Path, typer.Option("--weights", help="Weights safetensors.")] = Path("weights.safetensors"),
) -> None:
    """Print the target identity: sha256 over the config bytes then the weights bytes."""
    from dsv41.engine.model import target_identity

    print(target_identity(config, weights))


def _row_source(manifest: Path, data: Optional[Path], rank: int, tp: int):
    from dsv41.engram import rowsource

    if not manifest.is_file():
        raise Dsv41Error(f"manifest {manifest} does not exist (run `dsv41 engram make-tables`)")
    if data is not None and not data.is_dir():
        raise Dsv41Error(f"--data {data} is not a directory (the table shards from `dsv41 engram make-tables`)")
    return rowsource.from_env(str(manifest), str(data) if data else None, rank, tp)


@app.command("generate")
def generate_cmd(
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text.")],
    manifest: Annotated[Path, typer.Option("--manifest", help="Engram manifest.json.")],
    data: Annotated[Optional[Path], typer.Option("--data", help="Directory of the table shards.")] = None,
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")] = _DEFAULT_CONFIG,
    weights: Annotated[Path, typer.Option("--weights", help="Weights safetensors.")] = Path("weights.safetensors"),
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate (greedy).")] = 32,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="JSON output.")] = False,
) -> None:
    """Greedy-generate from one prompt at TP1 (row source from VLLM_ENGRAM_REMOTE*); prints the
    token ids and the text."""
    import json

    from dsv41.engine.runner import LocalRunner
    from dsv41.engine.tokenizer import ByteTokenizer

    _threads(None)
    _check_device(device)
    tok = ByteTokenizer()
    rows = _row_source(manifest, data if data else manifest.parent, 0, 1)
    try:
        res = LocalRunner(config, weights, rows, device=device).generate(tok.encode(prompt), max_tokens)
    finally:
        rows.close()
    if as_json:
        print(json.dumps({"tokens": res.tokens, "text": tok.decode(res.tokens), "counters": rows.counters()}))
    else:
        print(",".join(map(str, res.tokens)))
        print(tok.decode(res.tokens))


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise Dsv41Error(f"--device must be cpu or cuda[:N], got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise Dsv41Error("--device cuda asked for, but torch sees no CUDA device")


@app.command("serve")
def serve_cmd(
    manifest: Annotated[Path, typer.Option("--manifest", help="Engram manifest.json.")],
    data: Annotated[Optional[Path], typer.Option("--data", help="Directory of the table shards (local reader / fallback).")] = None,
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")] = _DEFAULT_CONFIG,
    weights: Annotated[Path, typer.Option("--weights", help="Weights safetensors.")] = Path("weights.safetensors"),
    rank: Annotated[int, typer.Option("--rank", help="TP rank (0 = API head; start rank 1 first).")] = 0,
    tp: Annotated[int, typer.Option("--tp", help="TP size (1 or 2).")] = 1,
    master: Annotated[str, typer.Option("--master", help="Rendezvous ADDR:PORT (rank 0 listens there).")] = "127.0.0.1:18790",
    host: Annotated[str, typer.Option("--host", help="HTTP listen address (rank 0; rank 1 ignores it).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP port (rank 0; rank 1 ignores it).")] = 18700,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda[:N].")] = "cpu",
    kv_cache_tokens: Annotated[int, typer.Option("--kv-cache-tokens", help="KV budget in tokens over all requests.")] = 65536,
    max_running: Annotated[int, typer.Option("--max-running", help="Running-set bound (requests).")] = 8,
    max_step_tokens: Annotated[int, typer.Option("--max-step-tokens", help="New tokens per step (prefill chunk budget).")] = 512,
    served_model_name: Annotated[str, typer.Option("--served-model-name", help="Model id in the API.")] = "dsv41-lab",
    rendezvous_timeout: Annotated[float, typer.Option("--rendezvous-timeout", help="Seconds to wait for the other rank.")] = 600.0,
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads per rank.")] = 1,
) -> None:
    """Serve the lab model: rank 0 answers HTTP, rank 1 is a headless worker (start it first)."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d rendezvous retries are expected noise
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _threads(threads)
    _check_device(device)
    if tp not in (1, 2):
        raise Dsv41Error(f"--tp must be 1 or 2, got {tp}")
    if not 0 <= rank < tp:
        raise Dsv41Error(f"--rank must be in [0, {tp}), got {rank}")
    if tp > 1:
        mhost, _, mport = master.rpartition(":")
        if not mhost or not mport.isdigit() or not 0 < int(mport) < 65536:
            raise Dsv41Error(f"--master must be ADDR:PORT, got {master!r}")
    if rank == 0 and not 0 < port < 65536:
        raise Dsv41Error(f"--port must be in [1, 65535], got {port}")
    from dsv41.engine.deadline import deadlines_from_env, guard_row_source
    from dsv41.engine.model import TargetModel, load_config, load_weights, target_identity

    deadlines = deadlines_from_env()
    cfg = load_config(config)
    w = load_weights(cfg, weights)
    identity = target_identity(config, weights)
    rows = guard_row_source(_row_source(manifest, data, rank, tp), deadlines.engram_lookup_s)
    drain = {"flag": False}
    if tp > 1:
        from dsv41.engine.tp import DistComm

        logging.getLogger("dsv41.engine").info("rank %d joining the TP%d group at %s", rank, tp, master)
        comm = DistComm.init(rank, tp, master, device, timeout_s=rendezvous_timeout,
                             peer_timeout_s=deadlines.tp_peer_timeout_s)
    else:
        from dsv41.engine.tp import LocalComm

        comm = LocalComm()
    try:
        model = TargetModel(cfg, w, comm, rows, device)
        if rank != 0:
            from dsv41.engine.engine import worker_loop

            # Installed only once the group has formed: before that, SIGTERM simply ends the
            # process (nothing to drain; the C++ rendezvous would not run a Python handler).
            signal.signal(signal.SIGTERM, lambda *_: drain.__setitem__("flag", True))

            logging.getLogger("dsv41.engine").info("rank %d ready (identity %s)", rank, identity[:12])
            worker_loop(model, comm, rows, lambda: drain["flag"])
            return
        _serve_rank0(cfg, model, comm, rows, identity, device, host, port, kv_cache_tokens, max_running,
                     max_step_tokens, served_model_name, deadlines)
    finally:
        try:
            rows.close()
        finally:
            if tp > 1:
                comm.close()


def _drafter_kv_extra() -> int:
    """KV tokens the drafter package says a remote drafter frees (0 without the package)."""
    try:
        from dsv41.drafter.spark import kv_budget_extra_tokens
    except ImportError:
        return 0
    return int(kv_budget_extra_tokens(os.environ))


# Seconds a failed rank 0 keeps answering /health 503 (with the reason) before it exits.
FATAL_LINGER_S = 1.0


def _serve_rank0(cfg, model, comm, rows, identity, device, host, port, kv_cache_tokens, max_running,
                 max_step_tokens, name, deadlines) -> None:
    import asyncio

    import uvicorn

    from dsv41.engine.engine import Engine
    from dsv41.engine.metrics import EngineMetrics
    from dsv41.engine.scheduler import Scheduler
    from dsv41.engine.server import ServerState, create_app
    from dsv41.engine.spec import draft_depth, speculator_from_env

    log = logging.getLogger("dsv41.engine")
    spec = speculator_from_env(os.environ, cfg.raw, identity, device)
    depth = draft_depth() if spec is not None else 0
    extra = _drafter_kv_extra()
    if extra:
        log.info("KV budget +%d tokens freed by the remote drafter (capacity mode): %d in all", extra,
                 kv_cache_tokens + extra)
        kv_cache_tokens += extra
    sched = Scheduler(kv_cache_tokens, cfg.max_position_embeddings, max_running, max_step_tokens, depth)
    holder: dict = {}
    metrics = EngineMetrics(name, lambda: dict(holder["engine"].rank_counters),
                            spec.counters if spec is not None else None)
    metrics.kv_tokens.set(kv_cache_tokens)
    metrics.kv_extra_tokens.set(extra)
    engine = Engine(model, sched, comm, rows, spec, depth, metrics, deadlines=deadlines)
    holder["engine"] = engine
    state = ServerState()
    app = create_app(engine, name, min(cfg.max_position_embeddings, kv_cache_tokens), state, metrics)
    class _Server(uvicorn.Server):
        # uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would kill the
        # process before the engine tells rank 1 to stop; handle it as "drain, then exit 0".
        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                log.info("signal %d: draining (no new requests; in-flight requests finish)", sig)
                state.draining = True
                self.should_exit = True

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=None, lifespan="off"))

    async def watch():
        # Drain triggers besides our own SIGTERM: rank 1 draining, the engine failing. A failed
        # engine keeps answering /health 503 with the reason for FATAL_LINGER_S, then exits 1
        # for its supervisor to restart the pair.
        while not server.should_exit:
            if engine.fatal or engine.peer_draining:
                state.draining = True
                if engine.fatal:
                    await asyncio.sleep(FATAL_LINGER_S)
                    server.should_exit = True
                elif engine.idle():
                    server.should_exit = True
            if server.should_exit:
                break
            await asyncio.sleep(0.1)
        state.draining = True

    async def main():
        t = asyncio.create_task(watch())
        log.info("rank 0 serving %s on http://%s:%d (tp %d, identity %s, speculation %s)", name, host, port,
                 comm.tp, identity[:12], f"k={depth}" if spec is not None else "off")
        await server.serve()
        t.cancel()

    engine.start()
    try:
        asyncio.run(main())
    except SystemExit as exc:
        # uvicorn calls sys.exit() when it cannot bind (bad --host, port in use): one clear line.
        raise Dsv41Error(f"could not listen on {host}:{port} (bad address or port in use; uvicorn exit "
                         f"{exc.code})") from None
    finally:
        state.draining = True
        engine.shutdown()
    if engine.fatal:
        raise Dsv41Error(engine.fatal)
    if not server.started:
        raise Dsv41Error(f"could not listen on {host}:{port} (address in use?)")
