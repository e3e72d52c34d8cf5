"""Test helpers are modules, not test files: no Python file under tests/ (nor tools/) imports a test
file (``test_*.py`` / ``*_test.py``, by its module name or as ``tests.…``). Shared fakes and
fixtures live in helper modules (tests/unit/engineutil.py, serverutil.py, framefuzz.py,
tests/integration/labutil.py, promotionutil.py, tests/perf/benchutil.py) or a conftest.py, so a
test file's own fixtures, module-level state and collection never leak into another's.

The files are enumerated from the tree and every ``import``/``from … import`` anywhere in them
(module level or inside a function) is parsed with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def is_test_file(name: str) -> bool:
    """``name``: a file name; pytest's default ``python_files`` (``test_*.py``, ``*_test.py``)."""
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def imports_of_test_files(root: Path) -> list[str]:
    """Every import of a test file by a Python file under ``root``/tests or ``root``/tools, as
    ``"PATH:LINE imports MODULE (a test file)"`` lines (empty: none)."""
    files = sorted(p for d in ("tests", "tools") if (root / d).is_dir() for p in (root / d).rglob("*.py"))
    test_modules = {p.stem for p in files if is_test_file(p.name) and p.is_relative_to(root / "tests")}
    found = []
    for p in files:
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom):  # relative: ``from . import test_x`` / ``from .test_x import``
                names = [node.module] if node.module else [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[-1] in test_modules or (parts[0] == "tests" and any(is_test_file(q + ".py") for q in parts)):
                    found.append(f"{p.relative_to(root)}:{node.lineno} imports {name} (a test file)")
    return sorted(found, key=lambda s: (s.split(":")[0], int(s.split(":")[1].split()[0])))


def test_no_test_file_imports_a_test_file():
    found = imports_of_test_files(ROOT)
    assert not found, "move what these import into a helper module (not test_*.py) or a conftest.py:\n" + "\n".join(
        found
    )


def test_the_check_finds_each_kind_of_import(tmp_path):
    """The check on a small tree: each way of importing a test file is found; helpers are not."""
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "integration").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "tests" / "unit" / "test_a.py").write_text("X = 1\n")
    (tmp_path / "tests" / "unit" / "b_test.py").write_text("Y = 1\n")
    (tmp_path / "tests" / "unit" / "helper.py").write_text("Z = 1\n")
    (tmp_path / "tests" / "unit" / "test_uses_helper.py").write_text("from helper import Z\nimport helper\n")
    (tmp_path / "tests" / "integration" / "test_c.py").write_text(
        "import sys\nfrom test_a import X\n\ndef f():\n    import b_test\n    from tests.unit.test_a import X\n"
    )
    (tmp_path / "tests" / "integration" / "util.py").write_text("from . import test_c\n")
    (tmp_path / "tools" / "t.py").write_text("import test_a as a\n")
    assert imports_of_test_files(tmp_path) == [
        "tests/integration/test_c.py:2 imports test_a (a test file)",
        "tests/integration/test_c.py:5 imports b_test (a test file)",
        "tests/integration/test_c.py:6 imports tests.unit.test_a (a test file)",
        "tests/integration/util.py:1 imports test_c (a test file)",
        "tools/t.py:1 imports test_a (a test file)",
    ]
