"""What a test run left in the repository tree (tests/unit/conftest.py fails the session on it):
the untracked and ignored paths of a git checkout before and after, the paths a run may create
(caches, build outputs) left out."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: Ignored paths a test run (or the build it needs) may create in the tree, and why; a path is
#: tolerated when one of its directories is named here or its name ends with a listed suffix.
TOLERATED = {
    "__pycache__": "Python's bytecode cache",
    ".pytest_cache": "pytest's cache (runs without -p no:cacheprovider)",
    ".hypothesis": "hypothesis's example database",
    ".ansible": "ansible-core's local temporary directory",
    ".lab": "the lab's own state (lab tests bring it up)",
    "build": "the native transport's build directory",
    ".whl": "the wheelhouse the lab's image is built from",
    ".gl": "the lab's serving image build",
    ".cache": "downloaded rootfs and tool caches",
    ".venv": "the virtual environment",
}
TOLERATED_SUFFIXES = {
    ".pyc": "bytecode",
    ".pyo": "bytecode",
    ".so": "the native transport built in place",
    ".egg-info": "setuptools' metadata of the editable install",
}


def repo_files(repo: Path) -> set[str] | None:
    """Untracked (``?? path``) and ignored (``!! path``, directories as ``dir/``) paths of the git
    checkout ``repo``, as ``git status`` names them; None when ``repo`` is no git checkout."""
    try:
        r = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignored=matching"],
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return {e for e in r.stdout.decode(errors="surrogateescape").split("\0") if e[:3] in ("?? ", "!! ")}


def repo_leftovers(before: set[str], after: set[str], *, ignored: bool = True) -> list[str]:
    """What a run added to the tree (entries of :func:`repo_files` in ``after``, not in ``before``),
    :data:`TOLERATED` paths left out: the paths, sorted. ``ignored=False``: untracked paths only
    (a session that ran lab tests too: playbooks write their outputs, ``windows/``, ``packages/``,
    under the repository by default, ignored by git on purpose)."""

    def tolerated(entry: str) -> bool:
        if entry.startswith("!! ") and not ignored:
            return True
        parts = entry[3:].rstrip("/").split("/")
        return bool(set(parts) & set(TOLERATED)) or parts[-1].endswith(tuple(TOLERATED_SUFFIXES))

    return sorted(e[3:] for e in after - before if not tolerated(e))
