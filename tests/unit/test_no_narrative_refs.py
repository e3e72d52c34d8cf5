"""Comments and docstrings say why, not which work item: no reference to an issue number or to a
lettered pass of one in the code (python/, plugins/, roles/, playbooks/, tools/, the root playbooks
and the Makefile), and none to a lettered pass in the tests. History lives in git and in
docs/records; a test may still name the issue a requirement came from.

Every text file under those folders is read (binary files, caches and built objects are skipped),
so a new file, template or native source is covered as soon as it exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("python", "plugins", "roles", "playbooks", "tools")
CODE_FILES = ("Makefile",)
TEST_DIRS = ("tests",)
SKIP_DIRS = {"__pycache__", ".pytest_cache", "build", ".git"}
SKIP_SUFFIXES = {".pyc", ".so", ".o", ".whl", ".gz", ".xz", ".zst", ".tar", ".png", ".npy", ".bin", ".safetensors"}
#: Files the walk skips by path (relative to the repository); none today, native sources included.
EXEMPT: set[str] = set()

PASS_REF = re.compile(r"\b[Pp]ass(?:es)? [A-Z][0-9]?\b")
ISSUE_REF = re.compile(r"\b[Ii]ssues? #?[0-9]+\b")


def _text_files(dirs: tuple[str, ...], files: tuple[str, ...] = ()) -> list[Path]:
    """Every readable text file under ``dirs`` (relative to the repository) plus ``files``."""
    found = [ROOT / f for f in files if (ROOT / f).is_file()]
    for d in dirs:
        for p in sorted((ROOT / d).rglob("*")):
            if not p.is_file() or p.is_symlink() or SKIP_DIRS & set(p.relative_to(ROOT).parts):
                continue
            if p.suffix in SKIP_SUFFIXES or str(p.relative_to(ROOT)) in EXEMPT:
                continue
            found.append(p)
    return found


def _hits(paths: list[Path], patterns: tuple[re.Pattern, ...]) -> list[str]:
    """``file:line: text`` for every line of ``paths`` that one of ``patterns`` matches."""
    hits = []
    for p in paths:
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(lines, 1):
            if any(rx.search(line) for rx in patterns):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return hits


def test_the_code_names_no_issue_and_no_pass():
    """No issue number and no lettered pass in the code's comments, docstrings or messages."""
    paths = _text_files(CODE_DIRS, CODE_FILES)
    assert len(paths) > 100, "the walk found almost no files: the folders moved?"
    assert _hits(paths, (PASS_REF, ISSUE_REF)) == []


def test_the_tests_name_no_pass():
    """Tests say what they check, not which lettered pass of an issue brought them."""
    paths = _text_files(TEST_DIRS)
    assert [p for p in paths if p.suffix == ".py"], "no test file found"
    assert [h for h in _hits(paths, (PASS_REF,)) if not h.startswith("tests/unit/test_no_narrative_refs.py")] == []


@pytest.mark.parametrize(
    "line,kind",
    [
        ("# the plan (issue 23 pass K): ahead", "both"),
        ("# since pass L the core streams", "pass"),
        ("x = 1  # see issue #12", "issue"),
        ("# Pass O's design", "pass"),
        ("# bypass A/B testing; passes are counted", None),
        ("# the issue: a reissued 12 s", None),
    ],
)
def test_the_patterns_catch_references_and_nothing_else(line, kind):
    """The two patterns on sample lines: references match, ordinary words do not."""
    got = {"pass": bool(PASS_REF.search(line)), "issue": bool(ISSUE_REF.search(line))}
    want = {
        "both": {"pass": True, "issue": True},
        "pass": {"pass": True, "issue": False},
        "issue": {"pass": False, "issue": True},
        None: {"pass": False, "issue": False},
    }[kind]
    assert got == want
