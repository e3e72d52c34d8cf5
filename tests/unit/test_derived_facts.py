"""Facts derived from the inventory are computed once, in roles/dsv41/defaults/main.yml.

The class: one fact computed in many places drifts (a window that restored rank 0 by its own
lookup, a URL written with a host name in each inventory, a unit name spelled in a playbook). The
derived facts are enumerated from the defaults role itself: ``dsv41_rank0_host``, ``dsv41_api_url``,
the links by purpose, the transport, and every ``dsv41_*_service`` unit name, whose literal values
are the service-name literals no other file may spell. Every Ansible YAML file and Jinja template
(roles/, playbooks/, molecule/, the root playbooks, inventories/, monitoring/, the test production
inventory) is scanned for: a rank-0 selection, a link-by-purpose selection, the API URL built from
a management address, a derived name defined again, a role restating one under its own name, and
a unit name as a literal. Comments and argument specs (documentation) are not scanned; lines naming
an image are not units (the lab's image repository is also called dsv41-serve).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from yamltree import REPO as ROOT, yaml_files

DEFAULTS = ROOT / "roles" / "dsv41" / "defaults" / "main.yml"

#: The derived facts (other than the unit names, found by their pattern below). Each must be a key
#: of the defaults role; nothing else may define it.
DERIVED = (
    "dsv41_rank0_host",
    "dsv41_api_url",
    "dsv41_links_by_host",
    "dsv41_offload_links",
    "dsv41_offload_link",
    "dsv41_fabric_link",
    "dsv41_transport",
    "dsv41_transport_listeners",
    "dsv41_api_key_file_active",
)

#: Files being rewritten by the change-layer work, allowed until the change-layer merge: the
#: integrator switches them to the derived names and deletes this allow-list.
ALLOWED_UNTIL_CHANGE_LAYER_MERGE: tuple[str, ...] = ()

#: Role variables that restated another role's or the defaults role's value under a new name.
RESTATED = ("window_api_url", "window_serve_service", "window_health_retries", "window_container_runtime")

_RANK0 = (
    re.compile(r"""(select|reject)attr\(\s*['"]dsv41_rank['"]\s*,\s*['"](eq|equalto|==|sameas)['"]\s*,\s*['"]?0"""),
    re.compile(r"""dsv41_rank\s*(\|\s*int\s*\)?)?\s*==\s*['"]?0\b"""),
    re.compile(r"""\.dsv41_rank\s*(\|\s*int)?\s*\)?\s*==\s*0"""),
)
_LINKS = (
    re.compile(r"""(select|reject)attr\(\s*['"]purpose['"]"""),
    re.compile(r"""\.purpose\s*(==|!=|in\b)|\[\s*['"]purpose['"]\s*\]\s*(==|!=|in\b)"""),
)
#: The API URL built from a management address and the API port (the definition's own recipe).
_API_URL = re.compile(r"dsv41_mgmt_address.*dsv41_api_port|dsv41_api_port.*dsv41_mgmt_address")
#: The clients' key file chosen from the key switch (the definition's own recipe).
_API_KEY = re.compile(r"dsv41_api_key_file\s+if\s+dsv41_api_key_enabled")
#: A role's own name for another rank 0 / API URL / link fact.
_RESTATE_KEY = re.compile(r"^\s*(?!dsv41_)[a-z][a-z0-9_]*_(rank0_host|api_url|offload_link|fabric_link)\s*:")


def _defaults() -> dict:
    return yaml.safe_load(DEFAULTS.read_text())


def service_literals() -> dict[str, str]:
    """``{unit name: variable}`` for every ``dsv41_*_service`` the defaults role defines as a
    literal (a unit name without template)."""
    return {
        v: k
        for k, v in _defaults().items()
        if re.fullmatch(r"dsv41_[a-z0-9_]+_service", k) and isinstance(v, str) and "{" not in v
    }


def scanned_files() -> list[Path]:
    """Every Ansible YAML file and Jinja template of the tree, the defaults role excluded."""
    files = set(yaml_files())
    for d in ("roles", "inventories", "monitoring", "tests/data/production_inventory"):
        for pat in ("*.yml", "*.yaml", "*.j2"):
            files.update((ROOT / d).rglob(pat))
    files.discard(DEFAULTS)
    return sorted(files)


def _allowed(rel: str) -> bool:
    return any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in ALLOWED_UNTIL_CHANGE_LAYER_MERGE)


def _code_lines(path: Path):
    """``(line number, line)`` of the file, full-line YAML and Jinja comments left out."""
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        s = line.strip()
        if s.startswith("#") or s.startswith("{#"):
            continue
        yield n, line


