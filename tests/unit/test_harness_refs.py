"""dsv41.harness.refs / admission / refs_cli against a fake rank 0 endpoint on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsv41.harness import admission, refs


class FakeServing:
    """A stand-in rank 0 HTTP endpoint: greedy ids are a function of the prompt bytes (so they are
    deterministic), ``shift`` perturbs the id at position ``shift_at`` of prompts named in
    ``shift_names``; counters grow by one lookup per completion on each rank."""

    def __init__(self) -> None:
        self.paused = False
        self.model = "dsv41-lab"
        self.shift_names: set[str] = set()
        self.shift_at = 3
        self.no_token_ids = False
        self.fallbacks = 0
        self.lookups = 0
        self.fallbacks_per_call = 0
        self.drafter_rounds_per_call = 2
        self.rounds = 0
        self.calls: list[str] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def _send(self, code, body, ctype="application/json"):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append("GET " + self.path)
                if self.path == "/is_paused":
                    return self._send(200, {"is_paused": fake.paused})
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": fake.model}]})
                if self.path == "/metrics":
                    text = "# HELP x\n"
                    for r in ("0", "1"):
                        text += f'dsv41_engram_lookups_total{{rank="{r}"}} {fake.lookups}\n'
                        text += f'dsv41_engram_fallbacks_total{{rank="{r}"}} {fake.fallbacks}\n'
                    text += 'vllm:num_requests_running{model_name="x"} 0\n'
                    text += f"dsv41_drafter_rounds {fake.rounds}\ndsv41_drafter_identity_refusals 0\n"
                    return self._send(200, text.encode(), "text/plain")
                return self._send(404, {})

            def do_POST(self):
                fake.calls.append("POST " + self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path.split("?")[0] == "/pause":
                    fake.pause_query = self.path.partition("?")[2]
                    fake.paused = True
                    return self._send(200, {})
                if self.path == "/resume":
                    fake.paused = False
                    return self._send(200, {})
                if self.path == "/v1/completions":
                    assert body["temperature"] == 0 and body["return_token_ids"] is True
                    prompt = body["prompt"].encode()
                    ids = [(prompt[i % len(prompt)] * 7 + i) % 260 for i in range(body["max_tokens"])]
                    name = {p: n for n, p in refs.PROMPTS}.get(body["prompt"])
                    if name in fake.shift_names and len(ids) > fake.shift_at:
                        ids[fake.shift_at] = (ids[fake.shift_at] + 1) % 260
                    fake.lookups += 1
                    fake.fallbacks += fake.fallbacks_per_call
                    fake.rounds += fake.drafter_rounds_per_call
                    choice = {"text": "x"} if fake.no_token_ids else {"text": "x", "token_ids": ids}
                    return self._send(200, {"choices": [choice]})
                return self._send(404, {})

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serving():
    s = FakeServing()
    yield s
    s.close()


def test_first_diff():
    assert refs.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert refs.first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert refs.first_diff([1, 2], [1, 2, 3]) == 2
    assert refs.first_diff([], [7]) == 0


def test_record_then_verify_identical(serving, tmp_path):
    doc = refs.run_prompts(serving.url, max_tokens=8)
    assert doc["model"] == "dsv41-lab" and len(doc["prompts"]) == 6
    assert all(len(p["token_ids"]) == 8 for p in doc["prompts"])
    path = tmp_path / "r" / "refs.json"
    refs.save_refs(doc, path)
    cmp = refs.verify(serving.url, refs.load_refs(path))
    assert (cmp.identical, cmp.total) == (6, 6) and cmp.summary() == "6/6 identical"


def test_verify_reports_first_differing_position(serving, tmp_path):
    doc = refs.run_prompts(serving.url, max_tokens=8)
    serving.shift_names = {"repeat", "digits"}
    serving.shift_at = 5
    cmp = refs.verify(serving.url, doc)
    assert cmp.identical == 4
    diffs = {r.name: r.first_diff for r in cmp.results}
    assert diffs["repeat"] == 5 and diffs["digits"] == 5 and diffs["plain"] is None
    assert "repeat differs at 5" in cmp.summary()


def test_missing_token_ids_is_one_clear_error(serving):
    serving.no_token_ids = True
    with pytest.raises(refs.RefsError, match="token_ids"):
        refs.run_prompts(serving.url, max_tokens=4)


def test_unreachable_endpoint():
    with pytest.raises(refs.RefsError, match="cannot list models"):
        refs.run_prompts("http://127.0.0.1:9", max_tokens=4)


@pytest.mark.parametrize("content,match", [
    ("{", "not JSON"),
    ('{"format": "other"}', "is not a"),
    ('{"format": "dsv41-greedy-refs/1", "prompts": []}', "no valid prompts"),
    ('{"format": "dsv41-greedy-refs/1", "prompts": [{"name": "a", "prompt": "b", "token_ids": []}]}',
     "max_tokens"),
])
def test_load_refs_rejects_bad_files(tmp_path, content, match):
    p = tmp_path / "refs.json"
    p.write_text(content)
    with pytest.raises(refs.RefsError, match=match):
        refs.load_refs(p)


def test_load_refs_missing_file(tmp_path):
    with pytest.raises(refs.RefsError, match="cannot read refs"):
        refs.load_refs(tmp_path / "nope.json")


def test_engram_counters_and_delta():
    text = ('# TYPE dsv41_engram_lookups_total counter\n'
            'dsv41_engram_lookups_total{rank="0"} 10\n'
            'dsv41_engram_lookups_total{rank="1"} 12\n'
            'dsv41_engram_lookups_created{rank="0"} 1.7e9\n'
            'dsv41_engram_fallbacks_total{rank="1"} 2\n'
            'dsv41_engram_latency_sum_s{rank="0"} 0.5\n'
            'dsv41_engram_lookups_total 99\n')
    c = refs.engram_counters(text)
    with pytest.raises(refs.RefsError, match="not Prometheus text exposition"):
        refs.engram_counters(text + "garbage line\n")  # parsed by prometheus_client: refused, not skipped
    assert c == {"0": {"lookups": 10.0, "latency_sum_s": 0.5}, "1": {"lookups": 12.0, "fallbacks": 2.0}}
    after = {"0": {"lookups": 15.0, "latency_sum_s": 0.7}, "1": {"lookups": 20.0, "fallbacks": 2.0}}
    d = refs.counter_delta(c, after)
    assert d["0"]["lookups"] == 5 and d["1"]["fallbacks"] == 0
    assert refs.check_remote_engram(d, ["0", "1"]) is None
    assert refs.check_remote_engram({"0": {"lookups": 1, "fallbacks": 3}}, ["0"]) == "rank 0: 3 Engram fallbacks"
    assert refs.check_remote_engram({"0": {"lookups": 0}}, ["0"]) == "rank 0: no Engram lookups counted"
    assert refs.check_remote_engram({}, ["1"]) == "rank 1: no Engram counters on /metrics"


def test_flat_values():
    text = "dsv41_drafter_rounds 4\ndsv41_drafter_drafts_total 9\ndsv41_drafter_x{a=\"1\"} 3\nother 1\n"
    assert refs.flat_values(text, "dsv41_drafter_") == {"rounds": 4.0, "drafts": 9.0}


def test_check_drafter():
    assert refs.check_drafter({"rounds": 3, "identity_refusals": 0}) is None
    assert refs.check_drafter({"rounds": 3, "identity_refusals": 2}) == "drafter: 2 identity refusals"
    assert refs.check_drafter({"rounds": 0, "fail_closed_rounds": 7}) == "drafter: no drafting rounds (7 failed closed)"
    assert refs.check_drafter({}) == "drafter: no drafting rounds"


def test_fetch_engram_counters(serving):
    serving.lookups = 3
    assert refs.fetch_engram_counters(serving.url + "/metrics")["1"]["lookups"] == 3


def test_admission_status_hold_release_idempotent(serving):
    assert admission.status(serving.url) == "open"
    assert admission.set_state(serving.url, "held") == "open"
    assert serving.paused
    # vLLM's default mode is abort: the HOLD must ask for a drain explicitly
    assert serving.pause_query == "mode=wait&timeout_s=600"
    n = len(serving.calls)
    assert admission.set_state(serving.url, "held") == "held"
    assert not any(c.startswith("POST") for c in serving.calls[n:])  # idempotent: no request
    assert admission.set_state(serving.url, "open") == "held" and not serving.paused


def test_admission_errors(serving):
    with pytest.raises(admission.AdmissionError, match="must be"):
        admission.set_state(serving.url, "closed")
    with pytest.raises(admission.AdmissionError, match="cannot read admission"):
        admission.status("http://127.0.0.1:9")


def test_refs_cli_record_verify(serving, tmp_path, capsys):
    from dsv41.cli import main as cli_main

    out = tmp_path / "refs.json"
    assert cli_main(["refs", "record", "--endpoint", serving.url, "--out", str(out), "--max-tokens", "4"]) == 0
    assert cli_main(["refs", "record", "--endpoint", serving.url, "--out", str(out)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert cli_main(["refs", "verify", "--endpoint", serving.url, "--refs", str(out)]) == 0
    assert "6/6 identical" in capsys.readouterr().out
    serving.shift_names = {"code"}
    serving.shift_at = 1
    assert cli_main(["refs", "verify", "--endpoint", serving.url, "--refs", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsv41: error: greedy references differ: 5/6 identical; code differs at 1")
