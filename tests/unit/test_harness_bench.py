"""Bench client without a server: spec loading and its errors, the greedy prompts file, SSE
timing on a scripted stream (httpx.MockTransport + a fake clock), Prometheus snapshots and deltas."""

from __future__ import annotations

import json

import httpx
import pytest

from dsv41.cli import main
from dsv41.harness import bench
from dsv41.harness.refs import PROMPTS
from serverutil import completion_chunk, sse


def test_default_spec_is_valid_and_public():
    sp = bench.load_spec(env={})
    assert sp["source"].endswith("bench_spec.json") and sp["name"] == "public-default"
    assert {p["category"] for p in sp["prompts"]} >= {"short", "code"}
    # generated prompts are deterministic per seed
    gen = [p for p in sp["prompts"] if "generate" in p][0]
    assert bench.prompt_text(gen) == bench.prompt_text(gen)
    assert len(bench.prompt_text(gen).split()) == gen["generate"]["words"]


def _spec(tmp_path, doc, name="spec.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(p)


GOOD = {
    "format": "dsv41-bench-spec/1",
    "name": "t",
    "prompts": [{"id": "a", "category": "short", "text": "hi"}],
    "max_tokens": 8,
}


def test_spec_from_env_and_defaults(tmp_path):
    path = _spec(tmp_path, GOOD)
    sp = bench.load_spec(env={"DSV41_BENCH_SPEC_FILE": path})
    assert sp["source"] == path and sp["concurrency"] == 1 and sp["sampler"]["temperature"] == 1.0
    assert bench.load_spec(path, env={"DSV41_BENCH_SPEC_FILE": "/nonexistent"})["name"] == "t"


@pytest.mark.parametrize(
    "doc,msg",
    [
        ("{bad", "is not JSON"),
        ({**GOOD, "format": "x"}, "schema at format"),
        ({**GOOD, "prompts": []}, "schema at prompts"),
        ({**GOOD, "prompts": [{"id": "a", "category": "s"}]}, "schema at prompts/0"),
        (
            {**GOOD, "prompts": [{"id": "a", "category": "s", "text": "x", "generate": {"words": 3, "seed": 1}}]},
            "schema at prompts/0",
        ),
        ({**GOOD, "max_tokens": 0}, "schema at max_tokens"),
        ({**GOOD, "extra": 1}, "schema at (top)"),
        ({**GOOD, "prompts": [GOOD["prompts"][0], GOOD["prompts"][0]]}, "appears more than once"),
    ],
)
def test_bad_specs(tmp_path, doc, msg):
    with pytest.raises(bench.BenchError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        bench.load_spec(_spec(tmp_path, doc))


def test_missing_spec_cli_one_line(tmp_path, capsys):
    rc = main(["bench", "run", "--endpoint", "http://127.0.0.1:9", "--spec", str(tmp_path / "none.json")])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot read bench spec" in err and len(err.strip().splitlines()) == 1


def test_unreachable_endpoint_cli_one_line(tmp_path, capsys):
    # 198.18.0.0/15 is the lab's blackholed range; port 9 on loopback refuses at once.
    rc = main(["bench", "run", "--endpoint", "http://127.0.0.1:9", "--spec", _spec(tmp_path, GOOD)])
    err = capsys.readouterr().err
    assert (
        rc == 1
        and "cannot list models at http://127.0.0.1:9" in err
        and "Traceback" not in err
        and len(err.strip().splitlines()) == 1
    )


def test_greedy_prompts_file(tmp_path):
    assert bench.greedy_prompts(env={}) == PROMPTS
    p = tmp_path / "g.json"
    p.write_text(json.dumps([{"name": f"n{i}", "prompt": f"p {i}"} for i in range(6)]))
    got = bench.greedy_prompts(env={"DSV41_GREEDY_PROMPTS_FILE": str(p)})
    assert got[0] == ("n0", "p 0") and len(got) == 6
    for bad in ([], [{"name": "a"}], [{"name": "a", "prompt": "x"}, {"name": "a", "prompt": "y"}]):
        p.write_text(json.dumps(bad))
        with pytest.raises(bench.BenchError, match="greedy prompts file"):
            bench.greedy_prompts(env={"DSV41_GREEDY_PROMPTS_FILE": str(p)})


class FakeClock:
    """perf_counter stand-in: each call advances by the next step of ``steps`` (seconds)."""

    def __init__(self, steps):
        self.t, self.steps = 0.0, list(steps)

    def __call__(self):
        if self.steps:
            self.t += self.steps.pop(0)
        return self.t


def _client(body: bytes, status=200):
    return httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(status, content=body)))


