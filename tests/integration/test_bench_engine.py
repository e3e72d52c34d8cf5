"""The bench client against the lab engine (TP1, a real server process on loopback): the `openai`
package and the bench client stream the same greedy text; the client's TTFT and step gaps agree
with the engine's own /metrics histograms; the smoke start; `dsv41 bench run` end to end, its
Ctrl-C path, and /pause modes as in vLLM 0.33.0."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from labutil import post as lab_post  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from dsv41.cli import main  # noqa: E402
from dsv41.harness import bench  # noqa: E402
from engineutil import engine_env, free_port, lab_assets, serve_cmd, start, stop, wait_ready  # noqa: E402

MODEL = "dsv41-lab"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    assets = lab_assets(tmp_path_factory)
    port = free_port()
    log = tmp_path_factory.mktemp("srv") / "rank0.log"
    proc = start(
        serve_cmd(assets, port=port, extra=["--kv-cache-tokens", "2048", "--max-step-tokens", "128"]), engine_env(), log
    )
    try:
        wait_ready(port, proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, signal.SIGKILL)


def test_openai_package_and_bench_client_agree(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Every green lamp",
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"min_tokens": 16, "return_token_ids": True},
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 16
    with httpx.Client(timeout=60) as c:
        r = bench.stream_one(
            c,
            server,
            bench.request_body(MODEL, "Every green lamp", 0, 16, {"temperature": 0.0}, uuid.uuid4().hex),
            "p",
            "short",
        )
    assert r.ok, r.error
    assert r.completion_tokens == 16 and len(r.token_ids) == 16 and r.finish_reason == "length"
    assert r.steps == 16 and r.tokens_per_step == pytest.approx(1.0)  # no speculation: one token per step
    ids_text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert ids_text == text and text  # same greedy output through both clients


def _hist(delta: dict, name: str) -> tuple[float, float]:
    return delta[f"{name}_sum"], delta[f"{name}_count"]


def test_client_timing_agrees_with_engine_histograms(server):
    """Bound (stated in docs/windows.md): over 12 sequential requests, the client's mean TTFT is
    no lower than the engine's (it wraps it) and at most 25 ms + 30 % above it (HTTP, SSE
    delivery, a loaded 2-core host); the mean step gap agrees with the engine's mean inter-token
    latency within 3 ms + 25 %."""
    spec = {
        "sampler": {"temperature": 1.0, "top_p": 1.0},
        "prompts": [],
        "repeats": 1,
        "seed": 10,
        "cache_salt": True,
        "unique_prefix": False,
        "max_tokens": 24,
    }
    spec["prompts"] = [{"id": f"p{i}", "category": "short", "text": f"The table {i} answers"} for i in range(12)]
    items = bench.plan_requests(spec, "agree")
    url = server + "/metrics"
    before = bench.snapshot_metrics([url])
    res = bench.run_requests(server, MODEL, items, spec["sampler"], 1, 60)
    delta = bench.metrics_delta(before, bench.snapshot_metrics([url]))[url]
    assert all(r.ok for r in res), [r.error for r in res if not r.ok]
    ttft_sum, ttft_n = _hist(delta, "vllm:time_to_first_token_seconds")
    itl_sum, itl_n = _hist(delta, "vllm:inter_token_latency_seconds")
    assert ttft_n == 12 and itl_n == sum(len(r.step_ms) for r in res) == 12 * 23
    assert delta["vllm:generation_tokens_total"] == sum(r.completion_tokens for r in res) == 12 * 24
    eng_ttft, cli_ttft = 1e3 * ttft_sum / ttft_n, sum(r.ttft_ms for r in res) / 12
    eng_step = 1e3 * itl_sum / itl_n
    cli_step = sum(sum(r.step_ms) for r in res) / itl_n
    print(
        f"TTFT client {cli_ttft:.2f} ms engine {eng_ttft:.2f} ms; step client {cli_step:.2f} ms engine {eng_step:.2f} ms"
    )
    assert eng_ttft - 1.0 <= cli_ttft <= eng_ttft * 1.3 + 25.0
    assert abs(cli_step - eng_step) <= 3.0 + 0.25 * eng_step


def test_smoke_start(server, tmp_path):
    s = bench.smoke(server, MODEL)
    assert s["canary"]["tokens"] > 0 and s["greedy"]["against"] == "repeat"
    from dsv41.harness import refs

    doc = refs.run_prompts(server, MODEL, 8, bench.greedy_prompts(env={})[:1])
    assert bench.smoke(server, MODEL, doc)["greedy"]["against"] == "refs"
    doc["prompts"][0]["token_ids"][3] ^= 1
    with pytest.raises(bench.BenchAborted, match="differs from its recorded reference at token 3"):
        bench.smoke(server, MODEL, doc)


def _small_spec(tmp_path, **kw):
    doc = {
        "format": "dsv41-bench-spec/1",
        "name": "small",
        "max_tokens": 12,
        "repeats": 2,
        "concurrency": 2,
        "prompts": [
            {"id": "a", "category": "short", "text": "row row row"},
            {"id": "b", "category": "long", "generate": {"words": 60, "seed": 3}},
        ],
        **kw,
    }
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(doc))
    return str(p)


def test_bench_run_cli(server, tmp_path, capsys):
    out = tmp_path / "res.jsonl"
    rc = main(["bench", "run", "--endpoint", server, "--spec", _small_spec(tmp_path), "--out", str(out), "--json"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["all"]["requests"] == 4 and doc["summary"]["all"]["failed"] == 0
    assert doc["summary"]["long"]["step_ms_p50"] > 0
    url = server + "/metrics"
    assert doc["metrics_delta"][url]["vllm:generation_tokens_total"] == 4 * 12
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4 and {r["prompt_id"] for r in rows} == {"a", "b"} and all(r["ok"] for r in rows)
    assert len({r["seed"] for r in rows}) == 4


def test_bench_run_ctrl_c_is_a_failure(server, tmp_path, capsys, monkeypatch):
    real = bench.stream_one
    calls = []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 5:  # canary, greedy twice, request 1, then Ctrl-C in request 2
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(bench, "stream_one", interrupted)
    out = tmp_path / "res.jsonl"
    rc = main(
        [
            "bench",
            "run",
            "--endpoint",
            server,
            "--spec",
            _small_spec(tmp_path, concurrency=1),
            "--out",
            str(out),
            "--no-metrics",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 130 and "interrupted after 1 of 4 requests" in err and "Traceback" not in err
    assert len(out.read_text().splitlines()) == 1


def test_pause_modes_match_vllm(server):
    """vLLM 0.33.0: POST /pause?mode=abort (default) | wait | keep; 503 for new requests while
    paused; wait drains in-flight requests, bounded by timeout_s then aborts them (counted)."""
    body = {"model": MODEL, "prompt": "slow one", "max_tokens": 400, "min_tokens": 400, "stream": True}

    def stream_in_background(result):
        try:
            with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
                result["status"] = r.status_code
                result["text"] = "".join(r.iter_lines())
        except httpx.HTTPError as exc:
            result["exc"] = exc

    def started(result):
        t = threading.Thread(target=stream_in_background, args=(result,))
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = bench.parse_metrics(httpx.get(server + "/metrics").text)
            if m.get("vllm:generation_tokens_total", 0) > started.seen:
                started.seen = m["vllm:generation_tokens_total"]
                return t
            time.sleep(0.02)
        raise AssertionError("request did not start")

    started.seen = bench.parse_metrics(httpx.get(server + "/metrics").text).get("vllm:generation_tokens_total", 0)
    try:
        # default mode = abort: the in-flight request ends with an error, at once
        res: dict = {}
        t = started(res)
        r = lab_post(server + "/pause", timeout=60)
        assert r.status_code == 200 and r.json()["mode"] == "abort" and r.json()["aborted"] == 1
        t.join(60)
        assert res["status"] == 200 and "[DONE]" in res["text"]
        new = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert new.status_code == 503
        lab_post(server + "/resume", timeout=30)
        # wait with a short bound: drains, then aborts what is left and says how many
        res = {}
        t = started(res)
        r = lab_post(server + "/pause?mode=wait&timeout_s=0.2", timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["mode"] == "wait" and r.json()["aborted_after_timeout"] == 1
        t.join(60)
        m = bench.parse_metrics(httpx.get(server + "/metrics").text)
        assert m["dsv41_engine_pause_drain_aborts_total"] == 1
        lab_post(server + "/resume", timeout=30)
        # keep: admission closed, the in-flight request frozen in place, finishing after /resume
        res = {}
        t = started(res)
        r = lab_post(server + "/pause?mode=keep", timeout=60)
        assert r.status_code == 200 and r.json()["mode"] == "keep" and r.json()["aborted"] == 0
        held = httpx.get(server + "/is_paused").json()
        assert held["is_paused"] is True and held["paused_since"] <= time.time()
        time.sleep(0.3)  # a step already under way may still emit
        frozen_at = bench.parse_metrics(httpx.get(server + "/metrics").text)["vllm:generation_tokens_total"]
        time.sleep(1.0)
        assert bench.parse_metrics(httpx.get(server + "/metrics").text)["vllm:generation_tokens_total"] == frozen_at
        assert t.is_alive()
        lab_post(server + "/resume", timeout=30)
        t.join(120)
        assert '"finish_reason": "length"' in res["text"]
        assert lab_post(server + "/pause?mode=later", timeout=30).status_code == 400
    finally:
        lab_post(server + "/resume", timeout=30)


def _window_spec(tmp_path):
    doc = {
        "format": "dsv41-bench-spec/1",
        "name": "w",
        "max_tokens": 8,
        "blocks_per_prompt": 2,
        "seed": 7,
        "prompts": [
            {"id": "a", "category": "short", "text": "row row row"},
            {"id": "b", "category": "code", "text": "def f(x):\n"},
        ],
    }
    p = tmp_path / "wspec.json"
    p.write_text(json.dumps(doc))
    return str(p)


def test_window_run_aa_cli(server, tmp_path, capsys):
    wd = tmp_path / "windows"
    args = [
        "window",
        "run",
        "--control",
        server,
        "--candidate",
        server,
        "--spec",
        _window_spec(tmp_path),
        "--windows-dir",
        str(wd),
        "--name",
        "aa",
        "--seed",
        "3",
    ]
    assert main(args + ["--id", "w1", "--json", "--drafting"]) == 0, capsys.readouterr().err
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] in ("NO-CHANGE", "UNRESOLVED") and d["n_pairs"] == 8, d["reasons"]
    # the same engine on both arms: greedy outputs identical, lengths equal -> the gate passes
    assert d["gate"]["passed"], d["gate"]["reasons"]
    assert {k for k in d["gate"]["prompts"] if k.startswith("greedy:")} == {
        "greedy:" + n for n, _ in bench.greedy_prompts(env={})
    }
    for f in ("cells.jsonl", "decision.json", "summary.md", "pairs.png", "cdf.png", "acceptance.png"):
        assert (wd / "w1" / f).stat().st_size > 0
    cells = [json.loads(x) for x in (wd / "w1" / "cells.jsonl").read_text().splitlines()]
    assert len(cells) == 16 and all(c["ok"] and c["completion_tokens"] == 8 for c in cells)
    state = json.loads((wd / "questions.json").read_text())
    assert state["aa:step_ms_p50"][0]["window"] == "w1"
    assert main(args + ["--id", "w1", "--no-cap"]) == 1
    assert "already has cells" in capsys.readouterr().err


def test_window_run_ctrl_c_is_invalid(server, tmp_path, capsys, monkeypatch):
    real = bench.stream_one
    calls = []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 9:  # smoke: 3 requests per arm; then two cells, then Ctrl-C
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(bench, "stream_one", interrupted)
    wd = tmp_path / "windows"
    rc = main(
        [
            "window",
            "run",
            "--control",
            server,
            "--candidate",
            server,
            "--spec",
            _window_spec(tmp_path),
            "--windows-dir",
            str(wd),
            "--id",
            "w2",
            "--no-cap",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 130 and "interrupted" in err and "Traceback" not in err
    assert len((wd / "w2" / "cells.jsonl").read_text().splitlines()) == 2
    assert json.loads((wd / "w2" / "decision.json").read_text())["decision"]["verdict"] == "INVALID"


def test_window_run_unreachable_no_window(tmp_path, capsys):
    wd = tmp_path / "windows"
    rc = main(
        [
            "window",
            "run",
            "--control",
            "http://127.0.0.1:9",
            "--candidate",
            "http://127.0.0.1:9",
            "--windows-dir",
            str(wd),
            "--id",
            "w3",
            "--no-cap",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "cannot list models at http://127.0.0.1:9" in err and len(err.strip().splitlines()) == 1
