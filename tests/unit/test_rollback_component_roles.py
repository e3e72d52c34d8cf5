"""playbooks/rollback_component.yml's role variables, rendered by ansible-playbook itself with the
roles' own templates on the lab inventory: each component rollback removes exactly its settings
(dsv41.harness.components.env_problems finds none left), the engine's settings parse, the
production rendering keeps every component, and the overlay is inert once its variables are unset.

The variables come from the one component map (dsv41.harness.components.ROLE_VARS), which the
playbook's set_fact pre_task applies as the component_check module returns it, so the test and the
playbook cannot drift apart. A component name the playbook does not know is refused before
anything runs (one line, exit 2 on the first play)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv41 import envs
from dsv41.envs import parse_env_text
from dsv41.harness import components as C
from dsv41.overlay import settings as S
from yamltree import items, with_imports

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOSTS = ("sparkhead", "sparkworker")
CAPACITY = {"spec_decode_capacity_mode": True, "spec_decode_local_memory_tokens": 4096}


def switch_vars() -> dict[str, dict]:
    """{component: the variables the playbook sets for it}: the module's map, after checking that the
    playbook's only set_fact pre_task applies what the name check returned."""
    plays = yaml.safe_load((REPO / "playbooks" / "rollback_component.yml").read_text())
    pre = [t for play in plays for t in items(with_imports(play).get("pre_tasks")) if "block" not in t]
    assert len(pre) == 1 and "rollback_component_known.role_vars" in pre[0]["loop"], pre
    return C.ROLE_VARS


VARIANTS = {
    "production": {},
    "production_capacity": CAPACITY,
    **{name: v for name, v in switch_vars().items()},
    "remote_drafter_from_capacity": {**CAPACITY, **switch_vars()["remote_drafter"]},
}

