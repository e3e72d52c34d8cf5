"""Shared set-up of the unit tests (the module and plugin tests have theirs in plugins/conftest.py).

* Every test runs in its own temporary working directory, never the repository's: a command or a
  module given a relative path (or a path option Ansible made of a list, ``"['l']"``) writes
  there. Found as a committed ``['l']/report.json`` at the repository root.
* The session fails when the tests left files in the repository tree that were not there before
  (untracked ones, or ignored ones other than caches): ``treeutil.repo_leftovers``. A session
  that ran tests outside tests/unit (``make test`` runs the lab's too) is checked for untracked
  files only: playbooks write their ignored outputs (``windows/``...) under the repository.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from treeutil import repo_files, repo_leftovers

REPO = Path(__file__).resolve().parents[2]

_BEFORE = repo_files(REPO)


@pytest.fixture(scope="module", autouse=True)
def _session_working_directory(tmp_path_factory):
    """Module-scoped fixtures run before a test's own directory exists: in this one. Module scope,
    not session: a session-scoped chdir lasted past tests/unit into the lab tests that ``make
    test`` runs in the same session, which then ran outside the repository (CI's
    test_monitoring_lab failed twice that way, in the full session only)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        yield


@pytest.fixture(autouse=True)
def _own_working_directory(_session_working_directory, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def pytest_sessionfinish(session, exitstatus):
    if _BEFORE is None:
        return
    after = repo_files(REPO)
    unit_only = all(Path(item.path).is_relative_to(REPO / "tests" / "unit") for item in getattr(session, "items", []))
    left = repo_leftovers(_BEFORE, after, ignored=unit_only) if after is not None else []
    if left:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = (
            "the unit tests left files in the repository tree (write them under tmp_path): "
            + ", ".join(left[:20])
            + (f" and {len(left) - 20} more" if len(left) > 20 else "")
        )
        if tr is not None:
            tr.ensure_newline()
            tr.write_line(msg, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
