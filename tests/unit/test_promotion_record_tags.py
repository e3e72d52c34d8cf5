"""playbooks/promotion_record.yml runs whole under any --tags selection and not at all under
--skip-tags promotion.

deploy.yml imports it last, and tagged deploys are the documented way back to production
(``deploy.yml --tags engram_overlay,spec_decode,serve,verify`` after a component rollback; the
molecule verify's ``--check --tags engram_overlay``). An included role's tasks carry only the
``apply`` tags, not the include's own: with ``apply: {tags: [promotion]}`` a tagged deploy skipped
every host's facts while the ``always`` record step still ran and failed with "hosts: {} should be
non-empty" (the combined CI run of 2026-12-01). Ansible's own tag evaluation
(``Taggable.evaluate_tags``) decides here, on the playbook's YAML as written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.playbook.taggable import Taggable

from yamltree import with_imports

REPO = Path(__file__).resolve().parents[2]
PLAYS = [with_imports(p) for p in yaml.safe_load((REPO / "playbooks" / "promotion_record.yml").read_text())]


def _tasks(tasks, inherited=()):
    """(task, its tags with those of the blocks around it) for every task, blocks included."""
    for t in tasks:
        tags = [*inherited, *t.get("tags", [])]
        yield t, tags
        yield from _tasks(t.get("block", []), tags)


class _Tagged(Taggable):
    """A task's resolved tags, judged by Ansible's own rule (no parent block: tags given whole)."""

    def __init__(self, tags: list[str]):
        super().__init__()
        self._loader = DataLoader()
        self.tags = tags

    def _get_all_taggable_objects(self):
        return (self,)


def _selected(tags: list[str], only: set[str], skip: set[str]) -> bool:
    return _Tagged(tags).evaluate_tags(only, skip, {})


# (what the task itself carries, what the tasks an include brings in carry) for every task
STEPS = [
    (t["name"], tags, t.get("ansible.builtin.include_role", {}).get("apply", {}).get("tags"))
    for play in PLAYS
    for t, tags in _tasks(play.get("tasks", []), play.get("tags", []))
]


def test_the_playbook_has_the_three_steps():
    names = [n for n, _, _ in STEPS]
    assert {"Read this host's part of the package", "Record the package", "Point this host at the package"} <= set(
        names
    )
    assert sum(applied is not None for _, _, applied in STEPS) == 2  # facts and pointer are included roles


@pytest.mark.parametrize("only", [{"serve"}, {"engram_overlay", "spec_decode", "serve", "verify"}, {"promotion"}])
def test_any_tag_selection_runs_every_step_and_every_included_task(only):
    for name, tags, applied in STEPS:
        assert _selected(tags, only, set()), name
        if applied is not None:
            assert _selected(applied, only, set()), f"{name}: its included tasks would be skipped under --tags {only}"


def test_skip_tags_promotion_skips_every_step():
    for name, tags, applied in STEPS:
        assert not _selected(tags, set(), {"promotion"}), name
        if applied is not None:
            assert not _selected(applied, set(), {"promotion"}), name


@pytest.mark.parametrize("playbook", sorted(p.name for p in (REPO / "playbooks").glob("promotion_*.yml")))
def test_an_always_include_applies_always_to_what_it_includes(playbook):
    """promotion_current.yml read each host's managed files through the same kind of include:
    under promote.yml/rollback.yml --tags its included tasks would have been skipped too."""
    plays = yaml.safe_load((REPO / "playbooks" / playbook).read_text())
    for play in map(with_imports, plays):
        for task, tags in _tasks(play.get("tasks", []), play.get("tags", [])):
            applied = task.get("ansible.builtin.include_role", {}).get("apply", {}).get("tags")
            if "always" in tags and applied is not None:
                assert "always" in applied, f"{playbook}: {task['name']}"
