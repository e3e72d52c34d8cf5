"""Window cell plan (seeded ABBA/BAAB blocks) and the report writer, without a server."""

from __future__ import annotations

import json
import os

from dsv41.harness import bench, win2, window


def _spec(blocks=3):
    sp = bench.load_spec(env={})
    sp["blocks_per_prompt"] = blocks
    return sp


def test_plan_is_seeded_balanced_and_paired():
    sp = _spec()
    a, b = window.plan_cells(sp, 5, "s"), window.plan_cells(sp, 5, "s")
    assert a == b
    assert window.plan_cells(sp, 6, "s") != a
    assert len(a) == len(sp["prompts"]) * 3 * 4
    blocks = {}
    for c in a:
        blocks.setdefault(c["block"], []).append(c)
    orders = set()
    for cs in blocks.values():
        arms = tuple(c["arm"] for c in cs)
        assert arms in (window.ABBA, window.BAAB)
        orders.add(arms)
        assert len({c["prompt_id"] for c in cs}) == 1
        for pair in (0, 1):
            pc = [c for c in cs if c["pair"] == pair]
            assert {c["arm"] for c in pc} == {"control", "candidate"} and len({c["seed"] for c in pc}) == 1
        assert cs[0]["seed"] != cs[2]["seed"]
    assert orders == {window.ABBA, window.BAAB}
    assert len({c["salt"] for c in a}) == len(a)  # no two cells share a prefix-cache salt
    # blocks of different prompts are interleaved, not run prompt by prompt
    assert [blocks[i][0]["prompt_id"] for i in range(4)] != [sp["prompts"][0]["id"]] * 4


def test_report_files(tmp_path):
    sp = _spec(2)
    plan = window.plan_cells(sp, 1, "s")
    cells = []
    for i, c in enumerate(plan):
        res = bench.RequestResult(
            c["prompt_id"],
            c["category"],
            c["seed"],
            c["max_tokens"],
            ok=True,
            ttft_ms=50 + i % 3,
            step_ms_p50=20 + (i % 5) * 0.1,
            tok_s=50.0,
            tokens_per_step=1.5,
            steps=10,
            step_ms=[20.0] * 9,
            finish_reason="length",
            completion_tokens=14,
        )
        cells.append(window.cell_record(c, res))
    d = win2.decide(cells, n_resamples=199)
    files = window.write_report(
        str(tmp_path / "w1"), d, cells, {"window_id": "w1", "candidate": "aa", "versions": window.stack_version()}
    )
    assert set(files) == {"decision.json", "summary.md", "pairs.png", "cdf.png", "acceptance.png"}
    for f in files:
        assert os.path.getsize(tmp_path / "w1" / f) > 0
    assert json.loads((tmp_path / "w1" / "decision.json").read_text())["decision"]["verdict"] == d.verdict
    md = (tmp_path / "w1" / "summary.md").read_text()
    assert md.startswith(f"# Window w1: **{d.verdict}**") and "| category |" in md
    # per-category verdicts are Holm-corrected and the unadjusted CI is labelled descriptive (issue 25)
    assert "Holm" in md and "descriptive CI (unadjusted)" in md and "adjusted alpha" in md
    doc = json.loads((tmp_path / "w1" / "decision.json").read_text())["decision"]
    assert doc["category_correction"] == {"method": "holm", "family_alpha": d.alpha, "n_categories": len(d.categories)}
    for e in doc["categories"].values():
        assert e["correction"] == "holm" and "verdict_unadjusted" in e["descriptive"]
    assert "prompt" not in cells[0] and "salt" not in cells[0]


def test_stack_version_outside_git(tmp_path):
    v = window.stack_version(str(tmp_path))
    assert v["package"] and v["commit"] is None


def test_gate_records_from_cells_and_greedy():
    cells = [
        {"prompt_id": "a", "arm": "control", "ok": True, "completion_tokens": 32, "accepted_per_round": 2.0},
        {"prompt_id": "a", "arm": "candidate", "ok": True, "completion_tokens": 32, "accepted_per_round": 3.0},
        {"prompt_id": "a", "arm": "candidate", "ok": False, "completion_tokens": 1},
    ]
    recs = window.gate_records(cells, {"plain": ([1, 2, 3], [1, 2, 3]), "code": ([1, 2, 3], [1, 9, 3])})
    g = win2.distributional_gate(recs)
    assert not g["passed"]  # "code" differs at token 1 and no logit gap was measured: fails closed
    assert g["reasons"] == ["greedy:code: outputs differ at token 1 but no logit gap was measured"]
    assert g["prompts"]["a"]["acceptance_candidate"] == 3.0 and g["prompts"]["a"]["length_ratio"] == 1.0
    recs[1]["logit_gap_nat"] = 0.2  # a scorer measured a near-tie there
    assert win2.distributional_gate(recs)["passed"]
