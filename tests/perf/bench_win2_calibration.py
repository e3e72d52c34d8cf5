"""WIN2 R3 calibration at full size (``make bench``): false-WIN rate of 400 A/A windows and the
minimum detectable effect for 32, 64 and 128 pairs, for the two noise levels of docs/windows.md.

Noise inputs (per-cell log SD of step_ms p50): 0.248, measured by an A/A window on the TP1 lab
engine on the loaded dev box (docs/windows.md, "Lab noise, measured"); 0.012, from the repeated
per-request step p50 of the seed's production rows (docs/windows.md). To calibrate for another
machine, run ``dsv41 window simulate --from-cells A_A_CELLS.jsonl`` on that machine's A/A window.
Prints the table for docs/windows.md; asserts only the rule's contract (false-WIN rate <= alpha).
"""

from __future__ import annotations

import platform
import time

import pytest

from dsv41.harness import win2_sim


@pytest.mark.parametrize("sigma,source", [(0.248, "lab A/A window, dev box"), (0.012, "seed production rows")])
def test_win2_calibration(sigma, source):
    t0 = time.monotonic()
    res = win2_sim.simulate(win2_sim.NoiseModel(sigma, source=source), (32, 64, 128), n_windows=400)
    print(
        f"\nWIN2 R3 calibration, sigma {sigma} ({source}); {platform.node()} "
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {time.monotonic() - t0:.0f} s"
    )
    print("| pairs | false-WIN rate (95 % CI) | A/A verdicts | MDE (power at MDE) |")
    for r in res["rows"]:
        mde = f"{r['mde']:.1%} ({r['power_at_mde']:.2f})" if r["mde"] is not None else "beyond the grid"
        ci = r["false_win_ci95"]
        print(f"| {r['n_pairs']} | {r['false_win_rate']:.3f} ({ci[0]:.3f}-{ci[1]:.3f}) | {r['aa_verdicts']} | {mde} |")
        assert r["false_win_rate"] <= res["alpha"]
