"""``dsv41 engine serve``: the composition root that joins the engine and the drafter.

The engine holds a :class:`dsv41.engine.spec_decode.Speculator` and knows no drafter; the
drafter implements one and knows no engine server. This module reads the environment once
(:func:`dsv41.envs.parse`), builds the row source, the model, the speculator
(:func:`dsv41.drafter.factory.build_speculator`) and the HTTP server, and registers ``serve`` on
the ``dsv41 engine`` command group (:data:`app`).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Annotated

import typer

from dsv41 import authz, envs
from dsv41.drafter.factory import build_speculator, kv_budget_extra_tokens
from dsv41.engine.cli import DEFAULT_CONFIG, app, check_device, row_source, set_threads
from dsv41.envs import Settings
from dsv41.errors import Dsv41Error

__all__ = ["app", "serve_cmd"]


@app.command("hf-checkpoint")
def hf_checkpoint_cmd(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the checkpoint into.")],
    seed: Annotated[int, typer.Option("--seed", help="Seed of the weights.")] = 41,
) -> None:
    """Write the vLLM lab's tiny Llama checkpoint (config, safetensors, tokenizer; deterministic) and
    print its identity (sha256 over its files)."""
    from dsv41.engine import hf_checkpoint

    print(hf_checkpoint.write(out, seed))


@app.command("hf-checkpoint-identity")
def hf_checkpoint_identity_cmd(
    directory: Annotated[Path, typer.Argument(help="Checkpoint directory written by hf-checkpoint.")],
) -> None:
    """Print the identity (sha256 over its files) of a checkpoint written by ``hf-checkpoint``."""
    from dsv41.engine import hf_checkpoint

    print(hf_checkpoint.identity(directory))


@app.command("serve")
def serve_cmd(
    manifest: Annotated[Path, typer.Option("--manifest", help="Engram manifest.json.")],
    data: Annotated[
        Path | None, typer.Option("--data", help="Directory of the table shards (local reader / fallback).")
    ] = None,
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")] = DEFAULT_CONFIG,
    weights: Annotated[Path, typer.Option("--weights", help="Weights safetensors.")] = Path("weights.safetensors"),
    rank: Annotated[int, typer.Option("--rank", help="TP rank (0 = API head; start rank 1 first).")] = 0,
    tp: Annotated[int, typer.Option("--tp", help="TP size (1 or 2).")] = 1,
    master: Annotated[
        str, typer.Option("--master", help="Rendezvous ADDR:PORT (rank 0 listens there).")
    ] = "127.0.0.1:18790",
    host: Annotated[str, typer.Option("--host", help="HTTP listen address (rank 0; rank 1 ignores it).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP port (rank 0; rank 1 ignores it).")] = 18700,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda[:N].")] = "cpu",
    kv_cache_tokens: Annotated[
        int, typer.Option("--kv-cache-tokens", help="KV budget in tokens over all requests.")
    ] = 65536,
    max_running: Annotated[int, typer.Option("--max-running", help="Running-set bound (requests).")] = 8,
    max_step_tokens: Annotated[
        int, typer.Option("--max-step-tokens", help="New tokens per step (prefill chunk budget).")
    ] = 512,
    served_model_name: Annotated[str, typer.Option("--served-model-name", help="Model id in the API.")] = "dsv41-lab",
    rendezvous_timeout: Annotated[
        float, typer.Option("--rendezvous-timeout", help="Seconds to wait for the other rank.")
    ] = 600.0,
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads per rank.")] = 1,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="VLLM_API_KEY",
            show_default=False,
            help="vLLM's convention: /v1 requests need 'Authorization: Bearer KEY' (rank 0). Prefer VLLM_API_KEY "
            "in a mode-0600 env file: a command line is visible to every local user.",
        ),
    ] = None,
) -> None:
    """Serve the lab model: rank 0 answers HTTP, rank 1 is a headless worker (start it first)."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d rendezvous retries are expected noise
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = envs.parse()  # every DSV41_* variable, once, before anything starts
    # rank 0's operator credential (dsv41.authz): a bad file stops the start, never a silent open server
    access = authz.server_settings(settings) if rank == 0 else (None, ())
    set_threads(threads, settings)
    check_device(device)
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
    from dsv41.engine.deadline import deadlines_from_settings
    from dsv41.engine.model import TargetModel
    from dsv41.engine.model_config import load_config
    from dsv41.engine.weights import load_weights, target_identity

    cfg = load_config(config)
    w = load_weights(cfg, weights)
    identity = target_identity(config, weights)
    deadlines = deadlines_from_settings(settings)
    rows = row_source(manifest, data, rank, tp, settings)  # remote: its lookup deadline inside
    # The local shards are verified before this rank listens or joins: a missing, truncated or
    # changed shard is this process's one error line (never a healthy API that dies on the first
    # request); while serving, every local read checks its shard is still the verified file.
    from dsv41.engram.sources import verify_local

    verify_local(rows)
    drain = {"flag": False}
    if tp > 1:
        from dsv41.engine.tp import DistComm

        # Not joined yet: everything slow (the model, rank 0's speculator and server) is built
        # first, so that once the group forms no rank waits on the other past the peer timeout.
        comm = DistComm(
            rank, tp, master, device, timeout_s=rendezvous_timeout, peer_timeout_s=deadlines.tp_peer_timeout_s
        )
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

            _join(comm)
            logging.getLogger("dsv41.engine").info("rank %d ready (identity %s)", rank, identity[:12])
            worker_loop(model, comm, rows, lambda: drain["flag"])
            return
        _serve_rank0(
            settings,
            cfg,
            model,
            comm,
            rows,
            identity,
            device,
            host,
            port,
            kv_cache_tokens,
            max_running,
            max_step_tokens,
            served_model_name,
            deadlines,
            access,
            api_key or None,
        )
    finally:
        try:
            rows.close()
        finally:
            if tp > 1:
                comm.close()


