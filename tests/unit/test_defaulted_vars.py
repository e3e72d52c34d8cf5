"""Every variable the Ansible side reads with ``| default(...)`` is defined somewhere, or is an
operator input the docs name.

The class: a variable removed from the roles (the retired netns lab's ``dsv41_lab_host_backend``)
while a reader kept ``| default('netns')``; nothing fails, the reader silently takes its default
branch (two monitoring failure messages then gave the wrong remedy). The readers are enumerated
from the project's own files (roles, playbooks, top-level playbooks, inventories, molecule): every
``NAME | default(`` where NAME is a plain variable (not an attribute, an item of a dict or the
output of a filter). Defined means: a mapping key in any of those YAML files (role defaults and
vars, argument specs, inventories, ``vars:``, ``set_fact``), a ``register:`` or ``loop_var:``
name, a Jinja ``{% set %}`` or ``{% for %}`` variable, or an ``-e NAME=`` a playbook's header
documents. Otherwise it must be an input that docs/ or the README names as a word, and
Ansible's own names (``ansible_*``, the magic variables) are left alone."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from yamltree import REPO as ROOT, yaml_files

#: Ansible's magic variables the project reads (docs.ansible.com, "Special variables").
MAGIC = frozenset(
    {
        "item",
        "groups",
        "hostvars",
        "inventory_hostname",
        "inventory_dir",
        "playbook_dir",
        "omit",
        "role_path",
        "play_hosts",
    }
)
_READ = re.compile(r"(?<![\w.\]'\"|])(?<!\|\s)([a-z_][a-z0-9_]*)\s*\|\s*default\(")
_SET = re.compile(r"\{%-?\s*set\s+([a-z_][a-z0-9_]*)")
_FOR = re.compile(r"\{%-?\s*for\s+([a-z_][a-z0-9_]*)(?:\s*,\s*([a-z_][a-z0-9_]*))?\s+in\b")
_EXTRA = re.compile(r"-e\s+([a-z_][a-z0-9_]*)=")


def ansible_files() -> list[Path]:
    """The files whose Jinja reads variables: the class tests' Ansible YAML
    (:func:`yamltree.yaml_files`: roles, playbooks, molecule, the top-level playbooks), the roles'
    templates and the inventories."""
    return [*yaml_files(), *sorted((ROOT / "roles").rglob("*.j2")), *sorted((ROOT / "inventories").rglob("*.yml"))]


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads Ansible's tags (!unsafe, !vault) as nothing."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _keys(doc, into: set[str]) -> None:
    if isinstance(doc, dict):
        for k, v in doc.items():
            if isinstance(k, str):
                into.add(k)
            if k in ("register", "loop_var", "index_var") and isinstance(v, str):
                into.add(v)
            _keys(v, into)
    elif isinstance(doc, list):
        for x in doc:
            _keys(x, into)


def defined_names(files: list[Path]) -> set[str]:
    """Every name the files define (see the module docstring)."""
    names: set[str] = set()
    for f in files:
        text = f.read_text()
        if f.suffix == ".yml":
            for doc in yaml.load_all(text, Loader=_Loader):
                _keys(doc, names)
        names.update(_SET.findall(text))
        names.update(x for pair in _FOR.findall(text) for x in pair if x)
        names.update(_EXTRA.findall(text))
    return names


def defaulted_reads(files: list[Path]) -> dict[str, list[str]]:
    """``{name: ["path:line", ...]}`` of every ``name | default(`` read."""
    out: dict[str, list[str]] = {}
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in _READ.finditer(line):
                out.setdefault(m.group(1), []).append(f"{f.relative_to(ROOT)}:{i}")
    return out


def documented_words() -> set[str]:
    """The words of docs/*.md and the README."""
    text = "\n".join(p.read_text() for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"])
    return set(re.findall(r"[a-z_][a-z0-9_]*", text))


def test_the_scan_sees_the_readers():
    # the scanner's own check: known readers of each kind are found, attributes and filters are not
    reads = defaulted_reads(ansible_files())
    assert "window_ready_timeout" in reads and "status_window_s" in reads and "dsv41_drafter_train_steps" in reads
    assert not {"stdout", "first", "last", "results"} & set(reads)


def test_every_defaulted_variable_is_defined_or_a_documented_input():
    files = ansible_files()
    defined, docs = defined_names(files), documented_words()
    orphans = {
        n: where
        for n, where in defaulted_reads(files).items()
        if n not in defined and n not in MAGIC and not n.startswith("ansible_") and n not in docs
    }
    assert not orphans, (
        "read with default() but neither defined by a role, playbook or inventory nor an input "
        f"the docs name (a removed variable?): {orphans}"
    )
