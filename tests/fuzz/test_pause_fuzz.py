"""``make fuzz``: the pause/resume/drain state machines of tests/unit/pause_machine.py (lab
engine API) and tests/unit/fence_machine.py (vLLM admission fence) with many random sequences:
PAUSE_FUZZ_EXAMPLES each (default 2000), 40 steps at most, fresh random seeds every run (hypothesis
prints the failing sequence and its seed)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, settings  # noqa: E402

from fence_machine import FenceMachine  # noqa: E402
from pause_machine import PauseMachine  # noqa: E402

SETTINGS = settings(
    max_examples=int(os.environ.get("PAUSE_FUZZ_EXAMPLES", "2000")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)

TestEnginePauseFuzz = PauseMachine.TestCase
TestEnginePauseFuzz.settings = SETTINGS

FenceMachine.hold_dir = Path(tempfile.mkdtemp(prefix="dsv41-fence-fuzz-"))
TestFencePauseFuzz = FenceMachine.TestCase
TestFencePauseFuzz.settings = SETTINGS
