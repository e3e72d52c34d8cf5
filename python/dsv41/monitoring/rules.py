"""Render roles/monitoring's rules template outside Ansible (tests, ``dsv41 monitor rules``).

The role renders the same file with ``ansible.builtin.template`` (Jinja2, ``trim_blocks``); the
template only uses plain Jinja2, so both give the same text. ``monitoring_alerts_effective`` is
the role's ``monitoring_alerts`` merged recursively with ``monitoring_alert_overrides``
(roles/monitoring/vars/main.yml does the same with Ansible's ``combine(recursive=True)``).
"""

from __future__ import annotations

from pathlib import Path

from dsv41 import fileio

HEADER = "Generated from roles/monitoring/templates/dsv41.rules.yml.j2; edit the role, not this file."


def merge(base: dict, over: dict) -> dict:
    """Recursive dict merge (Ansible's ``combine(recursive=True)``): ``over`` wins, dicts merge."""
    out = dict(base)
    for k, v in (over or {}).items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def role_dir(project: str | Path) -> Path:
    """roles/monitoring of the project checkout ``project``."""
    return Path(project) / "roles" / "monitoring"


def render(project: str | Path, overrides: dict | None = None, ranks: list[int] | None = None) -> str:
    """The rules file text: the role's default thresholds merged with ``overrides``
    (``monitoring_alert_overrides``' shape), for TP ranks ``ranks`` (default [0, 1])."""
    import jinja2

    rd = role_dir(project)
    defaults = fileio.loads_yaml(fileio.read_text(rd / "defaults" / "main.yml", "the monitoring role's defaults"))
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    tpl = env.from_string(fileio.read_text(rd / "templates" / "dsv41.rules.yml.j2", "the rules template"))
    return tpl.render(
        monitoring_alerts_effective=merge(defaults["monitoring_alerts"], overrides or {}),
        monitoring_ranks=list(ranks if ranks is not None else [0, 1]),
        monitoring_rules_header=HEADER,
    )
