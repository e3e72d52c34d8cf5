"""No handler reaches a block with ``rescue`` or ``always``.

Ansible runs the tasks a handler includes, but never the ``rescue`` (or ``always``) of a block among
them: the failure ends the host (ansible/ansible#80228, seen again with ansible-core 2.19 on the
nspawn lab, where the readiness wait's "is not ready" message never appeared). So every task file a
handler can reach, through ``include_tasks``/``import_tasks`` or a role's ``tasks_from``, followed
transitively, must do without them. The files are found from every role's ``handlers/`` and every
play's ``handlers:``, not from a list kept here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from yamltree import REPO, items, parsed

INCLUDES = {f"{ns}{verb}" for ns in ("", "ansible.builtin.") for verb in ("include_tasks", "import_tasks")}
ROLES = {f"{ns}{verb}" for ns in ("", "ansible.builtin.") for verb in ("include_role", "import_role")}


def _role_of(path: Path) -> Path | None:
    rel = path.relative_to(REPO).parts
    return REPO / "roles" / rel[1] if rel[0] == "roles" else None


def _included(item: dict, path: Path) -> list[Path]:
    """The task files one task includes (static file names only)."""
    out = []
    for key in INCLUDES & set(item):
        arg = item[key]
        name = arg.get("file") if isinstance(arg, dict) else arg
        if not isinstance(name, str) or "{{" in name:
            continue
        role = _role_of(path)
        for base in ([role / "tasks", role / "handlers"] if role else []) + [path.parent]:
            if (base / name).is_file():
                out.append(base / name)
                break
    for key in ROLES & set(item):
        arg = item[key] if isinstance(item[key], dict) else {}
        role, tasks_from = arg.get("name"), arg.get("tasks_from", "main")
        if isinstance(role, str) and isinstance(tasks_from, str) and "{{" not in role + tasks_from:
            stem = tasks_from if tasks_from.endswith(".yml") else tasks_from + ".yml"
            if (REPO / "roles" / role / "tasks" / stem).is_file():
                out.append(REPO / "roles" / role / "tasks" / stem)
    return out


def _handler_roots() -> list[tuple[Path, list]]:
    roots = []
    for path in sorted(REPO.glob("roles/*/handlers/*.yml")):
        roots.append((path, yaml.safe_load(path.read_text()) or []))
    for path, doc in parsed():
        if isinstance(doc, list):
            for play in doc:
                if isinstance(play, dict) and isinstance(play.get("handlers"), list) and "hosts" in play:
                    roots.append((path, play["handlers"]))
    return roots


def _reachable_from_handlers() -> dict[Path, str]:
    """``{task file: the handler file it is reached from}``, the handler files included."""
    seen: dict[Path, str] = {}
    todo = [(path, doc, str(path.relative_to(REPO))) for path, doc in _handler_roots()]
    while todo:
        path, doc, origin = todo.pop()
        for item in items(doc):
            for inc in _included(item, path):
                if inc not in seen:
                    seen[inc] = origin
                    todo.append((inc, yaml.safe_load(inc.read_text()) or [], origin))
    return seen


def _rescues(doc) -> list[str]:
    return [str(item.get("name", "?")) for item in items(doc) if "block" in item and ({"rescue", "always"} & set(item))]


def test_the_walk_finds_the_service_roles_readiness_wait():
    reached = _reachable_from_handlers()
    assert REPO / "roles/dsv41_service/tasks/wait.yml" in reached
    assert REPO / "roles/dsv41_service/tasks/control.yml" in reached


@pytest.mark.parametrize("path", sorted(_reachable_from_handlers()), ids=lambda p: str(p.relative_to(REPO)))
def test_no_file_a_handler_reaches_has_a_rescue(path):
    doc = yaml.safe_load(path.read_text()) or []
    assert not _rescues(doc), (
        f"{path.relative_to(REPO)} is reached from a handler "
        f"({_reachable_from_handlers()[path]}) and has block(s) with rescue/always, "
        f"which Ansible never runs there: {_rescues(doc)}"
    )


def test_the_check_fails_on_a_rescue():
    doc = yaml.safe_load(
        "- name: b\n  block: [{name: t, ansible.builtin.command: 'true'}]\n"
        "  rescue: [{name: r, ansible.builtin.fail: {msg: x}}]\n"
    )
    assert _rescues(doc) == ["b"]
    assert not _rescues(yaml.safe_load("- name: b\n  when: x\n  block: [{name: t, ansible.builtin.command: 'true'}]\n"))
