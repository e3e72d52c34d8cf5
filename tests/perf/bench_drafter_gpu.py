"""Benchmark (CUDA only; skipped elsewhere): drafter round latency for k = 1..7 with and
without CUDA graphs, torch backend, on the lab drafter shape and a production-shaped one
(hidden 4096, vocab 129280, d_model 2048, three layers, Markov rank 256; random weights - latency
does not depend on the values). Two views: the backend alone (``TorchDrafter.draft``, host
arrays in, host arrays out, so it includes the copies and the sync) and a full TCP round through
an in-process worker on loopback (``DrafterClient.round``). Median and p90 of ``ITERS`` rounds
after warm-up (graph capture happens in the warm-up). Results printed and written to
``$DSV41_BENCH_OUT`` (or ``$OUT/drafter_gpu.json`` on the device machine).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv41.drafter.client import DrafterClient
from dsv41.drafter.model import TorchDrafter, random_drafter
from dsv41.drafter.protocol import Round, RoundItem
from dsv41.drafter.worker import DrafterWorker

ITERS = int(os.environ.get("DSV41_BENCH_ITERS", "200"))
SHAPES = {
    "lab": dict(vocab_size=260, hidden_size=128, d_model=96, n_layers=3, markov_rank=32),
    "prod": dict(vocab_size=129280, hidden_size=4096, d_model=2048, n_layers=3, markov_rank=256),
}


def _items(cfg, b, k, rng):
    return [
        RoundItem(
            f"r{i}",
            rng.integers(0, cfg["vocab_size"], 64),
            rng.standard_normal(cfg["hidden_size"]).astype(np.float32),
            k,
        )
        for i in range(b)
    ]


def _time(fn, iters):
    for _ in range(10):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1000)
    ts.sort()
    return round(statistics.median(ts), 4), round(ts[int(0.9 * len(ts)) - 1], 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_drafter_gpu_round_latency(tmp_path):
    rng = np.random.default_rng(0)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "iters": ITERS, "rows": []}
    for shape, cfg in SHAPES.items():
        d = tmp_path / shape
        random_drafter(d, seed=1, **cfg)
        drafters = {g: TorchDrafter(d, device="cuda", cuda_graphs=g) for g in (False, True)}
        for b in (1, 4):
            for k in range(1, 8):
                items = _items(cfg, b, k, rng)
                ref = drafters[False].draft(items)
                got = drafters[True].draft(items)
                same = all(np.array_equal(x, y) for x, y in zip(ref.tokens, got.tokens, strict=False))
                for g, dr in drafters.items():
                    p50, p90 = _time(lambda dr=dr, items=items: dr.draft(items), ITERS)
                    out["rows"].append(
                        {
                            "shape": shape,
                            "view": "backend",
                            "batch": b,
                            "k": k,
                            "cuda_graphs": g,
                            "p50_ms": p50,
                            "p90_ms": p90,
                            "graph_tokens_equal_eager": same,
                        }
                    )
        # full TCP round on loopback, batch 1, through the worker
        for g, dr in drafters.items():
            w = DrafterWorker(dr)
            w.start()
            try:
                c = DrafterClient(f"tcp://127.0.0.1:{w.address[1]}", {}, timeout_ms=5000)
                for k in range(1, 8):
                    r = Round(_items(cfg, 1, k, rng), cfg["hidden_size"])
                    p50, p90 = _time(lambda c=c, r=r: c.round(r), ITERS)
                    out["rows"].append(
                        {
                            "shape": shape,
                            "view": "tcp_round",
                            "batch": 1,
                            "k": k,
                            "cuda_graphs": g,
                            "p50_ms": p50,
                            "p90_ms": p90,
                        }
                    )
                c.close()
            finally:
                w.stop()
        del drafters
        torch.cuda.empty_cache()
    text = json.dumps(out, indent=1)
    print(text)
    dest = os.environ.get("DSV41_BENCH_OUT") or (
        os.environ.get("OUT") and str(Path(os.environ["OUT"]) / "drafter_gpu.json")
    )
    if dest:
        Path(dest).write_text(text)
    assert all(r.get("graph_tokens_equal_eager", True) for r in out["rows"])
