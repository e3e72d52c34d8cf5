"""Collect ``bench_*.py`` under tests/perf (``make bench`` = ``pytest -s tests/perf``).

Benchmarks are not timed tests: they print their measurements (and baselines from the same
run) for docs/benchmarks.md; assertions only check that the work was done correctly.
"""

from __future__ import annotations

import pytest


def pytest_collect_file(file_path, parent):
    # files named on the command line are collected by pytest itself
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
