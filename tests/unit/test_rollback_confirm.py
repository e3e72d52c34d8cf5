"""A bare rollback asks first (playbooks/rollback_confirm.yml, as kubespray's reset.yml does):
answered "yes" it proceeds, anything else changes nothing; -e rollback_confirmation=yes skips the
question; without a terminal and without the flag it fails with one line. Both rollback
entry points import it right after their input checks, before anything reaches a host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LINE = "rollback not confirmed, nothing changed"
WRAP = """
- name: Confirm
  ansible.builtin.import_playbook: {repo}/playbooks/rollback_confirm.yml
- name: What a rollback would change
  hosts: localhost
  gather_facts: false
  connection: local
  tasks:
    - name: The rollback proceeded
      ansible.builtin.copy:
        content: "rolled back\\n"
        dest: "{marker}"
        mode: "0644"
"""


def _env() -> dict:
    return dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        PATH=f"{BIN}:{os.environ['PATH']}",
        ANSIBLE_FORCE_COLOR="0",
        NO_COLOR="1",
    )


@pytest.fixture
def wrapped(tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "changed"
    play = tmp_path / "play.yml"
    play.write_text(WRAP.format(repo=REPO, marker=marker))
    return play, marker


def _cmd(play: Path, *extra: str) -> list[str]:
    return [str(BIN / "ansible-playbook"), "-i", "localhost,", str(play), *extra]


def _interactive(play: Path, answer: str) -> tuple[int, str]:
    child = pexpect.spawn(_cmd(play)[0], _cmd(play)[1:], cwd=str(REPO), env=_env(), encoding="utf-8", timeout=120)
    child.expect("Type 'yes' to roll back")
    child.sendline(answer)
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus, child.before


@pytest.mark.parametrize("answer", ["no", "", "y", "YES please"])
def test_a_refused_prompt_changes_nothing(wrapped, answer):
    play, marker = wrapped
    rc, out = _interactive(play, answer)
    assert rc == 2 and LINE in out
    assert not marker.exists() and "The rollback proceeded" not in out


def test_yes_at_the_prompt_proceeds(wrapped):
    play, marker = wrapped
    rc, out = _interactive(play, "yes")
    assert rc == 0, out[-2000:]
    assert marker.read_text() == "rolled back\n"


@pytest.mark.parametrize("flag", ["rollback_confirmation=yes", '{"rollback_confirmation": true}'])
def test_the_flag_skips_the_question_and_proceeds(wrapped, flag):
    play, marker = wrapped
    r = subprocess.run(
        _cmd(play, "-e", flag),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:]
    assert "Type 'yes'" not in r.stdout and marker.exists()


@pytest.mark.parametrize("extra", [[], ["-e", "rollback_confirmation=no"]])
def test_without_a_terminal_or_with_another_answer_it_fails_with_one_line(wrapped, extra):
    play, marker = wrapped
    r = subprocess.run(
        _cmd(play, *extra), cwd=REPO, env=_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120
    )
    assert r.returncode == 2 and not marker.exists()
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("[ERROR]")]
    assert len(errors) == 1 and LINE in errors[0] and errors[0].endswith("-e rollback_confirmation=yes")


def test_check_mode_does_not_ask(wrapped):
    play, _ = wrapped
    r = subprocess.run(
        _cmd(play, "--check"),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert r.returncode == 0 and LINE not in r.stdout


@pytest.mark.parametrize("playbook", ["rollback_package.yml", "rollback_component.yml"])
def test_each_rollback_entry_point_confirms_right_after_its_input_check(playbook):
    plays = yaml.safe_load((REPO / "playbooks" / playbook).read_text())
    assert plays[1].get("ansible.builtin.import_playbook") == "rollback_confirm.yml"
    assert plays[0]["hosts"] == "localhost"  # the input check reaches no host


def test_a_bare_rollback_without_a_terminal_stops_before_any_host(tmp_path):
    """The operator's entry point itself: nothing past the confirmation runs."""
    r = subprocess.run(
        [str(BIN / "ansible-playbook"), "rollback.yml", "-e", f"promotion_root={tmp_path}"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout[-2000:]
    assert [ln for ln in r.stdout.splitlines() if LINE in ln]
    started = [ln for ln in r.stdout.splitlines() if ln.startswith("PLAY [")]
    assert started[-1].startswith("PLAY [Rollback | confirm"), started
    assert list(tmp_path.iterdir()) == []
