"""WIN2 R3 on constructed cells: known effects, A/A, a hidden category regression, incomplete
pairs, failed cells, all-identical values, the two-window cap, the distributional gate and the
``dsv41 window decide`` command's bad-input paths."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dsv41.cli import main
from dsv41.harness import win2, win2_cap, win2_sim

# Few resamples keep the unit tests fast; the rule's default is 9,999.
NR = 999


def make_cells(
    effects: dict[str, float],
    n_prompts_per_cat: int = 3,
    blocks: int = 4,
    noise: float = 0.01,
    seed: int = 1,
    metric: str = "step_ms_p50",
) -> list[dict]:
    """ABBA cells: per category, ``n_prompts_per_cat`` prompts, ``blocks`` blocks per prompt, two
    pairs per block. The candidate is better by ``effects[cat]`` (fraction, positive = better)
    with multiplicative log-normal noise ``noise`` on every cell."""
    rng = np.random.default_rng(seed)
    cells = []
    b = 0
    for cat, eff in effects.items():
        for p in range(n_prompts_per_cat):
            pid = f"{cat}-{p}"
            base = 20.0 + 5 * p
            for _ in range(blocks):
                b += 1
                for pair in (0, 1):
                    s = 1000 * b + pair
                    ctl = base * math.exp(rng.normal(0, noise))
                    cand = base * math.exp(rng.normal(0, noise))
                    cand = cand / (1 + eff) if "_ms" in metric else cand * (1 + eff)
                    for arm, v in (("control", ctl), ("candidate", cand)):
                        cells.append(
                            {
                                "block": b,
                                "pair": pair,
                                "arm": arm,
                                "prompt_id": pid,
                                "category": cat,
                                "seed": s,
                                "ok": True,
                                "ttft_ms": v,
                                "step_ms_p50": v,
                                "tok_s": v,
                            }
                        )
    return cells


def test_known_win_loss_and_effect_size():
    d = win2.decide(make_cells({"short": 0.10, "code": 0.10}), min_effect=0.02, n_resamples=NR)
    assert d.verdict == "WIN", d.reasons
    assert 0.08 < d.effect < 0.12 and d.ci[0] > 0.02
    d = win2.decide(make_cells({"short": -0.10, "code": -0.10}), min_effect=0.02, n_resamples=NR)
    assert d.verdict == "LOSS", d.reasons
    assert -0.12 < d.effect < -0.08 and d.ci[1] < -0.02


def test_higher_is_better_metric_sign():
    d = win2.decide(make_cells({"short": 0.10}, metric="tok_s"), metric="tok_s", n_resamples=NR)
    assert d.verdict == "WIN" and d.effect > 0.08


def test_aa_is_no_change_and_small_sample_unresolved():
    d = win2.decide(make_cells({"short": 0.0, "code": 0.0}, noise=0.005), min_effect=0.02, n_resamples=NR)
    assert d.verdict == "NO-CHANGE", d.reasons
    assert d.ci[0] >= -0.02 and d.ci[1] <= 0.02
    # Same A/A with noise far above the declared resolution cannot be resolved either way.
    d = win2.decide(make_cells({"short": 0.0}, blocks=3, noise=0.2), min_effect=0.02, n_resamples=NR)
    assert d.verdict == "UNRESOLVED", d.reasons


def test_category_regression_hidden_by_overall_win():
    cells = make_cells({"short": 0.15, "8k": 0.15, "32k": 0.15, "code": -0.10}, blocks=4)
    d = win2.decide(cells, min_effect=0.02, n_resamples=NR)
    assert d.effect > 0.02  # the median alone says WIN ...
    assert d.categories["code"]["verdict"] == "LOSS"
    assert d.verdict == "UNRESOLVED"  # ... non-inferiority says no
    assert any("non-inferiority" in r and "code" in r for r in d.reasons)


def test_incomplete_pairs_failed_cells_and_mismatches_are_invalid():
    cells = make_cells({"short": 0.1})
    d = win2.decide(cells[:-1], n_resamples=NR)
    assert d.verdict == "INVALID" and any("incomplete" in r for r in d.reasons)
    bad = [dict(c) for c in cells]
    bad[3]["ok"] = False
    bad[3]["error"] = "HTTP 503"
    d = win2.decide(bad, n_resamples=NR)
    assert d.verdict == "INVALID" and any("HTTP 503" in r for r in d.reasons)
    bad = [dict(c) for c in cells]
    bad[1]["seed"] = -1
    d = win2.decide(bad, n_resamples=NR)
    assert d.verdict == "INVALID" and any("differ in prompt_id or seed" in r for r in d.reasons)
    bad = [dict(c) for c in cells]
    bad[0]["step_ms_p50"] = float("nan")
    assert win2.decide(bad, n_resamples=NR).verdict == "INVALID"
    bad = [dict(c) for c in cells]
    del bad[0]["category"]
    d = win2.decide(bad, n_resamples=NR)
    assert d.verdict == "INVALID" and any("missing field" in r for r in d.reasons)
    dup = cells + [dict(cells[0])]
    assert any("two control" in r for r in win2.decide(dup, n_resamples=NR).reasons)


def test_all_identical_values_degenerate_ci():
    cells = make_cells({"short": 0.0}, noise=0.0)
    d = win2.decide(cells, n_resamples=NR)
    assert d.verdict == "NO-CHANGE"
    assert d.effect == 0.0 and d.ci == (0.0, 0.0)
    assert any("identical" in r for r in d.reasons)
    # Identical values with a constant 5 % gain: a degenerate CI at +5 % is a WIN.
    cells = make_cells({"short": 0.05}, noise=0.0)
    d = win2.decide(cells, n_resamples=NR)
    assert d.verdict == "WIN" and d.ci[0] == pytest.approx(0.05)


def test_single_block_per_prompt_gives_no_ci():
    cells = make_cells({"short": 0.1}, blocks=1, n_prompts_per_cat=9)
    d = win2.decide(cells, n_resamples=NR)
    assert d.verdict == "UNRESOLVED" and any("single block" in r for r in d.reasons)


def test_too_few_blocks_withhold_the_verdict():
    # 2 prompts x 2 blocks: a clear 10 % effect, but 4 blocks cannot carry a verdict
    d = win2.decide(make_cells({"short": 0.1}, blocks=2, n_prompts_per_cat=2), n_resamples=NR)
    assert d.verdict == "UNRESOLVED" and any("too few to resolve" in r for r in d.reasons)
    assert d.effect > 0.05


def test_stratified_by_prompt_is_deterministic_per_seed():
    cells = make_cells({"short": 0.03, "code": 0.01}, noise=0.03)
    a = win2.decide(cells, seed=7, n_resamples=NR).to_dict()
    b = win2.decide(cells, seed=7, n_resamples=NR).to_dict()
    assert a == b
    assert a["n_pairs"] == 2 * 3 * 4 * 2


def test_bad_arguments():
    cells = make_cells({"short": 0.1})
    with pytest.raises(win2.Win2Error, match="unknown metric"):
        win2.decide(cells, metric="latency")
    with pytest.raises(win2.Win2Error, match="min-effect"):
        win2.decide(cells, min_effect=-0.1)
    with pytest.raises(win2.Win2Error, match="alpha"):
        win2.decide(cells, alpha=1.5)


def test_two_window_cap(tmp_path):
    sd = str(tmp_path / "windows")
    assert win2_cap.check_cap(sd, "async", "step_ms_p50") == 1
    win2_cap.record_window(sd, "async", "step_ms_p50", "w1", "INVALID")  # INVALID does not count
    assert win2_cap.check_cap(sd, "async", "step_ms_p50") == 1
    win2_cap.record_window(sd, "async", "step_ms_p50", "w2", "UNRESOLVED")
    assert win2_cap.check_cap(sd, "async", "step_ms_p50") == 2
    assert win2_cap.check_cap(sd, "async", "ttft_ms") == 1  # another metric is another question
    win2_cap.record_window(sd, "async", "step_ms_p50", "w3", "UNRESOLVED")
    with pytest.raises(win2_cap.CapError, match="refuses a third"):
        win2_cap.check_cap(sd, "async", "step_ms_p50")
    win2_cap.record_window(sd, "other", "tok_s", "w4", "WIN")
    with pytest.raises(win2_cap.CapError, match="only after UNRESOLVED"):
        win2_cap.check_cap(sd, "other", "tok_s")
    (tmp_path / "windows" / "questions.json").write_text("[1, 2]")
    with pytest.raises(win2.Win2Error, match="expected an object"):
        win2_cap.check_cap(sd, "async", "step_ms_p50")


def test_distributional_gate():
    ok = [
        {
            "prompt_id": "a",
            "first_diff": None,
            "control_lengths": [64, 64],
            "candidate_lengths": [64, 64],
            "control_acceptance": [2.0, 2.2],
            "candidate_acceptance": [2.5, 2.7],
        },
        {"prompt_id": "b", "first_diff": 12, "logit_gap_nat": 0.3, "control_lengths": [64], "candidate_lengths": [63]},
    ]
    g = win2.distributional_gate(ok)
    assert g["passed"], g["reasons"]
    assert g["prompts"]["a"]["acceptance_candidate"] == pytest.approx(2.6)
    far = [dict(ok[1], logit_gap_nat=1.7)]
    g = win2.distributional_gate(far)
    assert not g["passed"] and "1.7 nat" in g["reasons"][0]
    assert win2.distributional_gate(far, tolerance_nat=2.0)["passed"]
    assert not win2.distributional_gate([dict(ok[1], logit_gap_nat=None)])["passed"]
    short = [dict(ok[0], candidate_lengths=[40, 41])]
    assert not win2.distributional_gate(short)["passed"]
    d = win2.decide(make_cells({"short": 0.1}), gate_records=far, n_resamples=NR)
    assert d.verdict == "INVALID" and any("distributional gate failed" in r for r in d.reasons)
    d = win2.decide(make_cells({"short": 0.1}), gate_records=ok, n_resamples=NR)
    assert d.verdict == "WIN" and d.gate["passed"]


def _write(tmp_path, cells, name="cells.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(c) + "\n" for c in cells))
    return str(p)


def test_cli_decide_json(tmp_path, capsys):
    path = _write(tmp_path, make_cells({"short": -0.1, "code": -0.1}))
    assert (
        main(
            [
                "window",
                "decide",
                path,
                "--json",
                "--metric",
                "step_ms_p50",
                "--min-effect",
                "0.02",
                "--alpha",
                "0.05",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "LOSS" and doc["n_pairs"] == 48 and set(doc["categories"]) == {"short", "code"}
    assert len(doc["ci"]) == 2 and doc["ci"][1] < -0.02
    assert main(["window", "decide", path]) == 0
    assert capsys.readouterr().out.startswith("LOSS: step_ms_p50")


@pytest.mark.parametrize(
    "content,msg",
    [
        (None, "cannot read cells file"),
        ("", "no cells"),
        ("{not json\n", ":1: not a JSON object"),
        ("[1, 2]\n", "each line must be a JSON object"),
        (b"\xff\xfe\x00", "cannot read cells file"),
    ],
)
def test_cli_decide_bad_files(tmp_path, capsys, content, msg):
    p = tmp_path / "cells.jsonl"
    if isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    assert main(["window", "decide", str(p)]) == 1
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_decide_bad_flags_and_invalid_cells(tmp_path, capsys):
    path = _write(tmp_path, make_cells({"short": 0.1}))
    assert main(["window", "decide", path, "--metric", "nope"]) == 1
    assert "unknown metric" in capsys.readouterr().err
    assert main(["window", "decide", path, "--alpha", "0"]) == 1
    assert "--alpha" in capsys.readouterr().err
    inc = _write(tmp_path, make_cells({"short": 0.1})[:-1], "inc.jsonl")
    assert main(["window", "decide", inc, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "INVALID"


def test_cli_cap(tmp_path, capsys):
    sd = str(tmp_path / "w")
    args = ["window", "cap", "--candidate", "aa", "--metric", "tok_s", "--state-dir", sd]
    assert main(args) == 0
    assert main(args + ["--record", "w1=WIN"]) == 0
    assert main(args) == 1
    assert "only after UNRESOLVED" in capsys.readouterr().err
    assert main(args + ["--record", "oops"]) == 1
    assert main(args + ["--record", "w2=MAYBE"]) == 1


def test_simulate_small_aa_calibration():
    """A small, seeded calibration run (the full one is documented in docs/windows.md): the rule's
    false-WIN rate on A/A windows stays at or below alpha and a large effect is detected."""
    res = win2_sim.simulate(
        win2_sim.NoiseModel(0.05, drift=0.002, source="test"),
        (16,),
        n_windows=60,
        n_prompts=4,
        n_resamples=499,
        effects=(0.02, 0.30),
        seed=11,
    )
    row = res["rows"][0]
    assert sum(row["aa_verdicts"].values()) == 60
    assert row["false_win_rate"] <= 0.05
    assert row["mde"] == 0.30 and row["power_at_mde"] >= 0.8
    assert res["noise"]["source"] == "test"


def test_simulated_cells_are_balanced_abba():
    rng = np.random.default_rng(0)
    cells = win2_sim.simulate_cells(rng, 16, 4, 0.0, win2_sim.NoiseModel(0.01))
    pairs, problems = win2.pair_log_ratios(cells, "step_ms_p50")
    assert not problems and len(pairs) == 16
    with pytest.raises(win2.Win2Error, match="multiple of"):
        win2_sim.simulate_cells(rng, 10, 4, 0.0, win2_sim.NoiseModel(0.01))


def test_sigma_from_aa_cells():
    cells = make_cells({"short": 0.0, "code": 0.0}, noise=0.04, blocks=8)
    assert 0.025 < win2_sim.sigma_from_cells(cells, "step_ms_p50") < 0.06
    with pytest.raises(win2.Win2Error, match="at least 4"):
        win2_sim.sigma_from_cells(cells[:4], "step_ms_p50")


def test_cli_simulate_errors(capsys):
    assert main(["window", "simulate"]) == 1
    assert "--sigma" in capsys.readouterr().err
    assert main(["window", "simulate", "--sigma", "0.05", "--pairs", "10", "--prompts", "4"]) == 1
    assert "multiple of" in capsys.readouterr().err
    assert main(["window", "simulate", "--sigma", "0.05", "--pairs", "a,b"]) == 1
    assert "comma-separated" in capsys.readouterr().err


# ---------------------------------------------------------------- issue 25 item 9: multiplicity


def _aa_by_cat(rng, k: int, prompts: int = 2, blocks: int = 8, sigma: float = 0.05) -> dict[str, list[dict]]:
    """A/A pairs (``pair_log_ratios`` shape) of ``k`` categories: every log-ratio is pure noise."""
    by_cat = {}
    b = 0
    for c in range(k):
        pairs = []
        for p in range(prompts):
            for _ in range(blocks):
                b += 1
                for pair in (0, 1):
                    pairs.append(
                        {
                            "block": b,
                            "pair": pair,
                            "prompt_id": f"c{c}-p{p}",
                            "category": f"c{c}",
                            "seed": 1000 * b + pair,
                            "r": float(rng.normal(0, sigma) - rng.normal(0, sigma)),
                        }
                    )
        by_cat[f"c{c}"] = pairs
    return by_cat


def test_holm_keeps_aa_per_category_false_claims_at_the_family_alpha():
    """A/A windows over 8 categories (2 prompts x 16 blocks each), min effect 0 (every WIN or
    LOSS is false): without the correction some category "wins" or "loses" in about
    1 - 0.95^8 = 34 % of windows; with Holm in at most the family alpha of 5 %: the 95 %
    Clopper-Pearson interval of the Holm rate reaches down to alpha, the unadjusted one lies
    wholly above it. 4,999 resamples: a Holm level of alpha/8 puts 0.3 % in each tail, which a
    few hundred resamples cannot place (with 199 the Holm rate was 22 %)."""
    from scipy import stats

    rng = np.random.default_rng(25)
    n, k, alpha, nr = 80, 8, 0.05, 4999
    raw_hits = holm_hits = 0
    for w in range(n):
        by_cat = _aa_by_cat(rng, k, blocks=16)
        raw = {c: win2.estimate(v, 0.0, alpha, w, n_resamples=nr) for c, v in by_cat.items()}
        adj = win2.holm_categories(by_cat, 0.0, alpha, w, n_resamples=nr, unadjusted=raw)
        raw_hits += any(e.verdict in ("WIN", "LOSS") for e in raw.values())
        holm_hits += any(e.verdict in ("WIN", "LOSS") for e, _ in adj.values())
    raw_ci = stats.binomtest(raw_hits, n).proportion_ci(0.95, method="exact")
    holm_ci = stats.binomtest(holm_hits, n).proportion_ci(0.95, method="exact")
    print(
        f"A/A, {k} categories, {n} windows: family-wise false WIN/LOSS unadjusted {raw_hits}/{n}, Holm {holm_hits}/{n}"
    )
    assert raw_ci.low > alpha, (raw_hits, n)  # the uncorrected rule exceeds the family alpha: teeth
    assert holm_ci.low <= alpha, (holm_hits, n)
    assert holm_hits < raw_hits / 3, (holm_hits, raw_hits)


def test_holm_step_down_levels_and_what_decide_reports():
    """Two clear categories resolve at alpha/3; the third, weaker one is then tested at alpha/1."""
    cells = make_cells({"a": 0.30, "b": -0.30, "c": 0.035}, n_prompts_per_cat=2, blocks=8, noise=0.01)
    d = win2.decide(cells, min_effect=0.02, n_resamples=NR)
    cats = d.categories
    assert cats["a"]["verdict"] == "WIN" and cats["b"]["verdict"] == "LOSS"
    assert cats["a"]["alpha_adjusted"] == pytest.approx(0.05 / 3) == cats["b"]["alpha_adjusted"]
    assert cats["c"]["alpha_adjusted"] in (pytest.approx(0.05 / 3), pytest.approx(0.05))
    for e in cats.values():
        assert e["correction"] == "holm" and e["descriptive"]["alpha"] == 0.05
        lo, hi = e["ci"]
        dlo, dhi = e["descriptive"]["ci"]
        assert lo <= dlo + 1e-12 and hi >= dhi - 1e-12  # the adjusted CI is never narrower
    assert d.to_dict()["category_correction"] == {"method": "holm", "family_alpha": 0.05, "n_categories": 3}


def test_a_category_unresolved_after_holm_is_labelled_with_its_unadjusted_verdict():
    """A category that 'wins' unadjusted but not at the Holm level: UNRESOLVED, the unadjusted
    verdict kept under descriptive (the lab's ``code: WIN`` in an A/A window, as a class)."""
    rng = np.random.default_rng(3)
    for seed in range(200):
        by_cat = _aa_by_cat(rng, 6)
        raw = {c: win2.estimate(v, 0.0, 0.05, seed, n_resamples=199) for c, v in by_cat.items()}
        adj = win2.holm_categories(by_cat, 0.0, 0.05, seed, n_resamples=199, unadjusted=raw)
        flipped = [c for c in raw if raw[c].verdict == "WIN" and adj[c][0].verdict == "UNRESOLVED"]
        if flipped:
            break
    else:
        pytest.fail("no A/A window with an unadjusted per-category WIN in 200")
    cells = []
    for c in by_cat:
        for p in by_cat[c]:
            base = 30.0
            cells += [
                {
                    "block": p["block"],
                    "pair": p["pair"],
                    "arm": "control",
                    "prompt_id": p["prompt_id"],
                    "category": c,
                    "seed": p["seed"],
                    "ok": True,
                    "step_ms_p50": base * math.exp(p["r"]),
                },
                {
                    "block": p["block"],
                    "pair": p["pair"],
                    "arm": "candidate",
                    "prompt_id": p["prompt_id"],
                    "category": c,
                    "seed": p["seed"],
                    "ok": True,
                    "step_ms_p50": base,
                },
            ]
    d = win2.decide(cells, min_effect=0.0, seed=seed, n_resamples=199)
    e = d.categories[flipped[0]]
    assert e["verdict"] == "UNRESOLVED" and e["descriptive"]["verdict_unadjusted"] == "WIN", e
