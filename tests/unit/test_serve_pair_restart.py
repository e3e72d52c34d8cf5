"""roles/serve tasks/restart.yml (the one restart of the TP pair), run by ansible-playbook itself on
two local "Sparks" against a stand-in systemctl (fake_systemd.py, one state file per host, one
shared call log): both ranks are stopped before rank 1 starts, rank 1 starts before rank 0, rank
0's /health is polled only after rank 0 started, and check mode touches nothing; a rank 0 that is not
healthy within the start-up budget fails each rank in one line naming its unit, the budget, the last
status, the unit's last journal lines and its first error lines since the restart."""

from __future__ import annotations

import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from servicectlutil import fake_bin
from serviceutil import env, run_playbook

MUTATING = ("start", "stop", "restart", "kill", "daemon-reload", "reset-failed")


class _Health(BaseHTTPRequestHandler):
    """/health answers 200 and records whether rank 0's unit was active when it was asked."""

    seen: list = []
    state: Path | None = None

    def do_GET(self):  # noqa: N802 (http.server's name)
        active = json.loads(self.state.read_text())["units"]["dsv41-serve"]["ActiveState"] == "active"
        self.seen.append((self.path, active))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


PAIR_PLAY = """
- hosts: spark
  gather_facts: false
  roles:
    - role: dsv41
  environment:
    FAKE_SYSTEMD_STATE: "{tmp}/{{{{ inventory_hostname }}}}.json"
    FAKE_SYSTEMD_HOST: "{{{{ inventory_hostname }}}}"
  tasks:
    - name: The one restart of the pair
      ansible.builtin.include_role:
        name: serve
        tasks_from: restart
      vars:
        serve_base_url: http://127.0.0.1:{port}
        serve_health_retries: 5
"""


@pytest.mark.parametrize("check", [False, True], ids=["run", "check_mode"])
def test_pair_restart_order(tmp_path, check):
    log = tmp_path / "log"
    states = {h: tmp_path / f"{h}.json" for h in ("sparkhead", "sparkworker")}
    for p in states.values():
        p.write_text(json.dumps({"units": {"dsv41-serve": {"ActiveState": "active", "NeedDaemonReload": "no"}}}))
        # one shared call log: the fake appends to STATE.log, so point both hosts' logs at one file
        (p.parent / (p.name + ".log")).symlink_to(log)
    log.write_text("")
    _Health.seen, _Health.state = [], states["sparkhead"]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    inv = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "dsv41_service_manager": "systemd",
            },
            "children": {
                "spark": {"hosts": {"sparkhead": {"dsv41_rank": 0}, "sparkworker": {"dsv41_rank": 1}}},
                "offload": {"hosts": {"x86host": {}}},
            },
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inv))
    (tmp_path / "play.yml").write_text(PAIR_PLAY.format(tmp=tmp_path, port=srv.server_address[1]))
    try:
        run_playbook(tmp_path / "hosts.yml", tmp_path / "play.yml", tmp_path, env(fake_bin(tmp_path)), check=check)
    finally:
        srv.shutdown()
    calls = [line for line in log.read_text().splitlines() if line.split()[1] in MUTATING]
    if check:
        assert calls == [] and _Health.seen == []
        return
    stops = [i for i, c in enumerate(calls) if c.endswith("stop dsv41-serve")]
    start1 = calls.index("sparkworker start dsv41-serve")
    start0 = calls.index("sparkhead start dsv41-serve")
    assert len(stops) == 2 and max(stops) < start1 < start0, calls
    assert set(calls) == {
        "sparkhead stop dsv41-serve",
        "sparkworker stop dsv41-serve",
        "sparkworker start dsv41-serve",
        "sparkhead start dsv41-serve",
    }, calls
    assert _Health.seen and _Health.seen[0] == ("/health", True)
    assert all(json.loads(p.read_text())["units"]["dsv41-serve"]["ActiveState"] == "active" for p in states.values())


class _Unhealthy(BaseHTTPRequestHandler):
    """/health answers 503 (a rank 0 that never becomes ready)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_rank_0_not_healthy_within_the_budget_names_unit_rank_and_journal_on_each_rank(tmp_path):
    journals = {
        "sparkhead": ["vllm: loading weights", "RuntimeError: CUDA out of memory"],
        "sparkworker": ["vllm: waiting for rank 0 at the rendezvous"],
    }
    for h, lines in journals.items():
        (tmp_path / f"{h}.json").write_text(
            json.dumps(
                {"units": {"dsv41-serve": {"ActiveState": "active", "NeedDaemonReload": "no", "journal": lines}}}
            )
        )
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Unhealthy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    inv = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "dsv41_service_manager": "systemd",
            },
            "children": {
                "spark": {"hosts": {"sparkhead": {"dsv41_rank": 0}, "sparkworker": {"dsv41_rank": 1}}},
                "offload": {"hosts": {"x86host": {}}},
            },
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inv))
    play = PAIR_PLAY.format(tmp=tmp_path, port=srv.server_address[1]).replace(
        "serve_health_retries: 5", "serve_health_retries: 2\n        serve_health_delay: 1"
    )
    (tmp_path / "play.yml").write_text(play)
    try:
        r = run_playbook(tmp_path / "hosts.yml", tmp_path / "play.yml", tmp_path, env(fake_bin(tmp_path)), ok=False)
    finally:
        srv.shutdown()
    assert r.returncode == 2, r.stdout[-3000:]
    for rank, (host, lines) in enumerate(journals.items()):
        msg = [ln for ln in r.stdout.splitlines() if ln.startswith("[ERROR]") and f"{host} (rank {rank})" in ln]
        assert len(msg) == 1, r.stdout[-4000:]
        assert "dsv41-serve.service" in msg[0] and "serve_health_retries 2 x serve_health_delay 1 s" in msg[0], msg
        assert "last: 503" in msg[0] and "ActiveState=active" in msg[0] and " | ".join(lines) in msg[0], msg
        # the first error lines since the restart (read with --since=@<the host's restart time>)
        errors = [ln for ln in lines if "Error" in ln]
        assert msg[0].endswith("its first errors since the restart: " + (" | ".join(errors) or "(none)")), msg
        calls = (tmp_path / f"{host}.json.log").read_text()
        assert re.search(r"^\S+ --unit=dsv41-serve\.service --since=@\d+ --no-pager --output=cat$", calls, re.M), calls
