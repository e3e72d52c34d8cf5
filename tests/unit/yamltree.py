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


def imported(tasks):
    """A task list as Ansible loads it: each static ``import_role`` with ``tasks_from`` (the plays'
    bodies live in role entry points) replaced by a block of that task file's tasks carrying the
    import's own keywords (name, tags, when), blocks walked. A test that reads a play's tasks reads
    them through this, so moving a body into a role does not change what it checks."""
    out = []
    for t in tasks or []:
        imp = t.get("ansible.builtin.import_role") if isinstance(t, dict) else None
        if isinstance(imp, dict) and imp.get("tasks_from"):
            body = yaml.safe_load((REPO / "roles" / imp["name"] / "tasks" / f"{imp['tasks_from']}.yml").read_text())
            block = {k: v for k, v in t.items() if k != "ansible.builtin.import_role"}
            block["block"] = imported(body)
            out.append(block)
        elif isinstance(t, dict):
            out.append({k: imported(v) if k in ("block", "rescue", "always") else v for k, v in t.items()})
        else:
            out.append(t)
    return out


def with_imports(play):
    """``play`` with its ``pre_tasks``, ``tasks``, ``post_tasks`` and ``handlers`` through :func:`imported`
    (an ``import_playbook`` item comes back as it is)."""
    keys = ("pre_tasks", "tasks", "post_tasks", "handlers")
    return {k: imported(v) if k in keys else v for k, v in play.items()}
