"""TP2 over torch.distributed (gloo): rank 1 headless worker started first, rank 0 API head.
Greedy TP2 == TP1, Engram counters on both ranks, drain on rank 1's SIGTERM, rank 1 death."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from dsv41.engine.runner import LocalRunner  # noqa: E402
from dsv41.tokenizer import ByteTokenizer  # noqa: E402
from engineutil import lab_assets, local_rows, start_pair, stop  # noqa: E402

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return lab_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def pair(assets, tmp_path_factory):
    p = start_pair(assets, tmp_path_factory.mktemp("tp2"), extra=["--max-step-tokens", "64"])
    try:
        yield p
    finally:
        stop(p["r0"], signal.SIGKILL)
        stop(p["r1"], signal.SIGKILL)


def metric_values(url):
    vals = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            vals[k] = float(v)
    return vals


def test_tp2_greedy_identical_to_tp1(pair, assets):
    ref = LocalRunner(assets.config, assets.weights, local_rows(assets))
    long_prompt = "Every tiny tree opens this cold cat. " * 6  # > one 64-token prefill chunk
    prompts = ["The quick dog ", "count 3 4 5", long_prompt]
    want = [ref.generate(TOK.encode(p), 20).tokens for p in prompts]
    got = [None] * len(prompts)

    def one(i):
        r = httpx.post(
            pair["url"] + "/v1/completions",
            json={"prompt": prompts[i], "max_tokens": 20, "temperature": 0, "return_token_ids": True},
            timeout=120,
        )
        got[i] = r.json()["choices"][0]["token_ids"]

    before = metric_values(pair["url"])
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert got == want
    after = metric_values(pair["url"])
    # Engram lookups counted on both ranks; each rank read half of every token's 24 columns
    for rank in ("0", "1"):
        k = f'dsv41_engram_rows_total{{rank="{rank}"}}'
        assert after[k] > before.get(k, 0)
        assert after[f'dsv41_engram_fallbacks_total{{rank="{rank}"}}'] == 0
    assert after['dsv41_engram_rows_total{rank="0"}'] == after['dsv41_engram_rows_total{rank="1"}']


def test_rank1_sigterm_drains_both_ranks(pair):
    """Last test on the shared pair: SIGTERM on the worker drains the head, both exit 0."""
    out, first = {}, threading.Event()

    def stream():
        chunks = []
        with httpx.stream(
            "POST",
            pair["url"] + "/v1/completions",
            timeout=120,
            json={"prompt": "The dog ", "max_tokens": 50, "temperature": 0, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()
        out["chunks"] = chunks

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    pair["r1"].send_signal(signal.SIGTERM)
    t.join(60)
    assert out["chunks"][-1]["choices"][0]["finish_reason"] == "length"
    assert pair["r0"].wait(30) == 0, (pair["dir"] / "rank0.log").read_text()[-2000:]
    assert pair["r1"].wait(30) == 0, (pair["dir"] / "rank1.log").read_text()[-2000:]


@pytest.mark.parametrize("victim", ["r1", "r0"])
def test_peer_death_ends_the_other_rank_with_clear_error(assets, tmp_path, victim):
    p = start_pair(assets, tmp_path)
    survivor = "r0" if victim == "r1" else "r1"
    rank = "0" if survivor == "r0" else "1"
    try:
        p[victim].kill()
        rc = p[survivor].wait(60)
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert rc == 1, log
        assert f"dsv41: error: rank {rank}: lost the TP peer" in log
        assert "Traceback" not in log
    finally:
        stop(p["r0"], signal.SIGKILL)
        stop(p["r1"], signal.SIGKILL)
