"""Render what deploy.yml writes on each host of an inventory, with Ansible's own inventory,
variable manager and templar, without a connection to any host.

The hosts' roles are read from playbooks/deploy.yml (each play's ``hosts`` pattern and ``roles``);
the files from those roles' task files: every ``ansible.builtin.template`` task, and every
inclusion of roles/dsv41_service's ``files`` or ``main`` entry point (its env.j2 and
systemd.service.j2 with the including task's ``vars``). Variables are layered in Ansible's order:
role defaults of the host's plays, then the inventory (group_vars, host_vars, magic variables,
``hostvars``), role vars, the task's ``vars``, then the registered results and facts the tasks
read (``FACTS``: what a host with every input in place returns). ``when`` is not evaluated: a file
that a condition would skip is rendered anyway, and a check reads only the files it names.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SERVICE_ROLE = "dsv41_service"
ANSIBLE_MANAGED = "Ansible managed: do not edit"

_FILES_SHA = "0" * 64
#: Registered results and set_fact values that the rendered files read, as a host with every input
#: in place gives them (placeholders for digests): name -> value.
FACTS = {
    "serve_inputs": {"results": []},
    "serve_inputs_sha256": hashlib.sha256(b"inputs").hexdigest(),
    "serve_overlay_site": "/opt/dsv41/overlay/site-0123456789abcdef",
    "engram_overlay_manifest_stat": {"stat": {"exists": True, "checksum": _FILES_SHA}},
    "engram_server_manifest_stat": {"stat": {"exists": True, "checksum": _FILES_SHA}},
    "drafter_worker_identity": {"stdout": json.dumps({"drafter": "1" * 64})},
}


@dataclass
class Rendered:
    """One host's files: ``files`` maps each destination path to its rendered text."""

    host: str
    groups: list[str]
    roles: list[str]
    files: dict[str, str] = field(default_factory=dict)


def deploy_roles(playbook: Path = REPO / "playbooks/deploy.yml") -> list[tuple[list[str], list[str]]]:
    """The plays of ``playbook`` that apply roles: ``[(host group names, role names)]`` in play order
    (``hosts: spark:offload`` -> ``["spark", "offload"]``)."""
    out = []
    for play in yaml.safe_load(playbook.read_text()):
        if "roles" in play and "hosts" in play:
            roles = [r["role"] if isinstance(r, dict) else r for r in play["roles"]]
            out.append((str(play["hosts"]).split(":"), roles))
    return out


def _walk(tasks: list) -> list[dict]:
    """Every task of a task list, blocks flattened."""
    out = []
    for t in tasks or []:
        for key in ("block", "rescue", "always"):
            if key in t:
                out.extend(_walk(t[key]))
        if not any(k in t for k in ("block", "rescue", "always")):
            out.append(t)
    return out


def role_writers(role: str) -> list[dict]:
    """The tasks of ``role`` (every file under its tasks/) that write a file through a template:
    ``{"kind": "template", "src", "dest", "vars", "role"}`` or ``{"kind": "service", "vars", "role"}``
    (an inclusion of dsv41_service's files/main entry point)."""
    out = []
    for f in sorted((REPO / "roles" / role / "tasks").glob("*.yml")):
        for t in _walk(yaml.safe_load(f.read_text())):
            tmpl = t.get("ansible.builtin.template")
            inc = t.get("ansible.builtin.include_role") or t.get("ansible.builtin.import_role")
            if tmpl:
                out.append(
                    {
                        "kind": "template",
                        "src": tmpl["src"],
                        "dest": tmpl["dest"],
                        "vars": t.get("vars", {}),
                        "role": role,
                        "task": f"{f.name}: {t.get('name')}",
                    }
                )
            elif inc and inc.get("name") == SERVICE_ROLE and inc.get("tasks_from", "main") in ("main", "files"):
                out.append(
                    {"kind": "service", "vars": t.get("vars", {}), "role": role, "task": f"{f.name}: {t.get('name')}"}
                )
    return out


_PLUGINS_LOADED = False


