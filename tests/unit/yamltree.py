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
