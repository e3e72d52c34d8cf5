"""The lab engine's HTTP server at TP1 as a real process: OpenAI client streaming, greedy
identity with LocalRunner, bad requests, pause/resume, metrics, KV budget, SIGTERM drain."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from labutil import post as lab_post  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from dsv41.engine.runner import LocalRunner  # noqa: E402
from dsv41.tokenizer import ByteTokenizer  # noqa: E402
from engineutil import engine_env, free_port, lab_assets, local_rows, serve_cmd, start, stop, wait_ready  # noqa: E402

TOK = ByteTokenizer()
KV = 1024


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return lab_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def server(assets, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("srv") / "rank0.log"
    proc = start(
        serve_cmd(assets, port=port, extra=["--kv-cache-tokens", str(KV), "--max-step-tokens", "128"]),
        engine_env(),
        log,
    )
    try:
        wait_ready(port, proc, log)
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log}
    finally:
        stop(proc, signal.SIGKILL)


def post(server, path, body, **kw):
    return httpx.post(server["url"] + path, json=body, timeout=120, **kw)


def sse(server, body, first=None):
    """[parsed data objects] of one streaming completion (``[DONE]`` excluded); sets the
    ``first`` event when the first chunk arrived."""
    out = []
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                if first is not None:
                    first.set()
    return out


def test_greedy_matches_local_runner_and_concurrency(server, assets):
    ref = LocalRunner(assets.config, assets.weights, local_rows(assets))
    prompts = ["The quick dog ", "count 3 4 5", "Every green lamp"]
    want = [ref.generate(TOK.encode(p), 24).tokens for p in prompts]
    got = [None] * 3

    def one(i):
        r = post(
            server,
            "/v1/completions",
            {"model": "dsv41-lab", "prompt": prompts[i], "max_tokens": 24, "temperature": 0, "return_token_ids": True},
        )
        got[i] = r.json()

    ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for g, w, p in zip(got, want, prompts, strict=False):
        c = g["choices"][0]
        assert c["token_ids"] == w and c["prompt_token_ids"] == TOK.encode(p)
        assert c["text"] == TOK.decode(w) and c["finish_reason"] == "length"
        assert g["usage"] == {
            "prompt_tokens": len(TOK.encode(p)),
            "completion_tokens": 24,
            "total_tokens": len(TOK.encode(p)) + 24,
        }


def test_openai_client_streams(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.completions.create(
            model="dsv41-lab",
            prompt="The cat ",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 12  # one chunk per engine step (one token per step here) + final
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is not None for c in chunks)
    whole = client.completions.create(model="dsv41-lab", prompt="The cat ", max_tokens=12, temperature=0)
    assert "".join(texts) == whole.choices[0].text
    chat = list(
        client.chat.completions.create(
            model="dsv41-lab",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].usage.completion_tokens == 8
    assert [m.id for m in client.models.list().data] == ["dsv41-lab"]


def test_stream_token_ids_and_seeded_sampling(server):
    body = {
        "prompt": "A model ",
        "max_tokens": 10,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": 7,
        "stream": True,
        "return_token_ids": True,
        "min_tokens": 10,
    }
    a = sse(server, body)
    b = sse(server, body)
    ids_a = [t for c in a for t in c["choices"][0].get("token_ids", [])]
    assert ids_a == [t for c in b for t in c["choices"][0].get("token_ids", [])] and len(ids_a) == 10
    assert a[0]["choices"][0]["prompt_token_ids"] == TOK.encode("A model ")
    assert a[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "body,status,frag",
    [
        ("{not json", 400, "not valid JSON"),
        ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "x" * 1100, "max_tokens": 5}, 400, "at most"),
        ({"prompt": "x", "n": 2}, 400, "n must be 1"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
        ({"max_tokens": 2}, 400, "prompt is required"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": [1, 2, 999]}, 400, "outside the vocabulary"),
        ({"prompt": "x", "seed": "a"}, 400, "seed"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream=true"),
        ([1, 2], 400, "JSON object"),
        ('{"prompt": ' + "[" * 100000 + "]" * 100000 + "}", 400, "nested too deeply"),  # was a text 500
        ({"prompt": "x", "temperature": 10**400}, 400, "temperature"),  # beyond float range: was a 500
        ({"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens must be an integer"),
        ({"prompt": "x", "max_tokens": 10**30}, 400, "at most"),
        ({"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos must be a boolean"),
        ({"prompt": "x", "return_token_ids": "yes"}, 400, "return_token_ids must be a boolean"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream must be a boolean"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "1"}}, 400, "include_usage"),
        ({"prompt": [[5, 6], [7]]}, 400, "batched prompts"),
    ],
)
def test_bad_requests_get_4xx_with_message(server, body, status, frag):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        server["url"] + "/v1/completions", content=raw, timeout=30, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    assert frag in r.json()["error"]["message"]


def test_bad_chat_requests(server):
    for body, frag in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "content"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, "max_completion_tokens"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "not one of"),
        ({"messages": ["hi"]}, "role"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
    ]:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and frag in r.json()["error"]["message"]
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}


def test_pause_wait_abort_resume(server):
    res = {}

    def long_req(key, n):
        res[key] = post(
            server, "/v1/completions", {"prompt": "The dog ", "max_tokens": n, "temperature": 0, "ignore_eos": True}
        ).json()

    t = threading.Thread(target=long_req, args=("wait", 80))
    t.start()
    time.sleep(0.5)
    r = lab_post(server["url"] + "/pause?mode=wait", timeout=120)
    assert r.status_code == 200 and r.json()["paused"] is True
    t.join(60)
    assert res["wait"]["choices"][0]["finish_reason"] == "length"  # nothing admitted was lost
    assert res["wait"]["usage"]["completion_tokens"] == 80
    held = httpx.get(server["url"] + "/is_paused").json()
    assert held["is_paused"] is True and 0 < time.time() - held["paused_since"] < 120
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and "paused" in r.json()["error"]["message"]
    assert lab_post(server["url"] + "/resume").json() == {"paused": False}
    assert httpx.get(server["url"] + "/is_paused").json() == {"is_paused": False, "paused_since": None}

    t = threading.Thread(target=long_req, args=("abort", 600))
    t.start()
    time.sleep(0.8)
    r = lab_post(server["url"] + "/pause", json={"mode": "abort"}, timeout=60)
    assert r.status_code == 200 and r.json()["mode"] == "abort"
    t.join(60)
    assert res["abort"]["choices"][0]["finish_reason"] == "abort"
    assert res["abort"]["usage"]["completion_tokens"] < 600
    assert lab_post(server["url"] + "/pause?mode=bogus").status_code == 400
    lab_post(server["url"] + "/resume")
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_client_disconnect_aborts_request(server):
    def aborted():
        for line in httpx.get(server["url"] + "/metrics").text.splitlines():
            if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = aborted()
    with httpx.stream(
        "POST",
        server["url"] + "/v1/completions",
        timeout=60,
        json={"prompt": "The dog ", "max_tokens": 900, "stream": True, "ignore_eos": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # hang up after the first chunk
    t0 = time.monotonic()
    while aborted() == before and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    assert aborted() == before + 1
    assert 'vllm:num_requests_running{model_name="dsv41-lab"} 0.0' in httpx.get(server["url"] + "/metrics").text


def test_chat_completion_non_stream(server):
    r = post(
        server,
        "/v1/chat/completions",
        {
            "model": "dsv41-lab",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 6,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == TOK.decode(body["choices"][0]["token_ids"])
    assert body["usage"]["completion_tokens"] == 6


def test_metrics(server):
    post(server, "/v1/completions", {"prompt": "The cat ", "max_tokens": 3})
    text = httpx.get(server["url"] + "/metrics").text
    vals = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            vals[k] = float(v)
    assert vals['vllm:prompt_tokens_total{model_name="dsv41-lab"}'] > 0
    assert vals['vllm:generation_tokens_total{model_name="dsv41-lab"}'] > 0
    assert vals['vllm:time_to_first_token_seconds_count{model_name="dsv41-lab"}'] > 0
    assert vals['dsv41_engram_lookups_total{rank="0"}'] > 0
    assert vals['dsv41_engram_fallbacks_total{rank="0"}'] == 0
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ):
        assert name in text


def test_tiny_temperature_is_greedy_not_a_dead_engine(server):
    """temperature 1e-320 made logits/temperature overflow -> NaN -> the engine thread died."""
    greedy = post(
        server, "/v1/completions", {"prompt": "The cat ", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    ).json()
    r = post(
        server,
        "/v1/completions",
        {"prompt": "The cat ", "max_tokens": 6, "temperature": 1e-320, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}


def test_pause_bad_input_is_400_openai_shaped(server):
    for url, kw in [
        ("/pause?timeout_s=abc", {}),
        ("/pause?timeout_s=-1", {}),
        ("/pause", {"json": [1]}),
        ("/pause", {"content": b"{bad", "headers": {"content-type": "application/json"}}),
    ]:
        r = lab_post(server["url"] + url, timeout=30, **kw)
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["type"] == "BadRequestError" and r.json()["error"]["message"]
    assert httpx.get(server["url"] + "/is_paused").json() == {"is_paused": False, "paused_since": None}


def test_non_stream_client_disconnect_aborts_request(server):
    def aborted():
        for line in httpx.get(server["url"] + "/metrics").text.splitlines():
            if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = aborted()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server["url"] + "/v1/completions",
            json={"prompt": "The dog ", "max_tokens": 900, "ignore_eos": True},
            timeout=1.5,
        )
    t0 = time.monotonic()
    while aborted() == before and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    assert aborted() == before + 1  # the slot was freed, not held for 900 tokens


def test_sigterm_drains_in_flight_stream(server):
    """Last test of the module: SIGTERM lets the running stream finish, then exit 0."""
    out = {}
    first = threading.Event()

    def stream():
        out["chunks"] = sse(
            server,
            {"prompt": "The dog ", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True},
            first,
        )

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    server["proc"].send_signal(signal.SIGTERM)
    t.join(60)
    assert out["chunks"][-1]["choices"][0]["finish_reason"] == "length"
    assert server["proc"].wait(30) == 0, server["log"].read_text()[-2000:]
