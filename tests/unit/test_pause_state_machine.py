"""Issue 25 item 1: pause/resume/drain semantics as state machines, bounded for ``make test``:
the lab engine's API (tests/unit/pause_machine.py) and the vLLM admission fence
(tests/unit/fence_machine.py), PAUSE_MACHINE_EXAMPLES (default 40) random sequences of at most
25 steps each, derandomized; ``make fuzz`` runs many more (tests/fuzz/test_pause_fuzz.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from fence_machine import FenceMachine  # noqa: E402
from pause_machine import PauseMachine  # noqa: E402

SETTINGS = settings(
    max_examples=int(os.environ.get("PAUSE_MACHINE_EXAMPLES", "40")),
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)

TestEnginePauseMachine = PauseMachine.TestCase
TestEnginePauseMachine.settings = SETTINGS

FenceMachine.hold_dir = Path(tempfile.mkdtemp(prefix="dsv41-fence-machine-"))
TestFencePauseMachine = FenceMachine.TestCase
TestFencePauseMachine.settings = SETTINGS
