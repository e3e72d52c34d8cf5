"""``ansible_managed`` exists only while the template module renders a file: in a task's own
arguments (``copy: content:``, ``lineinfile``, ``debug``) ansible-core 2.19 fails the task with
"'ansible_managed' is undefined". The monitoring role's three ``/etc/default`` files did exactly
that on the first lab run of its systemd path (production's), 2026-12-03. Every YAML file of the
roles and playbooks is checked, so a new use anywhere fails here rather than on a host."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _yaml_files() -> list[Path]:
    files = [p for d in ("roles", "playbooks", "molecule") for p in (REPO / d).rglob("*.yml")]
    files += sorted(REPO.glob("*.yml"))
    return sorted(files)


def test_ansible_managed_only_in_templates() -> None:
    files = _yaml_files()
    assert len(files) > 50, "the walk found too few files"
    offenders = [
        f"{p.relative_to(REPO)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "ansible_managed" in line
    ]
    assert offenders == [], "ansible_managed is undefined outside the template module: " + ", ".join(offenders)


def test_the_templates_still_carry_it() -> None:
    # the check above must not push the header out of the rendered files (templates keep it)
    templates = [p for p in (REPO / "roles").rglob("*.j2") if "ansible_managed" in p.read_text()]
    assert len(templates) >= 5, templates
