"""The controller's connection lives in each inventory's host_vars/localhost.yml (issue 24): no
task or play on localhost (or delegated to it) restates `ansible_connection: local`; only plays on
the managed hosts that must run on the controller (the lab's bring-up and removal, before the
hosts exist) set it. Enumerated from every YAML file under roles/, playbooks/, molecule/ and the
root playbooks."""

from __future__ import annotations

import yaml

from yamltree import REPO, items, parsed


def test_every_inventory_names_the_controller_connection():
    invs = sorted(p.parent for p in (REPO / "inventories").glob("*/hosts.yml"))
    assert invs, "no inventories found"
    for inv in invs:
        doc = yaml.safe_load((inv / "host_vars" / "localhost.yml").read_text())
        assert doc["ansible_connection"] == "local", inv
        assert doc["ansible_python_interpreter"] == "{{ ansible_playbook_python }}", inv


def test_no_task_or_localhost_play_restates_the_connection():
    offenders = []
    for path, doc in parsed():
        for item in items(doc):
            item_vars = item.get("vars")
            if not isinstance(item_vars, dict) or item_vars.get("ansible_connection") != "local":
                continue
            if "hosts" in item and item["hosts"] != "localhost":
                continue  # a play on the managed hosts that runs on the controller (the lab's bring-up)
            offenders.append(f"{path.relative_to(REPO)}: {item.get('name', '?')}")
    assert not offenders, (
        "restated ansible_connection: local (inventories/*/host_vars/localhost.yml has it):\n" + "\n".join(offenders)
    )
