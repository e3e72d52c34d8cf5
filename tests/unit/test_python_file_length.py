"""No Python file over 600 lines (DEVELOPERS.md): every tracked ``*.py`` (``git ls-files``, so a
new file is checked the moment it is added) is counted; a file over the limit is split along its
concerns, helpers of tests going to ``*util.py`` modules (test_test_imports)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


def tracked_python_files(root: Path) -> list[Path]:
    """Every ``*.py`` that git tracks under ``root`` (absolute paths; raises CalledProcessError
    outside a git checkout). Deleted-but-unstaged files are left out."""
    out = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=root, capture_output=True, check=True, timeout=60)
    return [root / n for n in out.stdout.decode().split("\0") if n and (root / n).is_file()]


def too_long(paths: list[Path], root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """``"PATH: N lines"`` (PATH relative to ``root``) for each file of more than ``limit`` lines
    (empty: none)."""
    found = []
    for p in paths:
        with p.open("rb") as f:  # bytes: a file need not be valid UTF-8 to be counted
            n = sum(1 for _ in f)
        if n > limit:
            found.append(f"{p.relative_to(root)}: {n} lines")
    return found


def test_the_class_is_enumerated():
    files = tracked_python_files(ROOT)
    names = {p.relative_to(ROOT).as_posix() for p in files}
    assert {"tests/unit/test_python_file_length.py", "plugins/modules/admission.py", "setup.py"} <= names
    assert len(files) > 100


def test_no_python_file_over_the_limit():
    assert too_long(tracked_python_files(ROOT)) == []


def test_the_check_finds_a_long_file(tmp_path):
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n" * MAX_LINES)  # exactly the limit: allowed
    assert too_long([long, short], tmp_path) == [f"long.py: {MAX_LINES + 1} lines"]
