"""roles/dsv41_service is internal (prometheus-community's ``_common`` pattern): only the project's
roles include it, each of its entry points says so first, and each declares its inputs.

The entry points are enumerated from the role's own tasks/ folder; the callers from every Ansible
YAML file of the tree (roles/, playbooks/, molecule/, the root playbooks). A play reaches a
service through the owning role's entry point (serve, engram_server, drafter_worker
``tasks_from: control``).
"""

from __future__ import annotations

import yaml

from yamltree import REPO as ROOT, items, parsed

ROLE = ROOT / "roles" / "dsv41_service"

#: Plays being rewritten by the change-layer work, allowed to include the role directly until the
#: change-layer merge: the integrator moves them to a role and deletes this allow-list.
ALLOWED_UNTIL_CHANGE_LAYER_MERGE: tuple[str, ...] = ()

_INCLUDES = ("ansible.builtin.include_role", "ansible.builtin.import_role", "include_role", "import_role")


def entry_points() -> list[str]:
    """The role's entry points: every task file of tasks/ (``main``, ``files``, ``control``, ``wait``)."""
    return sorted(p.stem for p in (ROLE / "tasks").glob("*.yml"))


def test_each_entry_point_first_refuses_a_caller_outside_a_role() -> None:
    for name in entry_points():
        first = yaml.safe_load((ROLE / "tasks" / f"{name}.yml").read_text())[0]
        assert "ansible.builtin.assert" in first, f"tasks/{name}.yml: the first task is not the guard"
        assert "ansible_parent_role_names" in str(first["ansible.builtin.assert"]["that"]), name
        assert "\n" not in first["ansible.builtin.assert"]["fail_msg"], name
        assert "always" in first.get("tags", []), f"tasks/{name}.yml: the guard runs whatever the tags"


def test_each_entry_point_declares_its_inputs() -> None:
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    assert sorted(specs) == entry_points()
    for name in entry_points():
        text = (ROLE / "tasks" / f"{name}.yml").read_text()
        # the inputs an entry point reads itself (its own registered results aside)
        for var in ("dsv41_service_name", "dsv41_service_ready_url", "dsv41_service_control_names"):
            if f"{{{{ {var}" in text or f" {var} " in text:
                assert var in (specs[name].get("options") or {}), f"{name} reads {var} but does not declare it"


def _callers() -> list[str]:
    out = []
    for path, doc in parsed():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("roles/"):
            continue
        for node in items(doc):
            for key in _INCLUDES:
                arg = node.get(key)
                if isinstance(arg, dict) and arg.get("name") == "dsv41_service":
                    out.append(f"{rel}: {node.get('name', key)}")
            for role in node.get("roles", []) or []:
                if (role.get("role") if isinstance(role, dict) else role) == "dsv41_service":
                    out.append(f"{rel}: roles: dsv41_service")
    return out


def test_no_play_includes_the_internal_role() -> None:
    direct = [c for c in _callers() if c.split(":")[0] not in ALLOWED_UNTIL_CHANGE_LAYER_MERGE]
    assert direct == [], "include the owning role's entry point instead (tasks_from: control):\n" + "\n".join(direct)


def test_the_allow_list_is_still_needed() -> None:
    callers = {c.split(":")[0] for c in _callers()}
    assert [a for a in ALLOWED_UNTIL_CHANGE_LAYER_MERGE if a not in callers] == []
