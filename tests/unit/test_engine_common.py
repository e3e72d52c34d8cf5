"""Shared helpers of the engine tests (lab assets cached per pytest session) + tokenizer tests.

Other engine test modules import this file (``from test_engine_common import ...``); the assets
are built once per session under pytest's base temp dir: a config with a short training run
(``train_steps`` 40, so weights take seconds), the weights, and real synthetic tables from
``dsv41.engram.synthetic.write_synthetic_tables``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dsv41 import envs
from dsv41.errors import Dsv41Error
from dsv41.tokenizer import (BOS, COMPRESSED_VOCAB_SIZE, EOS, PAD, SEP, TOKEN_MAP, TOKEN_MAP_SHA256, ByteTokenizer,
                             build_token_map)

REPO = Path(__file__).resolve().parents[2]
LAB_CONFIG = REPO / "python" / "dsv41" / "data" / "lab_model.json"
PY = sys.executable


def lab_assets(tmp_path_factory, train_steps: int = 40, table_seed: int = 5) -> SimpleNamespace:
    """Config/weights/tables for the engine tests, built once per session (cached)."""
    base = tmp_path_factory.getbasetemp() / f"engine-assets-{train_steps}-{table_seed}"
    ns = SimpleNamespace(config=base / "lab.json", weights=base / "w.safetensors", data=base / "tables",
                         manifest=base / "tables" / "manifest.json")
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
    return [PY, "-m", "dsv41.cli", "engine", "serve", "--config", str(ns.config), "--weights", str(ns.weights),
            "--manifest", str(ns.manifest), "--data", str(ns.data), "--rank", str(rank), "--tp", str(tp),
            "--master", master, "--port", str(port), *extra]


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


def test_token_map_compresses_and_keeps_pad():
    assert TOKEN_MAP.dtype == np.int32 and TOKEN_MAP.shape == (260,)
    assert TOKEN_MAP[PAD] == PAD and TOKEN_MAP[BOS] == BOS and TOKEN_MAP[EOS] == EOS and TOKEN_MAP[SEP] == SEP
    assert COMPRESSED_VOCAB_SIZE == 229 == len(set(TOKEN_MAP.tolist()))
    tok = ByteTokenizer()
    a, b = tok.encode("Hello\tWorld"), tok.encode("hello world")
    assert a != b and TOKEN_MAP[a].tolist() == TOKEN_MAP[b].tolist()
    assert TOKEN_MAP[tok.encode("1")[0]] != TOKEN_MAP[tok.encode("2")[0]]
    assert np.array_equal(build_token_map(), TOKEN_MAP)  # deterministic
    assert len(TOKEN_MAP_SHA256) == 64


def test_token_map_matches_config_key():
    cfg = json.loads(LAB_CONFIG.read_text())
    assert cfg["engram_compressed_vocab_size"] == COMPRESSED_VOCAB_SIZE
    assert cfg["engram_pad_token_id"] == PAD


def test_tokenizer_roundtrip_and_incremental_utf8():
    tok = ByteTokenizer()
    text = "Grüße, 世界!"
    ids = tok.encode(text, bos=True)
    assert ids[0] == BOS and tok.decode(ids) == text
    dec = tok.incremental()
    out = "".join(dec.feed([t]) for t in ids) + dec.feed([], final=True)
    assert out == text
    with pytest.raises(Exception, match="outside the vocabulary"):
        tok.decode([260])


def test_chat_prompt_and_errors():
    tok = ByteTokenizer()
    ids = tok.chat_prompt([{"role": "user", "content": "hi"},
                           {"role": "user", "content": [{"type": "text", "text": "there"}]}])
    assert ids[0] == BOS and ids.count(SEP) == 3 and tok.decode(ids).endswith("assistant: ")
    for bad, frag in (([{"content": "x"}], "role"), ([{"role": "user"}], "content"),
                      ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"), (["x"], "role"),
                      ([{"role": "wizard", "content": "x"}], "not one of"), ([{"role": "user", "content": 5}], "content")):
        with pytest.raises(Dsv41Error, match=frag):
            tok.chat_prompt(bad)
