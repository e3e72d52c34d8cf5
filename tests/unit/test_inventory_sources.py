"""Every child run a play starts (``ansible-playbook``, ``dsv41 status``) gets every inventory
source of the run, in its order: a site whose settings live in a second source (the vLLM lab's
``-i inventories/sim -i inventories/sim-vllm``, a production site's own group_vars) would otherwise
be judged by the first source's values (another image, another metrics layout). Scans every task
and play file the project ships."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_ONLY = re.compile(r"ansible_inventory_sources\s*(\|\s*first|\[\s*0\s*\]|\|\s*last|\[\s*-1\s*\])")


def _yaml_files() -> list[Path]:
    return sorted([*REPO.glob("*.yml"), *REPO.glob("playbooks/*.yml"), *REPO.glob("roles/*/*/*.yml")])


def test_no_child_run_gets_only_one_inventory_source():
    files = _yaml_files()
    assert len(files) > 100  # the scan sees the project
    bad = [
        f"{p.relative_to(REPO)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if FIRST_ONLY.search(line)
    ]
    assert not bad, bad


def test_every_use_passes_all_sources():
    """Where a task names the run's inventory sources, it passes all of them (join or product)."""
    uses = [
        (p.relative_to(REPO), line.strip())
        for p in _yaml_files()
        for line in p.read_text().splitlines()
        if "ansible_inventory_sources" in line and "fail_msg" not in line
    ]
    assert len(uses) >= 3, uses
    for where, line in uses:
        assert re.search(
            r"ansible_inventory_sources\s*\)?\s*\|\s*(flatten|map|default|join)|product\(ansible_inventory_sources\)",
            line,
        ), (where, line)
