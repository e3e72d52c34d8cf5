"""Engine benchmark (``make bench``): the seed's headline in miniature.

1. Cold TTFT of a long prompt at TP2 with each rank's local O_DIRECT reader vs the remote table
   server (rank 0 over tcp://, rank 1 over nixl:// when NIXL imports, else tcp://). Before every
   local run the shards are evicted from the page cache (posix_fadvise DONTNEED). Three repeats
   each, mean +- sd; ratio remote/local from the same run.
2. Decode tok/s at TP2 (local reader): one stream, and three concurrent streams (aggregate),
   greedy with ignore_eos; ratio concurrent/single from the same run.

Prints one JSON line per measurement and a summary for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from benchutil import evict, machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from engineutil import PY, REPO, engine_env, free_ports, lab_assets, serve_cmd, start, stop, wait_ready  # noqa: E402

PROMPT_TOKENS = int(os.environ.get("DSV41_BENCH_PROMPT_TOKENS", "3072"))
DECODE_TOKENS = int(os.environ.get("DSV41_BENCH_DECODE_TOKENS", "96"))
DEVICE = os.environ.get("DSV41_BENCH_DEVICE", "cpu")  # cuda: rank r on cuda:r (NCCL)
REPEATS = 3


def _nixl_ok() -> bool:
    try:
        import nixl_cu12._api  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


class Pair:
    def __init__(self, assets, tmp: Path, env: dict, tag: str):
        self.port, mport = free_ports(2)
        master = f"127.0.0.1:{mport}"
        extra = ["--kv-cache-tokens", "16384", "--max-step-tokens", "512"]

        def dev(r):
            return ["--device", DEVICE if DEVICE == "cpu" else f"cuda:{r}"]

        self.r1 = start(
            serve_cmd(assets, rank=1, tp=2, master=master, extra=extra + dev(1)), env, tmp / f"{tag}-r1.log"
        )
        self.r0 = start(
            serve_cmd(assets, rank=0, tp=2, port=self.port, master=master, extra=extra + dev(0)),
            env,
            tmp / f"{tag}-r0.log",
        )
        self.url = f"http://127.0.0.1:{self.port}"
        wait_ready(self.port, self.r0, tmp / f"{tag}-r0.log")

    def close(self):
        stop(self.r0)
        stop(self.r1)


def ttft(url: str, prompt: list[int]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    first = None
    toks: list[int] = []
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        timeout=600,
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "return_token_ids": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"]
                if c and c[0].get("token_ids"):
                    if first is None:
                        first = time.perf_counter() - t0
                    toks += c[0]["token_ids"]
    return first, toks


def decode_rate(url: str, n_streams: int) -> float:
    """Aggregate generated tokens per second over ``n_streams`` concurrent greedy streams
    (time from the first token of the earliest stream to the last token of the latest)."""
    firsts, lasts, counts = [], [], []

    def one(i):
        prompt = f"Stream {i}: the quick dog "
        n, t_first, t_last = 0, None, None
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=600,
            json={
                "prompt": prompt,
                "max_tokens": DECODE_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            },
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"]
                    if c and c[0].get("token_ids"):
                        now = time.perf_counter()
                        t_first = t_first or now
                        t_last = now
                        n += len(c[0]["token_ids"])
        firsts.append(t_first)
        lasts.append(t_last)
        counts.append(n - 1)  # tokens after the first one

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n_streams)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(c == DECODE_TOKENS - 1 for c in counts)
    return sum(counts) / (max(lasts) - min(firsts))


def ms(xs):
    return f"{statistics.mean(xs) * 1000:.0f} +- {statistics.stdev(xs) * 1000:.0f} ms"


def test_engine_cold_ttft_and_decode(tmp_path_factory):
    assets = lab_assets(tmp_path_factory, train_steps=1, table_seed=11)
    tmp = tmp_path_factory.mktemp("bench-engine")
    from dsv41.engine.corpus import corpus_text
    from dsv41.tokenizer import ByteTokenizer

    prompt = ByteTokenizer().encode(corpus_text(99, PROMPT_TOKENS * 2))[:PROMPT_TOKENS]
    results = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "prompt_tokens": PROMPT_TOKENS,
        "device": DEVICE,
    }

    # --- local O_DIRECT reader, cold
    pair = Pair(assets, tmp, engine_env(), "local")
    try:
        ttft(pair.url, prompt[:64])  # warm the code paths (not the rows of the long prompt)
        local, ref = [], None
        for _ in range(REPEATS):
            evict(sorted(assets.data.glob("*.safetensors")))
            t, toks = ttft(pair.url, prompt)
            local.append(t)
            ref = ref or toks
            assert toks == ref
        single = decode_rate(pair.url, 1)
        conc = decode_rate(pair.url, 3)
    finally:
        pair.close()

    # --- remote table server (tables resident in its RAM)
    ready = tmp / "ready.json"
    cmd = [
        PY,
        "-m",
        "dsv41.cli",
        "engram",
        "serve",
        "--manifest",
        str(assets.manifest),
        "--data",
        str(assets.data),
        "--listen",
        "tcp://127.0.0.1:0",
        "--ready-file",
        str(ready),
    ]
    nixl = _nixl_ok()
    if nixl:
        cmd += ["--listen", "nixl://127.0.0.1:0"]
    srv = subprocess.Popen(
        cmd, env=engine_env(), stdout=open(tmp / "tables.log", "wb"), stderr=subprocess.STDOUT, cwd=str(REPO)
    )
    try:
        t0 = time.monotonic()
        while not ready.exists():
            assert srv.poll() is None and time.monotonic() - t0 < 120, (tmp / "tables.log").read_text()
            time.sleep(0.05)
        time.sleep(0.05)
        urls = json.loads(ready.read_text())["listen"]
        tcp = next(u for u in urls if u.startswith("tcp://"))
        nx = next((u for u in urls if u.startswith("nixl://")), tcp)
        env = engine_env(DSV41_ENGRAM_REMOTE=f"{tcp},{nx}", DSV41_ENGRAM_REMOTE_TIMEOUT_MS="1000")
        pair = Pair(assets, tmp, env, "remote")
        try:
            ttft(pair.url, prompt[:64])
            remote = []
            for _ in range(REPEATS):
                evict(sorted(assets.data.glob("*.safetensors")))  # the engine's local fallback stays cold too
                t, toks = ttft(pair.url, prompt)
                remote.append(t)
                assert toks == ref  # remote rows are byte-identical
            m = httpx.get(pair.url + "/metrics").text
            assert (
                'dsv41_engram_fallbacks_total{rank="0"} 0.0' in m and 'dsv41_engram_fallbacks_total{rank="1"} 0.0' in m
            )
        finally:
            pair.close()
    finally:
        srv.send_signal(signal.SIGTERM)
        srv.wait(30)

    results.update(
        {
            "ttft_local_s": local,
            "ttft_remote_s": remote,
            "ttft_remote_over_local": statistics.mean(remote) / statistics.mean(local),
            "rank1_transport": "nixl" if nixl else "tcp",
            "decode_single_tok_s": single,
            "decode_3conc_tok_s": conc,
            "decode_3conc_over_single": conc / single,
        }
    )
    print(json.dumps(results))
    print(
        f"\nEngine TP2 ({DEVICE}), {PROMPT_TOKENS}-token prompt, cold TTFT: local O_DIRECT {ms(local)}, remote {ms(remote)} "
        f"(remote/local {results['ttft_remote_over_local']:.3f}); decode single {single:.1f} tok/s, "
        f"3 concurrent {conc:.1f} tok/s aggregate (x{conc / single:.2f}); {results['machine']}"
    )
