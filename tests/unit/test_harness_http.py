"""dsv41.harness.http (the harness's one HTTP client and Prometheus parsing), `dsv41 metrics get`
and the one greedy-reference check (refs.check) behind both the module and `dsv41 refs verify`."""

from __future__ import annotations

import json
import socket
import time

import pytest

from dsv41.cli import main
from dsv41.harness import http, refs
from serverutil import FakeServing, HttpStandIn, QuietHandler  # noqa: E402


class _Odd(HttpStandIn):
    """127.0.0.1 server answering ``/slow`` after 2 s, ``/boom`` with 500, ``/text`` with non-JSON,
    ``/garbage`` with text that is not Prometheus exposition."""

    def __init__(self) -> None:
        class H(QuietHandler):
            def do_GET(self):
                if self.path == "/slow":
                    time.sleep(2)
                code, body = {
                    "/boom": (500, b"internal trouble"),
                    "/text": (200, b"<html>"),
                    "/garbage": (200, b"metric{ 1\n"),
                }.get(self.path, (200, b"{}"))
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

        self._serve(H)


@pytest.fixture
def odd():
    s = _Odd()
    yield s
    s.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_errors_are_one_clear_line(odd) -> None:
    with pytest.raises(http.HttpError, match=r"^doing x: no answer within 0.3 s \(GET .*/slow\)$"):
        http.request("GET", odd.url + "/slow", what="doing x", timeout_s=0.3)
    with pytest.raises(http.HttpError, match=r"^doing x: HTTP 500 \(GET .*/boom\): internal trouble$"):
        http.request("GET", odd.url + "/boom", what="doing x")
    with pytest.raises(http.HttpError, match=r"^doing x: the response is not JSON"):
        http.request_json("GET", odd.url + "/text", what="doing x")
    with pytest.raises(http.HttpError, match=r"^doing x: cannot connect"):
        http.request("GET", f"http://127.0.0.1:{_closed_port()}/", what="doing x")
    with pytest.raises(http.HttpError, match=r"^doing x: "):
        http.request("GET", "nonsense://", what="doing x")
    with pytest.raises(refs.RefsError, match="not Prometheus text exposition"):
        refs.fetch_engram_counters(odd.url + "/garbage")


def test_metric_samples_keep_suffixes() -> None:
    text = (
        '# TYPE a counter\na_total{rank="0"} 3\na_created{rank="0"} 1.7e9\n'
        "# TYPE b summary\nb_sum 0.5\nb_count 2\nc 1\n"
    )
    got = http.metric_samples(text)
    assert ("a_total", {"rank": "0"}, 3.0) in got and ("b_sum", {}, 0.5) in got and ("c", {}, 1.0) in got


def test_metrics_cli(capsys) -> None:
    fake = FakeServing()
    try:
        fake.lookups = 4
        assert main(["metrics", "get", fake.url + "/metrics", "--prefix", "dsv41_engram_lookups"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["metrics"] == {
            "dsv41_engram_lookups_total": [
                {"labels": {"rank": "0"}, "value": 4.0},
                {"labels": {"rank": "1"}, "value": 4.0},
            ]
        }
    finally:
        fake.close()
    assert main(["metrics", "get", f"http://127.0.0.1:{_closed_port()}/metrics"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsv41: error: cannot read metrics at") and "Traceback" not in err


def test_refs_verify_cli_checks_counters_like_the_deploy(tmp_path, capsys) -> None:
    """`dsv41 refs verify` runs refs.check with the deploy's requirements (issue 9: it was weaker)."""
    fake = FakeServing()
    try:
        out = tmp_path / "refs.json"
        assert main(["refs", "record", "--endpoint", fake.url, "--out", str(out), "--max-tokens", "4"]) == 0
        capsys.readouterr()
        fake.fallbacks_per_call = 1
        args = ["refs", "verify", "--endpoint", fake.url, "--refs", str(out), "--attempts", "2", "--delay", "0"]
        assert main(args) == 1
        err = capsys.readouterr().err
        assert err.startswith(
            "dsv41: error: counters while the references ran (2 attempt(s)): rank 0: 6 Engram fallbacks"
        )
        assert main([*args, "--no-counters"]) == 0
        capsys.readouterr()
        fake.fallbacks_per_call = 0
        fake.drafter_rounds_per_call = 0
        assert main(args) == 1
        assert "drafter: no drafting rounds" in capsys.readouterr().err
        assert main([*args, "--no-require-drafter", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["identical"] == 6 and doc["counters_delta"]["1"]["lookups"] == 6 and doc["attempts"] == 1
    finally:
        fake.close()


def test_check_arguments() -> None:
    with pytest.raises(refs.RefsError, match="mode must be"):
        refs.check("http://127.0.0.1:9", "x.json", mode="maybe")
    with pytest.raises(refs.RefsError, match="require_ranks needs metrics_url"):
        refs.check("http://127.0.0.1:9", "x.json", require_ranks=["0"])
    with pytest.raises(refs.RefsError, match="attempts must be >= 1"):
        refs.check("http://127.0.0.1:9", "x.json", attempts=0)
