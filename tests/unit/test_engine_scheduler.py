"""Continuous-batching scheduler (FIFO, running bound, KV budget, chunked prefill) and the
``dsv41 engine`` command line's failure paths."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
from types import SimpleNamespace

import pytest

from dsv41.engine.sampler import SamplingParams
from dsv41.engine.scheduler import Request, RequestError, Scheduler
from dsv41.errors import Dsv41Error
from engineutil import LAB_CONFIG, PY, REPO, lab_assets


def req(n_prompt, max_tokens=4):
    return Request(
        prompt=list(range(4, 4 + n_prompt)), params=SamplingParams(max_tokens=max_tokens), sink=lambda e: None
    )


def test_fifo_running_bound_and_kv_budget():
    s = Scheduler(kv_cache_tokens=100, max_model_len=1000, max_running=2, max_step_tokens=1000)
    a, b, c, d = req(10), req(10), req(10), req(60)
    for r in (a, b, c, d):
        s.add(r)
    assert s.admit() == [a, b] and s.counts() == (2, 2)  # running bound
    s.release(a)
    assert s.admit() == [c]
    s.release(b)
    assert s.admit() == [d]  # 10+4+1 = 15 reserved by c, d needs 65 of the remaining 85
    assert s.reserved == s.reservation(c) + s.reservation(d) == 80
    e = req(10)
    s.add(e)
    s.release(c)
    assert s.admit() == [e]


def test_kv_budget_blocks_head_of_line():
    s = Scheduler(kv_cache_tokens=100, max_model_len=1000, max_running=8, max_step_tokens=1000)
    big, small = req(50, 40), req(2, 2)  # 91 and 5 tokens
    s.add(req(10, 10))
    s.add(big)
    s.add(small)
    first = s.admit()
    assert len(first) == 1  # big does not fit beside the first; small may not overtake (FIFO)
    s.release(first[0])
    assert s.admit() == [big, small]  # 91 + 5 <= 100
    assert s.reserved == 96


def test_too_long_and_empty_requests_refused():
    s = Scheduler(kv_cache_tokens=64, max_model_len=48, spec_depth=5)
    with pytest.raises(RequestError, match="at most 48"):
        s.add(req(40, 10))
    with pytest.raises(RequestError, match="empty"):
        s.add(req(0))
    s2 = Scheduler(kv_cache_tokens=32, max_model_len=1000, spec_depth=5)
    with pytest.raises(RequestError, match="at most 26"):
        s2.check(20, 10)
    with pytest.raises(Dsv41Error):
        Scheduler(kv_cache_tokens=4, max_model_len=10)


def test_plan_decodes_first_then_chunked_prefill():
    s = Scheduler(kv_cache_tokens=10000, max_model_len=10000, max_running=8, max_step_tokens=40)
    dec = req(5)
    dec.fed, dec.pending, dec.drafts = 5, 9, [7, 8]
    p1, p2 = req(30), req(30)
    for r in (dec, p1, p2):
        s.add(r)
    s.admit()
    items = s.plan().items
    assert items[0] == (dec, [9, 7, 8], [0, 1, 2])
    assert items[1][0] is p1 and len(items[1][1]) == 30 and items[1][2] == [29]  # finishes its prompt
    assert items[2][0] is p2 and len(items[2][1]) == 7 and items[2][2] == []  # budget 40-3-30
    p1.fed = 30
    p2.fed = 7
    p2.pending = None
    items = s.plan().items
    assert [(r, len(t)) for r, t, _ in items] == [(dec, 3), (p2, 23)]  # p1 has no pending token yet


def test_take_waiting_for_abort():
    s = Scheduler(kv_cache_tokens=100, max_model_len=100, max_running=1)
    a, b = req(3), req(3)
    s.add(a)
    s.add(b)
    s.admit()
    assert s.take_waiting() == [b] and s.counts() == (1, 0)


# ------------------------------------------------------------------------------ CLI


def run_cli(*args):
    """``dsv41 engine ARGS`` in this process (``dsv41.cli.main``): returncode, stdout, stderr."""
    from dsv41.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["engine", *args])
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_entry_point_subprocess():
    r = subprocess.run(
        [PY, "-m", "dsv41.cli", "engine", "serve", "--manifest", "/nonexistent/m.json"],
        capture_output=True,
        text=True,
        cwd=str(REPO),
        timeout=300,
    )
    assert r.returncode == 1 and r.stderr.strip() == (
        "dsv41: error: weights file weights.safetensors does not exist (run `dsv41 engine init-weights`)"
    )


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return lab_assets(tmp_path_factory)


def test_cli_generate_identity_and_errors(assets, tmp_path):
    r = run_cli(
        "generate",
        "--prompt",
        "The cat ",
        "--config",
        str(assets.config),
        "--weights",
        str(assets.weights),
        "--manifest",
        str(assets.manifest),
        "--data",
        str(assets.data),
        "--max-tokens",
        "5",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 5 and out["counters"]["lookups"] > 0
    r = run_cli("identity", "--config", str(assets.config), "--weights", str(assets.weights))
    assert r.returncode == 0 and len(r.stdout.strip()) == 64
    bad = [
        (("identity", "--config", str(assets.config), "--weights", str(tmp_path / "x")), "cannot read"),
        (
            (
                "serve",
                "--manifest",
                str(tmp_path / "m.json"),
                "--config",
                str(assets.config),
                "--weights",
                str(assets.weights),
            ),
            "does not exist",
        ),
        (
            (
                "serve",
                "--manifest",
                str(assets.manifest),
                "--config",
                str(assets.config),
                "--weights",
                str(assets.weights),
                "--tp",
                "3",
            ),
            "--tp must be 1 or 2",
        ),
        (
            (
                "serve",
                "--manifest",
                str(assets.manifest),
                "--config",
                str(assets.config),
                "--weights",
                str(assets.weights),
                "--device",
                "tpu",
            ),
            "--device",
        ),
        (
            (
                "serve",
                "--manifest",
                str(assets.manifest),
                "--config",
                str(assets.config),
                "--weights",
                str(assets.weights),
                "--tp",
                "2",
                "--rank",
                "2",
            ),
            "--rank must be in [0, 2)",
        ),
        (
            (
                "serve",
                "--manifest",
                str(assets.manifest),
                "--data",
                str(assets.data),
                "--config",
                str(assets.config),
                "--weights",
                str(assets.weights),
                "--tp",
                "2",
                "--rank",
                "1",
                "--master",
                "nohost",
            ),
            "ADDR:PORT",
        ),
        (
            (
                "serve",
                "--manifest",
                str(assets.manifest),
                "--config",
                str(assets.config),
                "--weights",
                str(tmp_path / "none.safetensors"),
            ),
            "init-weights",
        ),
        (
            (
                "generate",
                "--prompt",
                "x",
                "--manifest",
                str(assets.manifest),
                "--config",
                str(LAB_CONFIG),
                "--weights",
                str(assets.weights),
                "--max-tokens",
                "-2",
            ),
            "max_tokens",
        ),
        (
            (
                "serve",
                "--manifest",
                str(assets.manifest),
                "--data",
                str(tmp_path / "nodata"),
                "--config",
                str(assets.config),
                "--weights",
                str(assets.weights),
            ),
            "is not a directory",
        ),
        (
            ("init-weights", "--config", str(assets.config), "--out", str(tmp_path / "no" / "w.safetensors")),
            "does not exist",
        ),
        (("init-weights", "--config", str(assets.config), "--out", str(tmp_path)), "is a directory"),
    ]
    for args, frag in bad:
        r = run_cli(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert frag in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert [ln for ln in r.stderr.splitlines() if ln.startswith("dsv41: error:")], r.stderr


def test_cli_init_weights(tmp_path):
    cfg = json.loads(LAB_CONFIG.read_text())
    cfg["train_steps"] = 1
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    r = run_cli("init-weights", "--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "w.safetensors"))
    assert r.returncode == 0, r.stderr
    path, ident = r.stdout.split()
    assert path == str(tmp_path / "w.safetensors") and len(ident) == 64
    (tmp_path / "bad.json").write_text("{}")
    r = run_cli("init-weights", "--config", str(tmp_path / "bad.json"), "--out", str(tmp_path / "w2.safetensors"))
    assert r.returncode == 1 and "lacks Engram keys" in r.stderr  # engram.config reads the file first


def test_cli_serve_port_in_use_is_one_line(assets):
    """uvicorn sys.exit()s when it cannot bind; the CLI turns that into one error line, exit 1."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run(
            [
                PY,
                "-m",
                "dsv41.cli",
                "engine",
                "serve",
                "--manifest",
                str(assets.manifest),
                "--data",
                str(assets.data),
                "--config",
                str(assets.config),
                "--weights",
                str(assets.weights),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            cwd=str(REPO),
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"dsv41: error: could not listen on 127.0.0.1:{port}"), r.stderr
    assert "Traceback" not in r.stderr
