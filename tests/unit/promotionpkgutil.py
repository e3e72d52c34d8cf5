"""A small promotion package's host facts (shared by the promotion and state-writer tests)."""

from __future__ import annotations


def _hosts(serve_env: bytes = b"DSV41_DRAFTER_ASYNC=0\n") -> dict:
    return {
        "sparkhead": {
            "groups": ["spark"],
            "rank": 0,
            "dsv41": "0.9.0",
            "kv_budget": 65536,
            "services": ["dsv41-serve", "dsv41-proxy"],
            "files": {
                "/etc/dsv41/serve.env": {"content": serve_env, "mode": "0644"},
                "/opt/dsv41/model/config.json": {"content": b'{"layers": 4}\n', "mode": "0644"},
            },
        },
        "x86host": {
            "groups": ["offload"],
            "rank": None,
            "dsv41": "0.9.0",
            "services": ["dsv41-engram-server"],
            "manifest": {"tables": 2, "sha256": "ab" * 32},
            "files": {"/etc/dsv41/engram-server.env": {"content": b"DSV41_X=1\n", "mode": "0600"}},
        },
    }


PROV = {"op": "deploy", "parent": None}
