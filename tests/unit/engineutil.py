"""Engine test helpers: lab assets cached per pytest session, and real `dsv41 engine serve` /
`dsv41 drafter serve` processes on ephemeral loopback ports.

The assets are built once per session under pytest's base temp dir: a config with a short training
run (``train_steps`` 40, so weights take seconds), the weights, and real synthetic tables from
``dsv41.engram.synthetic.write_synthetic_tables``. Imported by the engine unit tests, the lab
integration tests (``tests/unit`` on ``sys.path``), tests/perf and tests/fuzz.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from dsv41 import envs

REPO = Path(__file__).resolve().parents[2]
LAB_CONFIG = REPO / "python" / "dsv41" / "data" / "lab_model.json"
PY = sys.executable


def lab_assets(tmp_path_factory, train_steps: int = 40, table_seed: int = 5) -> SimpleNamespace:
    """Config/weights/tables for the engine tests, built once per session (cached)."""
    base = tmp_path_factory.getbasetemp() / f"engine-assets-{train_steps}-{table_seed}"
    ns = SimpleNamespace(
        config=base / "lab.json",
        weights=base / "w.safetensors",
        data=base / "tables",
        manifest=base / "tables" / "manifest.json",
    )
    if (base / "done").exists():
        return ns
    import torch

    from dsv41.engine.model_config import load_config
    from dsv41.engine.weights import init_weights, save_weights
    from dsv41.engram.synthetic import write_synthetic_tables

    base.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(LAB_CONFIG.read_text())
    cfg["train_steps"] = train_steps
    ns.config.write_text(json.dumps(cfg, indent=1))
    mc = load_config(ns.config)
    w, meta = init_weights(mc)
    save_weights(mc, w, meta, ns.weights)
    write_synthetic_tables(str(ns.config), ns.data, table_seed)
    torch.set_num_threads(1)
    (base / "done").write_text("ok")
    return ns


def local_rows(ns):
    """The local row source (``sources.from_env`` with no remote set)."""
    from dsv41.engram import sources

    return sources.from_env(str(ns.manifest), str(ns.data), 0, 1, settings=envs.parse({}))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ephemeral ports (all bound at once, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def serve_cmd(ns, rank: int = 0, tp: int = 1, port: int = 0, master: str = "127.0.0.1:0", extra=()) -> list[str]:
    return [
        PY,
        "-m",
        "dsv41.cli",
        "engine",
        "serve",
        "--config",
        str(ns.config),
        "--weights",
        str(ns.weights),
        "--manifest",
        str(ns.manifest),
        "--data",
        str(ns.data),
        "--rank",
        str(rank),
        "--tp",
        str(tp),
        "--master",
        master,
        "--port",
        str(port),
        *extra,
    ]


def engine_env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_ENGRAM", "DSV41_DRAFTER"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **kw)
    return env


def start(cmd, env, log: Path) -> subprocess.Popen:
    f = open(log, "wb")
    return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO))


def wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"server exited rc={proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server not ready in {timeout}s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, sig: int = 15, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


# ---------------------------------------------------------------------------- tokenizer tests


def start_pair(assets, logdir: Path, extra=(), env=None) -> dict:
    """A TP2 pair (rank 1 headless worker first, then rank 0 API head) on free loopback ports; returns
    ``{"url", "r0", "r1", "dir"}``. Raises AssertionError (both ranks killed) when rank 0 is not ready."""
    port, mport = free_ports(2)
    master = f"127.0.0.1:{mport}"
    env = engine_env(**(env or {}))
    r1 = start(serve_cmd(assets, rank=1, tp=2, master=master, extra=extra), env, logdir / "rank1.log")
    time.sleep(0.5)  # the worker really is first; it waits for rank 0's rendezvous store
    r0 = start(serve_cmd(assets, rank=0, tp=2, port=port, master=master, extra=extra), env, logdir / "rank0.log")
    try:
        wait_ready(port, r0, logdir / "rank0.log")
    except AssertionError:
        stop(r1, signal.SIGKILL)
        stop(r0, signal.SIGKILL)
        raise
    return {"url": f"http://127.0.0.1:{port}", "r0": r0, "r1": r1, "dir": logdir}


def start_worker(drafter_dir, target_identity, log: Path, extra=()) -> tuple[subprocess.Popen, str]:
    """`dsv41 drafter serve` as a real process on an ephemeral port; returns (proc, url). Raises
    AssertionError (process killed) when its ready file is not written within 60 s."""
    ready = log.with_suffix(".ready")
    if ready.exists():
        ready.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_DRAFTER")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsv41.cli",
            "drafter",
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--drafter",
            drafter_dir,
            "--target-identity",
            target_identity,
            "--ready-file",
            str(ready),
            *extra,
        ],
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        cwd=str(REPO),
    )
    t0 = time.monotonic()
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None or time.monotonic() - t0 > 60:
            proc.kill()
            raise AssertionError(f"worker did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, ready.read_text().strip()


class FakeEngine:
    """An in-process stand-in for ``dsv41.engine.engine.Engine`` behind ``create_app``: ``submit``
    records the prompt ids and ``SamplingParams`` (``prompts``, ``params``), then either raises
    ``boom`` or finishes at once with one token (id 5) and ``reason`` (the engine thread's sink
    calls); ``reason="error"`` carries the real engine's failure text. ``fatal`` as the real
    engine's; ``abort`` records its request ids (``aborted``); the admission routes' calls
    (``sched.counts``, ``freeze``) are no-ops."""

    class sched:  # noqa: N801 - the engine's attribute name
        @staticmethod
        def counts():
            return 0, 0

    def __init__(self, boom: Exception | None = None, reason: str = "length", fatal: str | None = None):
        self.boom, self.reason, self.fatal = boom, reason, fatal
        self.aborted: list = []
        self.params: list = []
        self.prompts: list[list[int]] = []

    def submit(self, ids, params, sink):
        if self.boom is not None:
            raise self.boom
        self.params.append(params)
        self.prompts.append(list(ids))
        sink({"type": "tokens", "ids": [5], "prompt_tokens": len(ids), "completion_tokens": 1})
        ev = {"type": "finish", "reason": self.reason, "prompt_tokens": len(ids), "completion_tokens": 1}
        if self.reason == "error":
            ev["error"] = "request failed: Dsv41Error: sampling distribution is not finite"
        sink(ev)

        class R:
            request_id = "req-x"

        return R()

    def abort(self, rid=None):
        self.aborted.append(rid)

    def idle(self):
        return True

    def freeze(self, on):
        pass
