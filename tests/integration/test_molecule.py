"""The molecule scenario of the whole stack on the three-host lab, run under pytest so CI reads one
summary line: destroy, syntax, create (lab up), converge (deploy.yml), idempotence (zero changed
tasks), verify (engram_server, engram_overlay, serve checks + the fault test: table server stopped
-> fallbacks counted -> deploy.yml restores remote lookups), destroy (lab down).

Needs root, iproute2 and util-linux (network namespaces); skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# Under `make lab-long`, not `make test` (about 7 min on the 2-core box: its own lab up, deploy,
# idempotence, verify with a second deploy, lab down). `make test` proves the same idempotence on
# the shared deployed lab (test_status_lab: deploy.yml again, changed=0 on every host). Its failure
# in the 2026-12-01 combined CI run was the verify's `deploy.yml --check --tags engram_overlay`
# recording an empty package (fixed in playbooks/promotion_record.yml); the idempotence step passed.
pytestmark = [
    pytest.mark.lab,
    pytest.mark.slow,
    pytest.mark.lab_long,
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "nsenter", "unshare")),
        reason="needs root, iproute2 and util-linux for the lab's network namespaces",
    ),
]


def test_molecule_default_scenario():
    env = dict(
        os.environ, ANSIBLE_FORCE_COLOR="0", PY_COLORS="0", NO_COLOR="1", PATH=f"{BIN}:{os.environ.get('PATH', '')}"
    )
    r = subprocess.run(
        [str(BIN / "molecule"), "test", "-s", "default"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    # molecule fails on a changed task in the idempotence step (rc above); the converge and the
    # fault test's redeploy both ended with the greedy references verified
    assert out.count("6/6 identical") >= 2, out[-6000:]
