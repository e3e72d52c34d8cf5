"""A malformed URL given to any HTTP client of the package gives one line, never a traceback.

``httpx.InvalidURL`` is no ``httpx.HTTPError``: ``dsv41 metrics get http://[::1/metrics`` printed a
traceback, and ports 0, -1 and 99999 went to the resolver or the kernel. The class is every URL
an operator gives (``--metrics``, ``--endpoint``, ``--api``, ``--prometheus``, ``URL`` arguments)
and every way it can be unusable; the HTTP call sites are enumerated from the source, so a new
client is caught the day it is added.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dsv41 import cli
from dsv41.errors import Dsv41Error, run_app
from dsv41.harness import http
from dsv41.monitoring import render

PKG = Path(__file__).resolve().parents[2] / "python" / "dsv41"

# Modules that build httpx requests themselves, and where their URL is checked first.
DIRECT_CLIENTS = {
    "harness/http.py": "request() calls check_url",
    "monitoring/render.py": "query_range calls check_url",
    "harness/bench.py": "run/smoke start with served_model (http.request_json) on the same endpoint",
    "harness/window.py": "run_cells starts with served_model (http.request_json) on the same endpoint",
    "entrypoints/qualify_controller.py": "_completions starts with served_model (http.request_json)",
}

BAD = {
    "http://[::1/metrics": "is not a URL",
    "http://127.0.0.1:99999/metrics": "outside 1-65535",
    "http://127.0.0.1:-1/metrics": "outside 1-65535",
    "http://127.0.0.1:0/metrics": "outside 1-65535",
    "ftp://127.0.0.1/metrics": "not an http:// or https:// URL",
    "file:///etc/passwd": "not an http:// or https:// URL",
    "127.0.0.1:9090": "not an http:// or https:// URL",
    "http:///metrics": "names no host",
    "http://h:port/": "is not a URL",
}


def test_every_module_that_builds_requests_is_listed() -> None:
    users = set()
    for f in PKG.rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "httpx"
                and node.attr in {"Client", "AsyncClient", "get", "post", "put", "delete", "request", "stream"}
            ):
                users.add(str(f.relative_to(PKG)))
    assert users == set(DIRECT_CLIENTS), users ^ set(DIRECT_CLIENTS)


@pytest.mark.parametrize("url", sorted(BAD))
def test_check_url_refuses_in_one_line(url: str) -> None:
    for call in (lambda: http.request("GET", url, what="probe"), lambda: render.query_range(url, "up", 0, 60, 5)):
        with pytest.raises(Dsv41Error, match=BAD[url]) as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("url", sorted(BAD))
def test_url_taking_commands_give_one_line(url: str, capsys) -> None:
    for argv in (
        ["metrics", "get", url],
        ["drafter", "status", "--metrics", url],
        ["refs", "verify", "--endpoint", url, "--refs", "/nonexistent"],
    ):
        rc = run_app(cli.app, argv)
        out = capsys.readouterr()
        assert "Traceback" not in out.err + out.out, (argv, out.err[-1500:])
        assert rc == 1 and len(out.err.splitlines()) == 1 and out.err.startswith("dsv41: error: "), (argv, rc, out.err)


def test_usable_urls_pass() -> None:
    for url in ("http://127.0.0.1:18700/v1/models", "https://[::1]:443/x", "http://sparkhead/metrics"):
        assert http.check_url(url, what="probe") == url
