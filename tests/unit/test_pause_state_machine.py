"""Issue 25 item 1: the lab engine's pause/resume/drain semantics as a state machine
(tests/unit/pause_machine.py), bounded for ``make test``: PAUSE_MACHINE_EXAMPLES (default 40)
random sequences of at most 25 steps; ``make fuzz`` runs many more (tests/fuzz/test_pause_fuzz.py)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from pause_machine import PauseMachine  # noqa: E402

TestPauseMachine = PauseMachine.TestCase
TestPauseMachine.settings = settings(max_examples=int(os.environ.get("PAUSE_MACHINE_EXAMPLES", "40")),
                                     stateful_step_count=25, deadline=None, derandomize=True,
                                     suppress_health_check=[HealthCheck.too_slow])
