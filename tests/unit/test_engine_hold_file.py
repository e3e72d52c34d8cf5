"""An engine restarted inside a window comes up HELD (DSV41_ENGINE_HOLD_FILE), issue 11 item 4.

Before: a restarted rank 0 admitted every request from its first second until the switch or the
restore re-took the HOLD. Now window.yml writes the hold file (the window token) on the Sparks for
the window's duration; rank 0 starts paused with that token, so outside traffic gets 503 from the
first request on, the window's own requests are admitted, and only /resume (the restore, after
its checks) opens admission.
"""

from __future__ import annotations

import pytest

from dsv41 import envs
from dsv41.engine.server import initial_state

pytest.importorskip("fastapi")


class _Sched:
    def counts(self):
        return 0, 0


class _Engine:
    """The part of engine.Engine the HTTP layer uses; every request yields one token."""

    fatal = None
    sched = _Sched()

    def submit(self, ids, params, sink):
        sink({"type": "tokens", "ids": [5], "prompt_tokens": len(ids), "completion_tokens": 1})
        sink({"type": "finish", "reason": "length", "prompt_tokens": len(ids), "completion_tokens": 1})

        class _R:
            request_id = "r"
        return _R()

    def abort(self, rid=None):
        pass

    def idle(self):
        return True

    def freeze(self, on):
        pass


def _client(state):
    from fastapi.testclient import TestClient

    from dsv41.engine.server import create_app

    return TestClient(create_app(_Engine(), "m", 64, state), raise_server_exceptions=False)


BODY = {"prompt": "x", "max_tokens": 1}


def test_hold_file_with_a_token_starts_held_for_that_window(tmp_path):
    f = tmp_path / "window-hold"
    f.write_text("w20261201t0600z123\n")
    st = initial_state(str(f))
    assert st.paused and st.window_token == "w20261201t0600z123" and st.paused_since is not None
    c = _client(st)
    assert c.get("/is_paused").json()["is_paused"] is True
    assert c.post("/v1/completions", json=BODY).status_code == 503  # outside traffic: never admitted
    assert c.post("/v1/completions", json=BODY, headers={"X-DSV41-Window": "other"}).status_code == 503
    assert c.post("/v1/completions", json=BODY, headers={"X-DSV41-Window": "w20261201t0600z123"}).status_code == 200
    assert c.post("/resume").status_code == 200  # only the restore's /resume opens it
    assert c.post("/v1/completions", json=BODY).status_code == 200


def test_no_hold_file_starts_open(tmp_path):
    st = initial_state(str(tmp_path / "absent"))
    assert not st.paused and st.window_token is None and st.paused_since is None
    assert _client(st).post("/v1/completions", json=BODY).status_code == 200
    assert not initial_state("").paused  # empty setting: never start held


@pytest.mark.parametrize("content", ["bad token with spaces\n", "", "x" * 129 + "\n"])
def test_bad_token_fails_closed(tmp_path, content):
    f = tmp_path / "window-hold"
    f.write_text(content)
    st = initial_state(str(f))
    assert st.paused and st.window_token is None
    c = _client(st)
    assert c.post("/v1/completions", json=BODY, headers={"X-DSV41-Window": content.strip() or "x"}).status_code == 503


def test_unreadable_hold_file_fails_closed(tmp_path):
    d = tmp_path / "window-hold"
    d.mkdir()  # exists, cannot be read as a file
    st = initial_state(str(d))
    assert st.paused and st.window_token is None


def test_hold_file_setting_is_a_dsv41_variable():
    assert envs.ENV_VARS["DSV41_ENGINE_HOLD_FILE"].default == "/run/dsv41/window-hold"
    assert envs.parse({"DSV41_ENGINE_HOLD_FILE": "/tmp/h"}).engine_hold_file == "/tmp/h"
    assert envs.parse({}).engine_hold_file == "/run/dsv41/window-hold"
