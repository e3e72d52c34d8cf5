"""A window's arm switch runs `serve` `tasks_from: configure` alone (playbooks/window_switch.yml),
so every fact the role sets with set_fact that the service definition reads (the role's vars,
defaults and the task files configure includes) must be set inside configure's own include
closure; a fact set only by main's other steps (overlay, artifacts) is absent in a switch, and the
switch would render a different unit than production (found: serve_overlay_site, an empty
`-v :/opt/dsv41/overlay-site:ro` under vLLM). The class is enumerated from the role's own files."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROLE = Path(__file__).resolve().parents[2] / "roles" / "serve"
INCLUDE_KEYS = ("ansible.builtin.include_tasks", "ansible.builtin.import_tasks")


def _tasks(name: str) -> list[dict]:
    return yaml.safe_load((ROLE / "tasks" / name).read_text()) or []


def _walk(tasks: list[dict]):
    for t in tasks:
        yield t
        for key in ("block", "rescue", "always"):
            yield from _walk(t.get(key) or [])


def _included(task: dict) -> str | None:
    for key in INCLUDE_KEYS:
        if key in task:
            arg = task[key]
            return arg["file"] if isinstance(arg, dict) else arg
    return None


def _closure(entry: str) -> set[str]:
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [f for t in _walk(_tasks(name)) if (f := _included(t))]
    return seen


def _facts(name: str) -> set[str]:
    return {k for t in _walk(_tasks(name)) for k in (t.get("ansible.builtin.set_fact") or {})}


def test_configure_sets_every_fact_its_service_definition_reads():
    files = sorted(p.name for p in (ROLE / "tasks").glob("*.yml"))
    inside = _closure("configure.yml")
    assert "service.yml" in inside, inside
    set_inside = set().union(*(_facts(f) for f in inside))
    set_outside = set().union(*(_facts(f) for f in files if f not in inside)) - set_inside
    read_text = "\n".join((ROLE / "tasks" / f).read_text() for f in sorted(inside))
    read_text += "\n".join(p.read_text() for d in ("vars", "defaults") for p in sorted((ROLE / d).glob("*.yml")))
    read_text += "\n".join(p.read_text() for p in sorted((ROLE / "templates").glob("*")) if p.is_file())
    missing = sorted(v for v in set_outside if re.search(rf"\b{re.escape(v)}\b", read_text))
    assert not missing, f"read by configure's service definition but set only outside its closure: {missing}"


def test_the_closure_reader_sees_includes():
    # the helper above finds configure's includes (else the test would pass on nothing)
    assert {"configure.yml", "service.yml", "restart.yml", "overlay_site.yml"} <= _closure("configure.yml")