def violations(path: Path, literals: dict[str, str]) -> list[str]:
    """What in ``path`` computes or restates a derived fact, one line each (``file:line: what``)."""
    rel = path.relative_to(ROOT).as_posix()
    if path.name == "argument_specs.yml":
        return []
    lit = (
        re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, sorted(literals, key=len, reverse=True))) + r")(?![\w-])")
        if literals
        else None
    )
    found = []
    for n, line in _code_lines(path):
        where = f"{rel}:{n}"
        if any(p.search(line) for p in _RANK0):
            found.append(f"{where}: selects rank 0 (use dsv41_rank0_host)")
        if any(p.search(line) for p in _LINKS):
            found.append(
                f"{where}: selects links by purpose (use dsv41_offload_links / dsv41_offload_link / "
                "dsv41_fabric_link / dsv41_links_by_host)"
            )
        if _API_URL.search(line):
            found.append(f"{where}: builds rank 0's API URL (use dsv41_api_url)")
        if _API_KEY.search(line):
            found.append(f"{where}: chooses the clients' API key file (use dsv41_api_key_file_active)")
        for name in (*DERIVED, *literals.values()):
            if re.match(rf"\s*{name}\s*:", line):
                found.append(f"{where}: defines {name} again (roles/dsv41/defaults/main.yml defines it)")
        for name in RESTATED:
            if re.match(rf"\s*{name}\s*:", line):
                found.append(f"{where}: {name} restates a shared default under a new name")
        m = _RESTATE_KEY.match(line)
        if m:
            found.append(f"{where}: {m.group(0).strip()} restates a derived fact (use the dsv41_ name)")
        if lit and "image" not in line.lower():
            for m in lit.finditer(line):
                found.append(f"{where}: the unit name {m.group(1)} as a literal (use {literals[m.group(1)]})")
    return found


def test_the_derived_facts_are_defined_in_the_defaults_role() -> None:
    defaults = _defaults()
    assert [n for n in DERIVED if n not in defaults] == []
    assert set(service_literals().values()) >= {
        "dsv41_serve_service",
        "dsv41_engram_service",
        "dsv41_drafter_service",
        "dsv41_ops_exporter_service",
    }


def test_the_allow_list_names_existing_files() -> None:
    for a in ALLOWED_UNTIL_CHANGE_LAYER_MERGE:
        assert (ROOT / a).exists(), f"{a} is allowed but gone: remove it from the allow-list"


def test_no_derived_fact_is_computed_outside_the_defaults_role() -> None:
    literals = service_literals()
    found = []
    for path in scanned_files():
        if not _allowed(path.relative_to(ROOT).as_posix()):
            found += violations(path, literals)
    assert found == [], "derived facts computed outside roles/dsv41/defaults/main.yml:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text,what",
    [
        (
            "x: \"{{ groups['spark'] | map('extract', hostvars) | selectattr('dsv41_rank', 'eq', 0) | first }}\"",
            "rank 0",
        ),
        ("  when: (dsv41_rank | int) == 0", "rank 0"),
        ("x: \"{{ (dsv41_links | selectattr('purpose', 'equalto', 'offload') | first).name }}\"", "by purpose"),
        ("x: \"http://{{ hostvars['sparkhead'].dsv41_mgmt_address }}:{{ dsv41_api_port }}\"", "API URL"),
        ("dsv41_api_url: http://h:8000", "defines dsv41_api_url"),
        (
            "    DSV41_API_KEY_FILE: \"{{ dsv41_api_key_file if dsv41_api_key_enabled | bool else '' }}\"",
            "API key file",
        ),
        ("window_serve_service: dsv41-serve", "restates"),
        ('drafter_worker_rank0_host: "{{ x }}"', "restates a derived fact"),
        ("    dsv41_service_control_names: [dsv41-drafter]", "unit name dsv41-drafter"),
    ],
)
def test_each_pattern_is_caught(tmp_path: Path, text: str, what: str, monkeypatch) -> None:
    """Each kind of restatement in a file is reported (the scan is not vacuous)."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    f = tmp_path / "roles" / "x" / "defaults" / "main.yml"
    f.parent.mkdir(parents=True)
    f.write_text(f"---\n{text}\n# {text}\n")
    out = violations(f, service_literals())
    assert len(out) >= 1 and all(o.startswith("roles/x/defaults/main.yml:2:") for o in out), out
    assert any(what in o for o in out), out


def test_lab_image_names_and_longer_names_are_not_units(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    f = tmp_path / "inventories" / "x.yml"
    f.parent.mkdir(parents=True)
    f.write_text(
        'serve_image_repository: dsv41-serve\nlab_build: dsv41-serve-build\nunit: "{{ dsv41_serve_service }}"\n'
    )
    assert violations(f, service_literals()) == []
