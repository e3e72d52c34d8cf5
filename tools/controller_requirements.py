"""The controller's Python packages, pinned: what execution-environment.yml installs.

The set is derived, never listed by hand: every distribution in the dependency closure of the
dsv41 package's runtime requirements (pyproject.toml ``[project].dependencies``), its ``torch``
extra (the lab's weights and drafter are built on the controller), its build requirements
(``[build-system].requires``: the execution environment builds dsv41 from the installed collection
with ``--no-build-isolation``) and ansible-core and ansible-runner, each pinned by its line of
constraints.txt. The closure is read from the metadata of the distributions installed in this
Python (the project venv, made with ``-c constraints.txt``), markers evaluated here (CPython 3.11,
Linux).

    python tools/controller_requirements.py            # print the set (requirements-controller.txt's body)
    python tools/controller_requirements.py --check    # exit 1 naming the lines that differ

Errors: a distribution of the closure not installed here, or without a pin in constraints.txt,
is one line on stderr and exit 2.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
#: The file execution-environment.yml names as its Python dependencies.
REQUIREMENTS = "requirements-controller.txt"
#: Roots besides pyproject.toml's: the controller runs ansible-playbook and ansible-runner (AWX).
CONTROLLER_TOOLS = ("ansible-core", "ansible-runner")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)==(\S+)")


class MissingPin(Exception):
    """A distribution of the closure is not installed here or has no ``==`` line in constraints.txt."""


def roots(root: Path = ROOT) -> list[Requirement]:
    """The requirements the closure starts from (pyproject.toml + :data:`CONTROLLER_TOOLS`)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    names = (
        project["project"]["dependencies"]
        + project["project"]["optional-dependencies"]["torch"]
        + project["build-system"]["requires"]
        + list(CONTROLLER_TOOLS)
    )
    return [Requirement(r) for r in names]


def closure(start: list[Requirement]) -> set[str]:
    """Canonical names of ``start`` and everything they require here (extras followed, markers
    evaluated for this Python). Raises MissingPin when one is not installed."""
    extras: dict[str, set[str]] = {}
    todo = [(r.name, set(r.extras)) for r in start]
    while todo:
        name, want = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise MissingPin(f"{name}: required by the controller but not installed in {sys.prefix}") from None
        key = canonicalize_name(dist.metadata["Name"])
        if key in extras and want <= extras[key]:
            continue
        extras[key] = extras.get(key, set()) | want
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ["", *sorted(extras[key])]):
                todo.append((req.name, set(req.extras)))
    return set(extras)


def pins(root: Path = ROOT) -> dict[str, str]:
    """``{canonical name: its constraints.txt line}`` for every ``name==version`` line."""
    out = {}
    for line in (root / "constraints.txt").read_text().splitlines():
        m = _PIN.match(line.strip())
        if m:
            out[canonicalize_name(m.group(1))] = line.strip()
    return out


def controller_set(root: Path = ROOT) -> list[str]:
    """The pinned lines (constraints.txt's spelling), sorted by canonical name. Raises MissingPin."""
    have = pins(root)
    names = closure(roots(root))
    missing = sorted(n for n in names if n not in have)
    if missing:
        raise MissingPin(f"constraints.txt has no pin for {', '.join(missing)}")
    return [have[n] for n in sorted(names)]


def requirement_lines(text: str) -> list[str]:
    """The requirement lines of a requirements file (comments and blank lines dropped)."""
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def main(argv: list[str]) -> int:
    try:
        want = controller_set()
    except MissingPin as e:
        print(f"controller_requirements: {e}", file=sys.stderr)
        return 2
    if argv[1:] == ["--check"]:
        have = requirement_lines((ROOT / REQUIREMENTS).read_text())
        if have == want:
            return 0
        for line in sorted(set(want) - set(have)):
            print(f"{REQUIREMENTS}: missing {line}")
        for line in sorted(set(have) - set(want)):
            print(f"{REQUIREMENTS}: not in the controller set: {line}")
        if set(have) == set(want):
            print(f"{REQUIREMENTS}: same lines, another order (sorted by canonical name)")
        return 1
    if argv[1:]:
        print("usage: controller_requirements.py [--check]", file=sys.stderr)
        return 2
    print("\n".join(want))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
