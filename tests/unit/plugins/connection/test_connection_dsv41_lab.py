"""plugins/connection/dsv41_lab.py: holder pid lookup and the one-line failure when the lab is down."""

from __future__ import annotations

import os

import pytest

from ansible.errors import AnsibleConnectionFailure
from ansible_collections.dsv41.offload.plugins.connection import dsv41_lab


def test_live_pid_is_returned(tmp_path):
    f = tmp_path / "x86host.pid"
    f.write_text(f"{os.getpid()}\n")
    assert dsv41_lab.holder_pid(str(f)) == os.getpid()


@pytest.mark.parametrize("content", [None, "", "1", "abc", "999999999"])
def test_missing_or_dead_holder_fails_naming_the_file(tmp_path, content):
    f = tmp_path / "sparkhead.pid"
    if content is not None:
        f.write_text(content)
    with pytest.raises(AnsibleConnectionFailure, match=f"no live holder pid in {f}.*lab_up.yml"):
        dsv41_lab.holder_pid(str(f))


def test_commands_are_wrapped_in_nsenter(tmp_path, monkeypatch):
    from ansible.plugins.connection.local import Connection as Local

    f = tmp_path / "h.pid"
    f.write_text(str(os.getpid()))
    seen = {}
    monkeypatch.setattr(Local, "exec_command", lambda self, cmd, in_data=None, sudoable=True: seen.setdefault("cmd", cmd))
    conn = dsv41_lab.Connection.__new__(dsv41_lab.Connection)
    monkeypatch.setattr(dsv41_lab.Connection, "get_option", lambda self, name: str(f))
    conn.exec_command("/bin/sh -c 'echo hi'")
    assert seen["cmd"] == f"nsenter --target {os.getpid()} --mount --net --uts --ipc --pid -- /bin/sh -c 'echo hi'"
