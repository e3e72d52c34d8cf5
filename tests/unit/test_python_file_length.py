"""No Python file over 600 lines and no C++ file over 900 (DEVELOPERS.md): every tracked ``*.py``
and every tracked C++ source and header (``git ls-files``, so a new file is checked the moment it
is added) is counted; a file over its limit is split along its concerns, helpers of tests going to
``*util.py`` modules (test_test_imports), a native extension's concerns to headers of their own
(setup.py's ``NATIVE`` lists each extension's files)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600
#: the C++ cap: an extension's translation unit and each header it includes
MAX_CPP_LINES = 900
CPP_PATTERNS = ("*.cpp", "*.cc", "*.h", "*.hpp")


def tracked_files(root: Path, *patterns: str) -> list[Path]:
    """Every file matching one of ``patterns`` (git pathspecs, e.g. ``*.py``) that git tracks under
    ``root`` (absolute paths; raises CalledProcessError outside a git checkout). Deleted-but-unstaged
    files are left out."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", *patterns], cwd=root, capture_output=True, check=True, timeout=60
    )
    return [root / n for n in out.stdout.decode().split("\0") if n and (root / n).is_file()]


def tracked_python_files(root: Path) -> list[Path]:
    """Every ``*.py`` that git tracks under ``root`` (see :func:`tracked_files`)."""
    return tracked_files(root, "*.py")


def tracked_cpp_files(root: Path) -> list[Path]:
    """Every C++ source and header (``CPP_PATTERNS``) that git tracks under ``root``."""
    return tracked_files(root, *CPP_PATTERNS)


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


def test_the_cpp_class_is_enumerated():
    """Both extensions' translation units and the header they share are seen."""
    names = {p.relative_to(ROOT).as_posix() for p in tracked_cpp_files(ROOT)}
    assert {
        "python/dsv41/transport/_fastrow.cpp",
        "python/dsv41/overlay/_core.cpp",
        "python/dsv41/transport/wire.h",
    } <= names


def test_no_cpp_file_over_its_limit():
    assert too_long(tracked_cpp_files(ROOT), limit=MAX_CPP_LINES) == []


def test_the_cpp_check_finds_a_long_file(tmp_path):
    long, short = tmp_path / "long.h", tmp_path / "short.cpp"
    long.write_text("int x;\n" * (MAX_CPP_LINES + 1))
    short.write_text("int x;\n" * MAX_CPP_LINES)
    assert too_long([long, short], tmp_path, MAX_CPP_LINES) == [f"long.h: {MAX_CPP_LINES + 1} lines"]