def test_stream_timing_tokens_per_step_and_tok_s():
    # prefill chunk (1 token), then three verify steps of 3, 1, 4 tokens; final usage chunk.
    events = [
        completion_chunk([1], completion=1),
        completion_chunk([2, 3, 4], completion=4),
        completion_chunk([5], completion=5),
        completion_chunk([6, 7, 8, 9], "length", completion=9),
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}},
        "[DONE]",
    ]
    # clock reads: t0, then one read per SSE line (events + blank separators), then t_end
    clock = FakeClock([0.0, 0.050] + [0.0] + [0.020, 0.0] * 2 + [0.030, 0.0] + [0.0] * 10)
    body = bench.request_body("m", "p", 7, 9, {"temperature": 1.0}, "salt")
    assert body["min_tokens"] == body["max_tokens"] == 9 and body["cache_salt"] == "salt" and body["seed"] == 7
    with _client(sse(events)) as c:
        r = bench.stream_one(c, "http://x", body, "a", "short", clock=clock)
    assert r.ok, r.error
    assert r.ttft_ms == pytest.approx(50.0)
    assert r.steps == 4 and len(r.step_ms) == 3
    assert r.step_ms == pytest.approx([20.0, 20.0, 30.0])
    assert r.step_ms_p50 == pytest.approx(20.0)
    assert r.completion_tokens == 9 and r.tokens_per_step == pytest.approx(8 / 3)
    assert r.tok_s == pytest.approx(8 / 0.070)
    assert r.finish_reason == "length" and r.token_ids == list(range(1, 10))


def test_stream_usage_only_endpoint_counts_tokens_from_usage():
    # an endpoint without token_ids: per-chunk tokens come from continuous usage deltas
    events = [
        {"choices": [{"text": "a", "finish_reason": None}], "usage": {"completion_tokens": 1}},
        {"choices": [{"text": "bcd", "finish_reason": None}], "usage": {"completion_tokens": 4}},
        {"choices": [{"text": "e", "finish_reason": "length"}], "usage": {"completion_tokens": 5}},
        "[DONE]",
    ]
    with _client(sse(events)) as c:
        r = bench.stream_one(c, "http://x", bench.request_body("m", "p", 1, 5, {}, None), "a", "s")
    assert r.ok and r.steps == 3 and r.tokens_per_step == pytest.approx(2.0)


@pytest.mark.parametrize(
    "body,status,msg",
    [
        (json.dumps({"error": {"message": "paused"}}).encode(), 503, "HTTP 503: paused"),
        (sse([{"error": {"message": "engine failed"}}]), 200, "error event: engine failed"),
        (sse(["[DONE]"]), 200, "no tokens"),
        (sse([completion_chunk([1]), "[DONE]"]), 200, "without a finish_reason"),
        (b"data: {oops\n\n", 200, "bad SSE data"),
    ],
)
def test_stream_failures_are_results_not_exceptions(body, status, msg):
    with _client(body, status) as c:
        r = bench.stream_one(c, "http://x", bench.request_body("m", "p", 1, 4, {}, None), "a", "s")
    assert not r.ok and msg in r.error


def test_stream_transport_error():
    def boom(req):
        raise httpx.ConnectError("refused")

    with httpx.Client(transport=httpx.MockTransport(boom)) as c:
        r = bench.stream_one(c, "http://x", bench.request_body("m", "p", 1, 4, {}, None), "a", "s")
    assert not r.ok and "ConnectError" in r.error


METRICS_A = """# HELP vllm:generation_tokens_total Tokens generated
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m"} 100.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.1
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE dsv41_engram_lookups counter
dsv41_engram_lookups_total{rank="0"} 10.0
dsv41_engram_lookups_total{rank="1"} 12.0
# TYPE dsv41_drafter_rounds counter
dsv41_drafter_rounds_total 4.0
"""


def test_parse_metrics_and_delta():
    a = bench.parse_metrics(METRICS_A)
    assert a["vllm:generation_tokens_total"] == 100.0
    assert a['dsv41_engram_lookups_total{rank="1"}'] == 12.0
    assert a["vllm:time_to_first_token_seconds_sum"] == 0.1 and "vllm:num_requests_running" not in a
    assert a["dsv41_drafter_rounds_total"] == 4.0
    b = bench.parse_metrics(METRICS_A.replace("100.0", "160.0").replace("} 12.0", "} 20.0"))
    d = bench.metrics_delta({"u": a}, {"u": b})["u"]
    assert d["vllm:generation_tokens_total"] == 60.0 and d['dsv41_engram_lookups_total{rank="1"}'] == 8.0
    assert d['dsv41_engram_lookups_total{rank="0"}'] == 0.0
    with pytest.raises(bench.BenchError, match="cannot parse"):
        bench.parse_metrics("# TYPE x counter\nx{a=b} 1\n")


def test_plan_requests_unique_salts_and_seeds():
    sp = bench.load_spec(env={})
    items = bench.plan_requests(sp, "run1")
    assert len(items) == len(sp["prompts"]) * sp["repeats"]
    assert len({i["salt"] for i in items}) == len(items) and len({i["seed"] for i in items}) == len(items)
    sp["unique_prefix"] = True
    assert bench.plan_requests(sp, "r")[0]["prompt"].startswith("[r-0] ")


def test_summarize_groups():
    rs = [
        bench.RequestResult("a", "short", 1, 4, ok=True, ttft_ms=10, step_ms_p50=5, tok_s=100, tokens_per_step=2),
        bench.RequestResult("b", "code", 2, 4, ok=True, ttft_ms=30, step_ms_p50=7, tok_s=80, tokens_per_step=1),
        bench.RequestResult("c", "code", 3, 4, ok=False, error="x"),
    ]
    s = bench.summarize(rs)
    assert s["all"]["requests"] == 3 and s["all"]["failed"] == 1 and s["all"]["ttft_ms_p50"] == 20
    assert s["code"]["step_ms_p50"] == 7
