"""A drill's report (``drills/<id>/``): ``report.json`` (:func:`build_report`, one
:func:`fault_result` per fault), ``summary.md`` (:func:`summary_markdown`) and ``timeline.png``
(:func:`plot_timeline`); docs/drills.md, "Report".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from dsv41 import fileio
from dsv41.harness.drill_faults import FAULTS
from dsv41.harness.drill_measure import Sample, counter_deltas, recovery_time, throughput_recovery_time, timeline

FORMAT = "dsv41-drill-report/1"


def fault_result(
    name: str,
    samples: Sequence[Sample],
    requests: Sequence[dict],
    t_inject: float,
    t_clear: float,
    ranks: Sequence[str],
    stable_s: float,
    inject: dict,
    clear: dict,
    refs: dict | None,
) -> dict:
    """Everything the report says about one fault (see docs/drills.md, "Report"): requests and
    failures, fallbacks / fail-closed rounds counted over the whole run of this fault, recovery
    seconds after clearing, the greedy references, and the samples and requests themselves."""
    deltas = counter_deltas(samples)
    failed = [r for r in requests if not r.get("ok")]
    recovery = recovery_time(samples, t_clear, ranks, True, stable_s)
    fallbacks = {r: int(c.get("fallbacks", 0)) for r, c in deltas["engram"].items()}
    rates = timeline(samples)

    def mean_tok(lo, hi):
        vals = [x["tok_s"] for x in rates if lo <= x["t"] <= hi and x["tok_s"] is not None]
        return sum(vals) / len(vals) if vals else None

    refs_ok = bool(refs and refs.get("ok"))
    return {
        "fault": name,
        "description": FAULTS[name],
        "inject": inject,
        "clear": clear,
        "t_inject": t_inject,
        "t_clear": t_clear,
        "requests": len(requests),
        "failed": len(failed),
        "failures": [{"prompt_id": r.get("prompt_id"), "error": r.get("error")} for r in failed[:10]],
        "requests_across_fault": sum(1 for r in requests if r["t_start"] < t_clear and r["t_end"] > t_inject),
        "fallbacks": fallbacks,
        "fallbacks_total": sum(fallbacks.values()),
        "fail_closed_rounds": int(deltas["drafter"].get("fail_closed_rounds", 0)),
        "proxy_respawns": int(deltas["drafter"].get("proxy_respawns", 0)),
        "recovered": recovery is not None,
        "recovery_s": recovery,
        "tok_s_recovery_s": throughput_recovery_time(samples, t_inject, t_clear),
        "tok_s_before": mean_tok(float("-inf"), t_inject),
        "tok_s_during": mean_tok(t_inject, t_clear),
        "refs": refs,
        "refs_ok": refs_ok,
        "ok": not failed and recovery is not None and refs_ok and len(requests) > 0,
        "deltas": deltas,
        "samples": [dataclasses.asdict(s) for s in samples],
        "request_log": list(requests),
    }


def build_report(
    drill_id: str, faults: Sequence[dict], params: dict, started_at: str, finished_at: str, machine: str
) -> dict:
    """The ``report.json`` document: ``format``, ``id``, times, machine, parameters, one
    :func:`fault_result` per fault, and ``ok`` (every fault: zero failed requests, recovered,
    references identical)."""
    return {
        "format": FORMAT,
        "id": drill_id,
        "started_at": started_at,
        "finished_at": finished_at,
        "machine": machine,
        "params": dict(params),
        "faults": list(faults),
        "ok": bool(faults) and all(f["ok"] for f in faults),
    }


def fmt_value(v: float | None, spec: str = ".1f", none: str = "-") -> str:
    """``v`` formatted by ``spec``; ``none`` when it is None (a figure the samples did not give)."""
    return none if v is None else format(v, spec)


def summary_markdown(report: dict) -> str:
    """``summary.md``: one table row per fault (requests, failed, fallbacks per rank, fail-closed
    rounds, proxy respawns, recovery s, tok/s before and during, references) and the verdict."""
    p = report["params"]
    lines = [
        f"# Fault drill {report['id']}",
        "",
        f"{report['started_at']} -> {report['finished_at']} on {report['machine']}; load: {p.get('streams')} "
        f"concurrent streams of spec `{p.get('spec')}` (short, code and long prompts, "
        f"{p.get('max_tokens')} tokens each); per fault {p.get('baseline_s')} s baseline, "
        f"{p.get('duration_s')} s fault, recovery awaited up to {p.get('recover_timeout_s')} s "
        f"(healthy = {p.get('stable_s')} s of remote lookups on every rank with no fallback and "
        f"remote drafting rounds with no fail-closed round; the tok/s column: seconds after clearing "
        f"until 3 s of generation average at least half the pre-fault tok/s).",
        "",
        "| fault | requests | failed | fallbacks (per rank) | fail-closed rounds | proxy respawns "
        "| recovery s | tok/s before / during | tok/s at half of before after s | refs | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in report["faults"]:
        fb = ", ".join(f"r{r} {n}" for r, n in sorted(f["fallbacks"].items())) or "-"
        refs = (f["refs"] or {}).get("summary") or ("error: " + str((f["refs"] or {}).get("error")))
        rec = fmt_value(f["recovery_s"]) if f["recovered"] else "not recovered"
        lines.append(
            f"| {f['fault']} | {f['requests']} | {f['failed']} | {fb} | {f['fail_closed_rounds']} | "
            f"{f['proxy_respawns']} | {rec} | {fmt_value(f['tok_s_before'])} / {fmt_value(f['tok_s_during'])} | "
            f"{fmt_value(f.get('tok_s_recovery_s'))} | "
            f"{refs} | {'yes' if f['ok'] else 'NO'} |"
        )
    lines += [
        "",
        "What was done: "
        + "; ".join(
            f"{f['fault']}: {f['inject'].get('action')} on {f['inject'].get('host')}, "
            f"cleared by {f['clear'].get('action')}"
            for f in report["faults"]
        )
        + ".",
        "",
        f"Verdict: {'PASS' if report['ok'] else 'FAIL'}. Timeline: timeline.png.",
        "",
    ]
    for f in report["faults"]:
        for x in f["failures"]:
            lines.append(f"- {f['fault']}: failed request {x['prompt_id']}: {x['error']}")
    return "\n".join(lines).rstrip() + "\n"


def plot_timeline(report: dict, path: str | Path) -> None:
    """``timeline.png``: per fault one panel of tok/s (left axis) and Engram fallbacks + fail-closed
    rounds per second (right axis) against seconds since the drill started, the fault window
    (inject -> clear) shaded and the recovery point marked. Matplotlib, Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = report["faults"]
    if not faults:
        fig = plt.figure(figsize=(6, 1.5))
        fig.text(
            0.5,
            0.5,
            f"drill {report['id']}: no fault ran ({report.get('error') or 'nothing requested'})",
            ha="center",
            va="center",
            fontsize=8,
        )
        fileio.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=90), "drill timeline")
        plt.close(fig)
        return
    fig, axes = plt.subplots(len(faults), 1, figsize=(10, 2.6 * max(1, len(faults))), squeeze=False)
    for ax, f in zip(axes[:, 0], faults, strict=False):
        rates = timeline([Sample(**s) for s in f["samples"]])
        t = [x["t"] for x in rates]
        ax.plot(t, [x["tok_s"] if x["tok_s"] is not None else math.nan for x in rates], color="tab:blue", label="tok/s")
        ax.set_ylabel("tok/s")
        ax2 = ax.twinx()
        ax2.plot(t, [x["fallbacks_s"] for x in rates], color="tab:red", label="Engram fallbacks/s")
        ax2.plot(
            t, [x["fail_closed_s"] for x in rates], color="tab:orange", linestyle="--", label="fail-closed rounds/s"
        )
        ax2.set_ylabel("per s")
        ax.axvspan(f["t_inject"], f["t_clear"], color="grey", alpha=0.25, label="fault")
        if f["recovery_s"] is not None:
            ax.axvline(f["t_clear"] + f["recovery_s"], color="tab:green", linestyle=":", label="recovered")
        ax.set_title(
            f"{f['fault']}: {f['requests']} requests, {f['failed']} failed, {f['fallbacks_total']} fallbacks, "
            f"{f['fail_closed_rounds']} fail-closed, recovery {fmt_value(f['recovery_s'])} s",
            fontsize=9,
        )
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the drill started")
    fig.tight_layout()
    fileio.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=90), "drill timeline")
    plt.close(fig)


def write_report(report: dict, out_dir: str | Path) -> dict[str, str]:
    """Write ``report.json``, ``summary.md`` and ``timeline.png`` into ``out_dir`` (created);
    returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report": out / "report.json", "summary": out / "summary.md", "timeline": out / "timeline.png"}
    fileio.atomic_write_json(paths["report"], report, "drill report", nonfinite="null")
    fileio.atomic_write(paths["summary"], summary_markdown(report), "drill summary")
    plot_timeline(report, paths["timeline"])
    return {k: str(v) for k, v in paths.items()}
