"""A fenced HOLD outlives an engine restart (DSV41_ADMISSION_HOLD_FILE, engine/server_state.py ServerState):
``/pause?window=T`` keeps ``{"since", "window"}`` in the file, a rank 0 started while it is there
starts held (admitting only T's requests), ``/resume`` removes it; a plain ``/pause`` is memory only
(vLLM's behaviour); a malformed file never stops the engine from starting."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from authutil import OP_HEADERS, OPERATOR, TEST_HOSTS  # noqa: E402
from dsv41 import envs  # noqa: E402
from dsv41.engine.server import create_app  # noqa: E402
from dsv41.engine.server_state import ServerState  # noqa: E402
from engineutil import FakeEngine  # noqa: E402

TOKEN = "20261201T054000-abcdef01"
REQ = {"prompt": "x", "max_tokens": 1}


def engine(hold_file) -> TestClient:
    """A fresh rank 0 (what a restart gives) keeping its fenced HOLD in ``hold_file``."""
    return TestClient(
        create_app(
            FakeEngine(), "m", 64, ServerState(hold_file), operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS
        ),
        raise_server_exceptions=False,
        headers=OP_HEADERS,
    )


def test_a_fenced_hold_survives_a_restart_and_resume_ends_it(tmp_path):
    f = tmp_path / "run" / "admission-hold"
    c = engine(f)
    assert c.post(f"/pause?mode=wait&window={TOKEN}").status_code == 200
    rec = json.loads(f.read_text())
    assert rec["window"] == TOKEN and rec["since"] == c.get("/is_paused").json()["paused_since"]

    c2 = engine(f)  # the restarted engine
    assert c2.get("/is_paused").json() == {"is_paused": True, "paused_since": rec["since"]}
    r = c2.post("/v1/completions", json=REQ)
    assert r.status_code == 503 and "paused" in r.json()["error"]["message"]
    assert c2.post("/v1/completions", json=REQ, headers={"X-DSV41-Window": TOKEN}).status_code == 200
    assert c2.get("/health").status_code == 200  # readiness is not admission

    assert c2.post("/resume").status_code == 200
    assert not f.exists()
    c3 = engine(f)
    assert c3.get("/is_paused").json() == {"is_paused": False, "paused_since": None}
    assert c3.post("/v1/completions", json=REQ).status_code == 200


def test_a_new_fenced_hold_replaces_the_kept_token_and_a_plain_pause_is_memory_only(tmp_path):
    f = tmp_path / "admission-hold"
    c = engine(f)
    c.post("/pause?window=old-token")
    c.post(f"/pause?window={TOKEN}")
    assert json.loads(f.read_text())["window"] == TOKEN
    c.post("/pause")  # a plain HOLD (vLLM's): not kept, and the stale fenced record goes
    assert not f.exists() and c.get("/is_paused").json()["is_paused"] is True
    assert engine(f).get("/is_paused").json()["is_paused"] is False


@pytest.mark.parametrize(
    "text", ["", "{", "[]", '{"window": "a b", "since": 1}', '{"window": "t"}', '{"window": "t", "since": true}']
)
def test_a_malformed_record_starts_open_with_a_warning(tmp_path, caplog, text):
    f = tmp_path / "admission-hold"
    f.write_text(text)
    with caplog.at_level(logging.WARNING, logger="dsv41.engine.server"):
        st = ServerState(f)
    assert not st.paused and st.window_token is None
    assert "starting open" in caplog.text


def test_without_a_hold_file_nothing_is_kept(tmp_path):
    c = engine(None)
    assert c.post(f"/pause?window={TOKEN}").status_code == 200
    assert list(tmp_path.iterdir()) == []
    assert engine(None).get("/is_paused").json()["is_paused"] is False


def test_an_unwritable_hold_file_is_one_error_and_admission_stays_held(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    c = engine(blocker / "admission-hold")
    r = c.post(f"/pause?window={TOKEN}")
    assert r.status_code == 500
    assert r.json()["error"]["message"].startswith("admission is held, but the HOLD could not be kept in ")
    assert c.get("/is_paused").json()["is_paused"] is True
    assert c.post("/v1/completions", json=REQ).status_code == 503


def test_the_setting_is_in_the_env_table():
    assert envs.parse({}).admission_hold_file == ""
    assert (
        envs.parse({"DSV41_ADMISSION_HOLD_FILE": "/run/dsv41/admission-hold"}).admission_hold_file
        == "/run/dsv41/admission-hold"
    )