def _join(comm) -> None:
    """Join the TP group now (TP1's ``LocalComm`` has nothing to join)."""
    if hasattr(comm, "join"):
        logging.getLogger("dsv41.engine").info("rank %d joining the TP%d group at %s", comm.rank, comm.tp, comm.master)
        comm.join()


# Seconds a failed rank 0 keeps answering /health 503 (with the reason) before it exits.
FATAL_LINGER_S = 1.0


def _serve_rank0(
    settings: Settings,
    cfg,
    model,
    comm,
    rows,
    identity,
    device,
    host,
    port,
    kv_cache_tokens,
    max_running,
    max_step_tokens,
    name,
    deadlines,
    access=(None, ()),
    api_key=None,
) -> None:
    if access[0] is None:  # said when the API starts, after the arguments were checked
        logging.getLogger("dsv41.engine").warning(
            "DSV41_OPERATOR_CREDENTIAL_FILE is not set: /pause and /resume refuse every request"
        )
    import asyncio

    import uvicorn

    from dsv41.engine.engine import Engine
    from dsv41.engine.metrics import EngineMetrics
    from dsv41.engine.scheduler import Scheduler
    from dsv41.engine.server import create_app
    from dsv41.engine.server_state import ABORT_SETTLE_S, ServerState, shutdown_drain
    from dsv41.httpd import request_limit, uvicorn_limits

    log = logging.getLogger("dsv41.engine")
    spec = build_speculator(settings, model_cfg=cfg.raw, target_identity=identity, device=device)
    depth = settings.drafter_k if spec is not None else 0
    extra = kv_budget_extra_tokens(settings)
    if extra:
        log.info(
            "KV budget +%d tokens freed by the remote drafter (capacity mode): %d in all",
            extra,
            kv_cache_tokens + extra,
        )
        kv_cache_tokens += extra
    sched = Scheduler(kv_cache_tokens, cfg.max_position_embeddings, max_running, max_step_tokens, depth)
    holder: dict = {}
    metrics = EngineMetrics(
        name, lambda: dict(holder["engine"].rank_counters), spec.counters if spec is not None else None
    )
    metrics.kv_tokens.set(kv_cache_tokens)
    metrics.kv_extra_tokens.set(extra)
    engine = Engine(model, sched, comm, rows, spec, depth, metrics, deadlines=deadlines)
    holder["engine"] = engine
    state = ServerState(settings.admission_hold_file or None)
    app = create_app(
        engine,
        name,
        min(cfg.max_position_embeddings, kv_cache_tokens),
        state,
        metrics,
        request_limit(settings),
        operator_credential=access[0],
        api_key=api_key,
        allowed_hosts=access[1],
    )

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

    drain_s = settings.engine_drain_timeout_s
    # The shutdown drain (server_state.shutdown_drain) bounds the requests; uvicorn's graceful shutdown
    # is the backstop for connections that outlive it (a handler that ignores its abort).
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(drain_s + ABORT_SETTLE_S) + 1,
            lifespan="off",
            **uvicorn_limits(settings),
        )
    )

    async def watch():
        # Drain triggers besides our own SIGTERM: rank 1 draining, the engine failing. A failed
        # engine keeps answering /health 503 with the reason for FATAL_LINGER_S, then exits 1
        # for its service manager (systemd) to restart the pair.
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
        report = await shutdown_drain(engine, state, 0.0 if engine.fatal else drain_s)
        log.info("shutdown drain: %s", report)

    async def main():
        t = asyncio.create_task(watch())
        log.info(
            "rank 0 serving %s on http://%s:%d (tp %d, identity %s, speculation %s)",
            name,
            host,
            port,
            comm.tp,
            identity[:12],
            f"k={depth}" if spec is not None else "off",
        )
        try:
            await server.serve()
        finally:
            server.should_exit = True  # serve() also returns when it could not bind
            await t

    _join(comm)  # last: the engine thread's pings start right after the handshake
    engine.start()
    try:
        asyncio.run(main())
    except SystemExit as exc:
        # uvicorn calls sys.exit() when it cannot bind (bad --host, port in use): one clear line.
        raise Dsv41Error(
            f"could not listen on {host}:{port} (bad address or port in use; uvicorn exit {exc.code})"
        ) from None
    finally:
        state.draining = True
        engine.shutdown()
    if engine.fatal:
        raise Dsv41Error(engine.fatal)
    if not server.started:
        raise Dsv41Error(f"could not listen on {host}:{port} (address in use?)")
