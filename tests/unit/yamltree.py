"""The project's Ansible YAML as the class tests walk it (a helper module, not a test file).

``yaml_files()``: every ``*.yml`` under roles/, playbooks/, molecule/ and the root playbooks,
sorted. ``parsed()``: each of them with its parsed document. ``items(node)``: every mapping in a parsed list of plays or tasks, with blocks
(``block``/``rescue``/``always``), ``tasks``/``pre_tasks``/``post_tasks`` and ``handlers`` walked.
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def yaml_files():
    """Every Ansible YAML file of the tree (Paths, sorted within each folder)."""
    for d in ("roles", "playbooks", "molecule"):
        yield from sorted((REPO / d).rglob("*.yml"))
    yield from sorted(REPO.glob("*.yml"))


def parsed():
    """``(path, document)`` for every file of :func:`yaml_files` that parses as YAML.

    A file that does not parse is skipped here: ansible-lint's syntax check reports it.
    """
    for path in yaml_files():
        try:
            yield path, yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue


def items(node):
    """Every mapping in a list of plays or tasks, blocks and handlers included."""
    if isinstance(node, list):
        for x in node:
            yield from items(x)
    elif isinstance(node, dict):
        yield node
        for k in ("tasks", "pre_tasks", "post_tasks", "handlers", "block", "rescue", "always"):
            yield from items(node.get(k))


def imported(tasks, role: str | None = None):
    """A task list as Ansible loads it: each static ``import_role`` with ``tasks_from`` (the plays'
    bodies live in role entry points; a role's ``main`` applied whole stays a task) and, inside a role's file, each ``import_tasks`` of a
    sibling file, replaced by a block of that file's tasks carrying the import's own keywords (name,
    tags, when; marked ``imported_from``: the file), blocks walked; include_role (dynamic) stays a task. ``role``: the role whose task
    file ``tasks`` came from (None for a play). A test that reads a play's tasks reads them through
    this, so moving a body into a role does not change what it checks."""
    out = []
    for t in tasks or []:
        if not isinstance(t, dict):
            out.append(t)
            continue
        imp = t.get("ansible.builtin.import_role")
        sub = t.get("ansible.builtin.import_tasks")
        if isinstance(imp, dict) and imp.get("tasks_from"):
            name, entry = imp["name"], imp["tasks_from"]
        elif isinstance(sub, str) and role is not None:
            name, entry = role, sub.removesuffix(".yml")
        else:
            out.append({k: imported(v, role) if k in ("block", "rescue", "always") else v for k, v in t.items()})
            continue
        body = yaml.safe_load((REPO / "roles" / name / "tasks" / f"{entry}.yml").read_text())
        block = {k: v for k, v in t.items() if k not in ("ansible.builtin.import_role", "ansible.builtin.import_tasks")}
        block["block"] = imported(body, name)
        block["imported_from"] = f"roles/{name}/tasks/{entry}.yml"  # not an Ansible keyword: the tests' mark
        out.append(block)
    return out


def with_imports(play):
    """``play`` with its ``pre_tasks``, ``tasks``, ``post_tasks`` and ``handlers`` through :func:`imported`
    (an ``import_playbook`` item comes back as it is)."""
    keys = ("pre_tasks", "tasks", "post_tasks", "handlers")
    return {k: imported(v) if k in keys else v for k, v in play.items()}