PLAY = """
- hosts: spark
  gather_facts: false
  vars_files: ["{repo}/roles/dsv41/defaults/main.yml",
               "{repo}/roles/spec_decode/defaults/main.yml", "{repo}/roles/spec_decode/vars/main.yml",
               "{repo}/roles/engram_overlay/defaults/main.yml", "{repo}/roles/engram_overlay/vars/main.yml"]
  tasks:
{tasks}
"""
TASK = """
    - name: Render {variant}
      vars: {vars}
      ansible.builtin.template:
        src: "{repo}/roles/{role}/templates/{tmpl}"
        dest: "{out}/{variant}.{{{{ inventory_hostname }}}}.{kind}"
        mode: "0644"
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    """{variant: {host: {"drafter": text, "engram": text}}}, one ansible-playbook run."""
    out = tmp_path_factory.mktemp("render")
    tasks = "".join(
        TASK.format(variant=v, vars=json.dumps(x), repo=REPO, out=out, role=role, tmpl=tmpl, kind=kind)
        for v, x in VARIANTS.items()
        for role, tmpl, kind in (
            ("spec_decode", "drafter.env.j2", "drafter"),
            ("engram_overlay", "engram-overlay.env.j2", "engram"),
        )
    )
    play = out / "play.yml"
    play.write_text(PLAY.format(repo=REPO, tasks=tasks))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), PATH=f"{BIN}:{os.environ['PATH']}")
    r = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(REPO / "inventories" / "sim"),
            str(play),
            "-e",
            "ansible_connection=local",
            "-e",
            "dsv41_drafter_src=/nonexistent",
        ],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return {
        v: {h: {k: (out / f"{v}.{h}.{k}").read_text() for k in ("drafter", "engram")} for h in HOSTS} for v in VARIANTS
    }


def parse_env(text: str) -> dict[str, str]:
    return parse_env_text(text, "rendered")


def host_env(files: dict) -> dict[str, str]:
    """What the serving process of one host sees: both env files (the service reads both)."""
    return {**parse_env(files["drafter"]), **parse_env(files["engram"])}


def test_the_playbook_switches_each_component_with_role_variables():
    assert switch_vars() == {
        "async_handoff": {"spec_decode_async": False},
        "remote_drafter": {"spec_decode_remote": False, "spec_decode_capacity_mode": False},
        "remote_engram": {"engram_overlay_remote": False},
    }
    assert set(switch_vars()) == set(C.COMPONENTS)


def test_production_keeps_every_component(rendered):
    prod = rendered["production"]
    head = host_env(prod["sparkhead"])
    assert head["DSV41_DRAFTER_ASYNC"] == "1" and head["DSV41_DRAFTER_REMOTE"].startswith("tcp://198.18.1.1:")
    assert "DSV41_DRAFTER_CAPACITY_MODE" not in head and "DSV41_DRAFTER_LOCAL" not in head
    for h in HOSTS:
        env = host_env(prod[h])
        assert env["DSV41_ENGRAM_REMOTE"].count("tcp://") == 2 and env["DSV41_RUNTIME_ROOT"] == "/opt/dsv41/runtime"
        envs.parse(env)  # the engine accepts it
    texts = {h: prod[h]["drafter"] + prod[h]["engram"] for h in HOSTS}
    for name in C.COMPONENTS:
        assert C.env_problems(name, texts, drafting_hosts=["sparkhead"]), name
    assert S.parse(head).engram and S.parse(head).drafter


@pytest.mark.parametrize("name", sorted(C.COMPONENTS))
def test_each_rollback_removes_exactly_its_component(rendered, name):
    got = rendered[name]
    texts = {h: got[h]["drafter"] + got[h]["engram"] for h in HOSTS}
    assert C.env_problems(name, texts, drafting_hosts=["sparkhead"]) == []
    others = [n for n in C.COMPONENTS if n != name and not (name == "remote_drafter" and n == "async_handoff")]
    for other in others:  # the other components stay (remote_drafter takes the async handoff with it)
        assert C.env_problems(other, texts, drafting_hosts=["sparkhead"]), other
    for h in HOSTS:
        envs.parse(host_env(got[h]))  # the engine starts with it
    # what stays byte-identical to production: the other role's file
    prod = rendered["production"]
    untouched = "drafter" if name == "remote_engram" else "engram"
    assert all(got[h][untouched] == prod[h][untouched] for h in HOSTS)


def test_async_handoff_rollback_is_synchronous_remote_rounds_on_both_ranks(rendered):
    head = envs.parse(host_env(rendered["async_handoff"]["sparkhead"]))
    assert head.drafter_remote and not head.drafter_async
    assert not envs.parse(host_env(rendered["async_handoff"]["sparkworker"])).drafter_async


def test_remote_drafter_rollback_drafts_locally_with_the_baseline_kv_budget(rendered):
    from dsv41.drafter.factory import kv_budget_extra_tokens

    cap = envs.parse(host_env(rendered["production_capacity"]["sparkhead"]))
    assert cap.drafter_capacity_mode and kv_budget_extra_tokens(cap) == 4096
    for variant in ("remote_drafter", "remote_drafter_from_capacity"):
        s = envs.parse(host_env(rendered[variant]["sparkhead"]))
        assert s.drafter_local == "/opt/dsv41/drafter" and not s.drafter_remote and not s.drafter_capacity_mode
        assert kv_budget_extra_tokens(s) == 0
    assert rendered["remote_drafter_from_capacity"] == rendered["remote_drafter"]


def test_remote_engram_rollback_leaves_no_overlay_variable(rendered):
    for h in HOSTS:
        env = parse_env(rendered["remote_engram"][h]["engram"])
        assert env == {}
        assert envs.parse(host_env(rendered["remote_engram"][h])).engram_remote == ""


def _register(env: dict) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_", "VLLM_ENGRAM"))}
    code = (
        "import sys; from dsv41.overlay import plugin, hooks; plugin.register(); "
        "print(plugin.STATE['state'], 'torch' in sys.modules, hooks._finder in sys.meta_path)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.split()


def test_the_overlay_is_inert_once_its_variables_are_unset(rendered):
    # remote Engram and remote drafter both rolled back: nothing of the overlay remains set
    for h in HOSTS:
        env = {
            **parse_env(rendered["remote_drafter"][h]["drafter"]),
            **parse_env(rendered["remote_engram"][h]["engram"]),
        }
        assert not S.parse(env).active
        assert _register(env) == ["inert", "False", "False"]
    # one of the two rolled back: the overlay keeps only the other one
    assert not S.parse(host_env(rendered["remote_engram"]["sparkhead"])).engram
    assert S.parse(host_env(rendered["remote_engram"]["sparkhead"])).drafter
    assert not S.parse(host_env(rendered["remote_drafter"]["sparkhead"])).drafter
    assert S.parse(host_env(rendered["remote_drafter"]["sparkhead"])).engram


def test_unknown_component_fails_on_the_first_play_with_one_line(tmp_path):
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        PATH=f"{BIN}:{os.environ['PATH']}",
        ANSIBLE_FORCE_COLOR="0",
        NO_COLOR="1",
    )
    for extra in (["-e", "component=bogus"], []):
        r = subprocess.run(
            [str(BIN / "ansible-playbook"), "playbooks/rollback_component.yml", *extra],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 2, r.stdout[-2000:]
        assert (
            "unknown component" in r.stdout and "choose one of async_handoff, remote_drafter, remote_engram" in r.stdout
        )
        # nothing ran past the name check: no other play started
        assert "Rollback component | boilerplate" not in r.stdout and "Boilerplate" not in r.stdout
        assert r.stdout.count("PLAY [") == 1
