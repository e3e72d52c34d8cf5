"""bringup.yml's plays, read as YAML and checked by ansible-playbook --syntax-check: every stage of
dsv41.promotion.bringup.STAGES has its plays, every play of a stage ends at once when the plan does
not run it, the change stages are built from roles/change's begin/check/finish (no copy of them),
the component variables come from the plan (harness ROLE_VARS), and the journal is written only
through roles/promotion's journal entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv41.promotion import bringup
from yamltree import imported

ROOT = Path(__file__).resolve().parents[2]
STAGE_FILES = {
    "stock": "playbooks/bringup_stock.yml",
    "links_rows": "playbooks/bringup_links.yml",
    "remote_engram": "playbooks/bringup_change.yml",
    "remote_drafter": "playbooks/bringup_change.yml",
    "async": "playbooks/bringup_change.yml",
    "window": "playbooks/bringup.yml",
}


def _expand(ts: list[dict] | None) -> list[dict]:
    """A task list with each static import replaced by its file's tasks in place (yamltree.imported,
    its blocks opened), so a play's first task is the first task it runs; include_role stays a task."""
    out = []
    for t in imported(ts):
        out += _expand(t["block"]) if "imported_from" in t else [t]
    return out


def _plays(rel: str) -> list[dict]:
    plays = yaml.safe_load((ROOT / rel).read_text())
    for play in plays:
        for k in ("pre_tasks", "tasks", "post_tasks"):
            if k in play:
                play[k] = _expand(play[k])
    return plays


def _tasks(play: dict) -> list[dict]:
    out = []

    def walk(ts):
        for t in ts or []:
            out.append(t)
            for k in ("block", "rescue", "always"):
                walk(t.get(k))

    for k in ("pre_tasks", "tasks", "post_tasks"):
        walk(play.get(k))
    return out


def _guarded(play: dict, stage_expr: str) -> bool:
    """The play's first task ends it when the stage is not in the plan."""
    first = (play.get("pre_tasks") or play.get("tasks") or [{}])[0]
    return (
        first.get("ansible.builtin.meta") == "end_play"
        and stage_expr in str(first.get("when"))
        and "bringup_plan.stages" in str(first.get("when"))
    )


def test_syntax_check():
    bindir = Path(sys.executable).parent
    r = subprocess.run(
        [str(bindir / "ansible-playbook"), "--syntax-check", "bringup.yml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_every_stage_has_its_plays_and_the_entry_point_imports_them_in_order():
    entry = _plays("playbooks/bringup.yml")
    imports = [p.get("ansible.builtin.import_playbook") for p in entry]
    order = [imports.index("bringup_stock.yml"), imports.index("bringup_links.yml")]
    change = [
        (i, p["vars"]["bringup_stage"])
        for i, p in enumerate(entry)
        if p.get("ansible.builtin.import_playbook") == "bringup_change.yml"
    ]
    assert [s for _, s in change] == [s for s in bringup.STAGES if s in bringup.CHANGE_STAGES]
    order += [i for i, _ in change]
    window = next(i for i, p in enumerate(entry) if "window" in p.get("name", "") and "hosts" in p)
    assert order + [window] == sorted(order + [window])
    assert set(STAGE_FILES) == set(bringup.STAGES)
    # recovery of an interrupted change stage before the first change stage
    assert imports.index("promotion_current.yml") < change[0][0]


@pytest.mark.parametrize(
    "rel,expr",
    [
        ("playbooks/bringup_stock.yml", "'stock'"),
        ("playbooks/bringup_links.yml", "'links_rows'"),
        ("playbooks/bringup_change.yml", "bringup_stage"),
    ],
)
def test_every_play_of_a_stage_ends_when_the_plan_does_not_run_it(rel, expr):
    for play in _plays(rel):
        if "hosts" not in play:
            continue  # an import: its own plays guard themselves (promotion_record_skip)
        if "target identity" in play["name"]:
            assert "bringup_plan.stages" in str(_tasks(play)[0].get("when"))
            continue
        assert _guarded(play, expr), f"{rel}: play {play['name']!r} does not end when {expr} is not planned"


def test_change_stages_use_roles_change_and_hold():
    plays = [p for p in _plays("playbooks/bringup_change.yml") if "hosts" in p]
    used = [(t.get("ansible.builtin.include_role") or {}) for p in plays for t in _tasks(p)]
    entry_points = [u.get("tasks_from") for u in used if u.get("name") == "change"]
    assert entry_points == ["begin", "check", "finish"]
    assert plays[0]["vars"]["serve_restart_hold"] is True and plays[0]["vars"]["serve_restart_keep_hold"] is True
    assert "DSV41_WINDOW_TOKEN" in plays[0]["environment"]
    assert [r["role"] if isinstance(r, dict) else r for r in plays[0]["roles"]] == [
        "dsv41",
        "engram_overlay",
        "spec_decode",
        "serve",
    ]


def _keys(node) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in _keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in _keys(v)}
    return set()


def test_component_variables_come_from_the_plan_only():
    """No playbook of the bring-up sets a component variable by name (play vars, set_fact, include
    vars): they are set from the plan's role_vars (harness ROLE_VARS), so the map lives in one place."""
    names = {k for comp in bringup.ROLE_VARS.values() for k in comp}
    for rel in set(STAGE_FILES.values()) | {"bringup.yml"}:
        assert not names & _keys(_plays(rel)), rel
    # and the set_fact that sets them loops over the plan
    loops = [
        str(t.get("loop"))
        for rel in set(STAGE_FILES.values())
        for p in _plays(rel)
        for t in _tasks(p)
        if "{{ item.key }}" in (t.get("ansible.builtin.set_fact") or {})
    ]
    assert len(loops) == 3 and all("bringup_plan.role_vars" in lp for lp in loops), loops


def test_the_journal_is_written_only_through_the_promotion_role():
    for rel in set(STAGE_FILES.values()):
        for play in _plays(rel):
            for t in _tasks(play):
                assert "promotion_journal" not in t and "dsv41.offload.promotion_journal" not in t, (rel, t.get("name"))
