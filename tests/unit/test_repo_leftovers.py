"""The unit suite leaves nothing in the repository tree (tests/unit/conftest.py): every test runs
in its own temporary directory, and the session fails on untracked or (non-cache) ignored paths
that appeared while it ran. Here the check itself, on a planted checkout."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from treeutil import repo_files, repo_leftovers

REPO = Path(__file__).resolve().parents[2]


def test_each_test_runs_in_its_own_temporary_directory(tmp_path: Path) -> None:
    assert Path.cwd() == tmp_path and not Path.cwd().is_relative_to(REPO)


def test_the_check_finds_what_a_run_left(tmp_path: Path) -> None:
    def git(*args):
        subprocess.run(
            ["git", "-C", str(tmp_path), *args],
            check=True,
            capture_output=True,
            env=dict(
                os.environ,
                GIT_AUTHOR_NAME="t",
                GIT_AUTHOR_EMAIL="t@t",
                GIT_COMMITTER_NAME="t",
                GIT_COMMITTER_EMAIL="t@t",
            ),
        )

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("/windows/\n__pycache__/\n*.pyc\n")
    (tmp_path / "kept.py").write_text("x = 1\n")
    (tmp_path / "scratch.txt").write_text("there before the run\n")
    git("add", ".gitignore", "kept.py")
    git("commit", "-qm", "c")
    before = repo_files(tmp_path)
    (tmp_path / "['l']").mkdir()
    (tmp_path / "['l']" / "report.json").write_text("{}")  # what the module wrote
    (tmp_path / "windows" / "w1").mkdir(parents=True)  # an ignored output directory
    (tmp_path / "windows" / "w1" / "decision.json").write_text("{}")
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)  # caches are tolerated
    (tmp_path / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"")
    (tmp_path / "kept.py").write_text("x = 2\n")  # a tracked file changed: not this check's business
    assert repo_leftovers(before, repo_files(tmp_path)) == ["['l']/report.json", "windows/"]
    # a session with lab tests: playbooks' ignored outputs are theirs, untracked files are still found
    assert repo_leftovers(before, repo_files(tmp_path), ignored=False) == ["['l']/report.json"]
    assert repo_files(tmp_path / "no-such-dir") is None
