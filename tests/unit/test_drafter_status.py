"""dsv41 drafter status (worker state from /metrics, prometheus_client parser) and dsv41 version --json."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from prometheus_client import generate_latest

from dsv41.cli import main
from dsv41.drafter.status import fetch_status, parse_status
from dsv41.drafter.worker import WorkerMetrics
from dsv41.errors import Dsv41Error


def _metrics_text(connections: int = 2) -> str:
    m = WorkerMetrics()
    m.connections.set(connections)
    m.info.labels("d" * 64, "m" * 64, "t" * 64, "torch").set(1)
    m.rounds.inc(5)
    return generate_latest(m.registry).decode()


class _Server:
    """A loopback HTTP server answering every GET with ``status`` and ``body``."""

    def __init__(self, status: int, body: str) -> None:

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        self.t = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.t.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def worker_metrics():
    s = _Server(200, _metrics_text())
    yield s
    s.close()


def test_parse_real_worker_metrics():
    st = parse_status(_metrics_text(3))
    assert st == {"connections": 3, "identities": {"drafter": "d" * 64, "markov": "m" * 64, "target": "t" * 64}}


def test_no_identities_exported_yet():
    m = WorkerMetrics()
    st = parse_status(generate_latest(m.registry).decode())
    assert st == {"connections": 0, "identities": {"drafter": "", "markov": "", "target": ""}}


def test_not_a_drafter_worker():
    with pytest.raises(Dsv41Error, match="no dsv41_drafter_connections"):
        parse_status("# TYPE other gauge\nother 1\n")


def test_garbage_text_is_one_error():
    with pytest.raises(Dsv41Error, match="drafter status: unreadable metrics text"):
        parse_status("dsv41_drafter_connections{ 1\n")


def test_cli_json(worker_metrics, capsys):
    assert main(["drafter", "status", "--metrics", worker_metrics.url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["connections"] == 2 and st["identities"]["target"] == "t" * 64


def test_cli_text(worker_metrics, capsys):
    assert main(["drafter", "status", "--metrics", worker_metrics.url]) == 0
    assert capsys.readouterr().out.startswith("connections 2; drafter dddddddddddddddd")


def test_http_error_status():
    s = _Server(503, "down")
    try:
        with pytest.raises(Dsv41Error, match="cannot read .*HTTP 503"):
            fetch_status(s.url)
    finally:
        s.close()


def test_unreachable_worker_is_one_line(capsys):
    assert main(["drafter", "status", "--metrics", "http://127.0.0.1:9/metrics", "--json"]) == 1
    err = capsys.readouterr().err
    assert "drafter status: cannot read http://127.0.0.1:9/metrics" in err and "Traceback" not in err


def test_version_json(capsys):
    import dsv41

    assert main(["version", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dsv41"] == dsv41.__version__ and info["transport"] in ("c++", "python")
    assert isinstance(info["native"], bool) and info["python"].count(".") == 2
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == dsv41.__version__