class Renderer:
    """Ansible's view of an inventory (a directory, or a list of them as ``-i A -i B``): ``render(host)`` -> ``Rendered``; ``var(host, name)`` -> the
    resolved value of a variable for that host (the same layers). ``overrides`` are extra vars
    (highest precedence), as ``-e`` gives them."""

    def __init__(self, inventory: Path | list[Path], overrides: dict | None = None) -> None:
        global _PLUGINS_LOADED
        if not _PLUGINS_LOADED:
            from ansible.plugins.loader import init_plugin_loader

            init_plugin_loader()
            _PLUGINS_LOADED = True
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.vars.hostvars import HostVars
        from ansible.vars.manager import VariableManager

        self.loader = DataLoader()
        sources = inventory if isinstance(inventory, list) else [inventory]
        # several inventory directories, later ones overriding (as ansible-playbook -i A -i B)
        self.inventory = InventoryManager(loader=self.loader, sources=[str(p / "hosts.yml") for p in sources])
        self.vm = VariableManager(loader=self.loader, inventory=self.inventory)
        self.vm._hostvars = HostVars(inventory=self.inventory, variable_manager=self.vm, loader=self.loader)
        self.overrides = overrides or {}
        self.plays = deploy_roles()
        self._base: dict[tuple, dict] = {}

    def variant(self, overrides: dict) -> Renderer:
        """The same inventory with other extra vars (sharing the parsed inventory and layers)."""
        other = object.__new__(Renderer)
        other.__dict__.update(self.__dict__)
        other.overrides = overrides
        return other

    def _load(self, path: Path) -> dict:
        return (self.loader.load_from_file(str(path), trusted_as_template=True) or {}) if path.exists() else {}

    def roles_of(self, host: str) -> list[str]:
        """The roles deploy.yml's plays apply to ``host``, in order, each once."""
        groups = {g.name for g in self.inventory.get_host(host).get_groups()}
        out: list[str] = []
        for pattern, roles in self.plays:
            if groups & set(pattern) or host in pattern:
                out += [r for r in roles if r not in out]
        return out

    def layers(self, host: str, task_vars: dict | None = None, roles: tuple[str, ...] = ()) -> dict:
        """The variables of ``host`` in Ansible's precedence (later wins); ``roles``: further roles
        whose defaults and vars join those of deploy.yml's plays (a role another playbook runs)."""
        key = (host, roles)
        if key not in self._base:
            names = self.roles_of(host) + [r for r in roles if r not in self.roles_of(host)]
            if any(w["kind"] == "service" for r in names for w in role_writers(r)) and SERVICE_ROLE not in names:
                names.append(SERVICE_ROLE)
            base: dict = {}
            for r in names:
                base.update(self._load(REPO / "roles" / r / "defaults/main.yml"))
            base.update(self.vm.get_vars(host=self.inventory.get_host(host), include_hostvars=True))
            for r in names:
                base.update(self._load(REPO / "roles" / r / "vars/main.yml"))
            self._base[key] = base
        out = dict(self._base[key])
        out.update(self._trusted(task_vars or {}))
        out.update(FACTS)
        out["ansible_managed"] = ANSIBLE_MANAGED
        out["ansible_check_mode"] = False
        out.update(self.overrides)
        return out

    def _trusted(self, value):
        from ansible.template import trust_as_template

        if isinstance(value, str):
            return trust_as_template(value)
        if isinstance(value, dict):
            return {k: self._trusted(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._trusted(v) for v in value]
        return value

    def template(self, variables: dict, text: str):
        """``text`` (a template body or a ``{{ }}`` expression) rendered over ``variables``."""
        from ansible.template import Templar

        return Templar(loader=self.loader, variables=variables).template(self._trusted(text))

    def var(self, host: str, name: str, roles: tuple[str, ...] = ()):
        """The resolved value of ``name`` for ``host`` (KeyError: no layer defines it); ``roles`` as
        for ``layers``."""
        v = self.layers(host, roles=roles)
        return self.template(v, v[name]) if isinstance(v[name], str) else self.template(v, f"{{{{ {name} }}}}")

    def render(self, host: str) -> Rendered:
        """Every file deploy.yml's roles template on ``host``."""
        groups = sorted(g.name for g in self.inventory.get_host(host).get_groups() if g.name != "all")
        out = Rendered(host=host, groups=groups, roles=self.roles_of(host))
        for role in out.roles:
            for w in role_writers(role):
                v = self.layers(host, w["vars"])
                if w["kind"] == "template":
                    dest = str(self.template(v, w["dest"]))
                    body = (REPO / "roles" / role / "templates" / w["src"]).read_text()
                    out.files[dest] = str(self.template(v, body))
                    continue
                for k in [k for k in v if k.startswith("dsv41_service_")]:
                    v[k] = self.template(v, v[k])
                name = v["dsv41_service_name"]
                tdir = REPO / "roles" / SERVICE_ROLE / "templates"
                out.files[str(v["dsv41_service_env_file"])] = str(self.template(v, (tdir / "env.j2").read_text()))
                out.files[f"/etc/systemd/system/{name}.service"] = str(
                    self.template(v, (tdir / "systemd.service.j2").read_text())
                )
        return out


def unit_key(text: str, key: str) -> list[str]:
    """The values of ``key=`` lines in a unit file (in order)."""
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def env_file(text: str) -> dict[str, str]:
    """An env file's ``KEY=VALUE`` lines (comments and blanks skipped)."""
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


_ESC = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "s": " "}


def systemd_argv(line: str) -> list[str]:
    """Split an ExecStart value as systemd does (systemd.service(5), "Command lines"): words
    separated by whitespace, double- or single-quoted words, backslash escapes, ``%%`` -> ``%``
    and ``$$`` -> ``$``. A lone ``%x`` specifier or a ``$VAR`` reference raises ValueError (the
    rendered line must expand nothing)."""
    out, i, n = [], 0, len(line)
    while i < n:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n:
            break
        word, quote = [], None
        if line[i] in "\"'":
            quote, i = line[i], i + 1
        while i < n:
            c = line[i]
            if quote and c == quote:
                i += 1
                break
            if not quote and c in " \t":
                break
            if c == "\\" and i + 1 < n:
                if line[i + 1] not in _ESC:
                    raise ValueError(f"unknown escape \\{line[i + 1]} in {line!r}")
                word.append(_ESC[line[i + 1]])
                i += 2
                continue
            if c in "%$":
                if i + 1 < n and line[i + 1] == c:
                    word.append(c)
                    i += 2
                    continue
                if c == "%" or re.match(r"[A-Za-z_{]", line[i + 1 : i + 2]):
                    raise ValueError(f"unescaped {c} at {i} in {line!r}")
            word.append(c)
            i += 1
        out.append("".join(word))
    return out
