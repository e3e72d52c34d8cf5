"""``dsv41 window ...``: the WIN2 R3 decision, its calibration, and the two-window cap."""

from __future__ import annotations

import contextlib

import typer

from dsv41 import fileio, names
from dsv41.harness import win2, win2_cap, win2_sim

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _print_decision(d: win2.Decision, as_json: bool) -> None:
    if as_json:
        print(fileio.dumps_json(d.to_dict(), indent=1, nonfinite="null"))
        return
    ci = f"[{d.ci[0]:+.2%}, {d.ci[1]:+.2%}]" if d.ci else "-"
    eff = f"{d.effect:+.2%}" if d.effect is not None else "-"
    print(f"{d.verdict}: {d.metric} effect {eff} CI {ci}, {d.n_pairs} pairs, min effect {d.min_effect:.1%}")
    for r in d.reasons:
        print(f"  {r}")
    if d.categories:
        print(f"  per category (Holm-adjusted across {len(d.categories)}, family alpha {d.alpha:g}):")
    for cat, e in d.categories.items():
        print(
            f"  {cat}: {e['verdict']} effect {e['effect']:+.2%} CI [{e['ci'][0]:+.2%}, {e['ci'][1]:+.2%}] "
            f"at alpha {e['alpha_adjusted']:.4g} ({e['n_pairs']} pairs)"
        )


@app.command()
def decide(
    cells: str = typer.Argument(..., help="cells.jsonl of a window (one JSON object per cell)."),
    metric: str = typer.Option("step_ms_p50", help="ttft_ms, step_ms_p50 or tok_s."),
    min_effect: float = typer.Option(win2.DEFAULT_MIN_EFFECT, help="Declared minimum effect (fraction)."),
    alpha: float = typer.Option(win2.DEFAULT_ALPHA, help="1 - confidence level of the CI."),
    seed: int = typer.Option(0, help="Bootstrap seed."),
    gate: str = typer.Option("", help="Distributional gate records (JSON list) for a drafting candidate."),
    tolerance_nat: float = typer.Option(0.5, help="Near-tie tolerance of the gate (nat)."),
    as_json: bool = typer.Option(False, "--json", help="Print the decision as JSON."),
) -> None:
    """Decide a window by WIN2 R3; exit 0 whatever the verdict (the verdict is the output)."""
    gate_records = None
    if gate:
        gate_records = fileio.read_json(gate, "gate records", error=win2.Win2Error)
        if not isinstance(gate_records, list):
            raise win2.Win2Error(f"{gate}: expected a JSON list of per-prompt records")
    d = win2.decide(
        win2.load_cells(cells),
        metric=metric,
        min_effect=min_effect,
        alpha=alpha,
        seed=seed,
        gate_records=gate_records,
        tolerance_nat=tolerance_nat,
    )
    _print_decision(d, as_json)


@app.command()
def cap(
    candidate: str = typer.Option(..., help="Candidate name.", callback=names.option("candidate name")),
    metric: str = typer.Option(..., help="Primary metric of the question."),
    state_dir: str = typer.Option("windows", help="Directory holding questions.json."),
    record: str = typer.Option("", help="Record a finished window: WINDOW_ID=VERDICT."),
) -> None:
    """Check (or, with --record, update) the two-window cap of a question; exit 1 when refused."""
    if record:
        wid, sep, verdict = record.partition("=")
        if not sep or not wid:
            raise win2.Win2Error(f"--record must be WINDOW_ID=VERDICT, got {record!r}")
        names.check_name(wid, "--record's window id", win2.Win2Error)
        win2_cap.record_window(state_dir, candidate, metric, wid, verdict)
        print(f"recorded {win2_cap.question_key(candidate, metric)}: window {wid} {verdict}")
        return
    n = win2_cap.check_cap(state_dir, candidate, metric)
    print(f"{win2_cap.question_key(candidate, metric)}: window {n} of at most 2 allowed")


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise win2.Win2Error(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise win2.Win2Error(f"{what} must be positive integers, got {text!r}")
    return vals


@app.command()
def simulate(
    sigma: float = typer.Option(0.0, help="Per-cell log-noise SD (0: estimate from --from-cells)."),
    from_cells: str = typer.Option("", help="A measured A/A cells.jsonl to estimate sigma from."),
    drift: float = typer.Option(0.0, help="Linear log drift per cell (ABBA cancels it)."),
    pairs: str = typer.Option("32,64,128", help="Pair counts per window."),
    windows: int = typer.Option(400, min=10, help="A/A windows per pair count."),
    prompts: int = typer.Option(4, min=1, help="Prompt identities per window."),
    metric: str = typer.Option("step_ms_p50", help="ttft_ms, step_ms_p50 or tok_s."),
    min_effect: float = typer.Option(win2.DEFAULT_MIN_EFFECT, help="Declared minimum effect."),
    alpha: float = typer.Option(win2.DEFAULT_ALPHA, help="1 - confidence level."),
    resamples: int = typer.Option(1999, min=99, help="Bootstrap resamples per decision."),
    seed: int = typer.Option(0, help="Simulation seed."),
    out: str = typer.Option("", help="Also write the result JSON here."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Calibrate WIN2 R3: false-WIN rate of A/A windows and the minimum detectable effect."""
    from rich.console import Console
    from rich.progress import Progress

    counts = _int_list(pairs, "--pairs")
    if from_cells:
        cells = win2.load_cells(from_cells)
        noise = win2_sim.NoiseModel(win2_sim.sigma_from_cells(cells, metric), drift, f"measured A/A cells {from_cells}")
    elif sigma > 0:
        noise = win2_sim.NoiseModel(sigma, drift, "given on the command line")
    else:
        raise win2.Win2Error("give --sigma > 0 or --from-cells A/A cells to estimate it")
    for n in counts:
        if n % (2 * prompts):
            raise win2.Win2Error(f"--pairs {n} is not a multiple of 2 x --prompts ({2 * prompts})")
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("simulating windows", total=None)
        res = win2_sim.simulate(
            noise,
            counts,
            windows,
            prompts,
            metric,
            min_effect,
            alpha,
            seed,
            resamples,
            progress=lambda n: bar.advance(task, n),
        )
    if out:
        fileio.atomic_write_json(out, res, "window simulate --out", error=win2.Win2Error, nonfinite="null")
    if as_json:
        print(fileio.dumps_json(res, indent=1, nonfinite="null"))
        return
    print(
        f"noise sigma {noise.sigma:.4f} ({noise.source}); {windows} A/A windows per row, alpha {alpha}, "
        f"min effect {min_effect}"
    )
    print("pairs | false-WIN rate (95% CI) | MDE at power 0.8")
    for r in res["rows"]:
        mde = f"{r['mde']:.1%}" if r["mde"] is not None else "> largest simulated"
        print(
            f"{r['n_pairs']:5d} | {r['false_win_rate']:.3f} ({r['false_win_ci95'][0]:.3f}-{r['false_win_ci95'][1]:.3f}) | {mde}"
        )


@app.command()
def candidate(
    name: str = typer.Argument(
        ..., help="Candidate name (candidates/NAME.yml).", callback=names.option("candidate name")
    ),
    root: str = typer.Option("candidates", help="Directory of candidate files."),
    vars_out: str = typer.Option("", help="Write the arm's Ansible extra variables (JSON) here."),
    serve_runtime: str = typer.Option(
        "",
        help="The Sparks' serving runtime (vllm or lab); refuses vLLM serving arguments elsewhere. Empty: not checked.",
    ),
) -> None:
    """Validate a candidate and print it with its role variables as JSON; exit 1 when refused."""
    from dsv41.harness import candidates

    doc = candidates.load_candidate(name, root)
    if serve_runtime:
        candidates.check_runtime(doc, serve_runtime)
    rv = candidates.role_vars(doc)
    if vars_out:
        fileio.atomic_write_json(vars_out, rv, "window candidate --vars-out", error=win2.Win2Error)
    print(fileio.dumps_json({"candidate": doc, "role_vars": rv}, indent=1))


@app.command()
def arm(
    file: str = typer.Option(..., "--file", help="A window arm file (windows/<id>/arms/<candidate>-<arm>.json)."),
) -> None:
    """Print a window arm file as JSON after refusing template syntax anywhere in it (exit 1, one
    line): window_switch.yml reads every arm through this, so its values reach Ansible as data."""
    from dsv41.harness import candidates

    print(fileio.dumps_json(candidates.load_arm(file), sort_keys=True))


@app.command("run")
def run_cmd(
    control: str = typer.Option(..., help="Control arm base URL."),
    candidate: str = typer.Option(
        ..., help="Candidate arm base URL (the same URL with --switch-cmd, or for an A/A window)."
    ),
    spec: str = typer.Option("", help="Workload spec (default: $DSV41_BENCH_SPEC_FILE, else the shipped one)."),
    name: str = typer.Option(
        "aa", help="Candidate name (the question is NAME + metric).", callback=names.option("candidate name")
    ),
    control_name: str = typer.Option("production", help="Control name.", callback=names.option("control name")),
    question: str = typer.Option("", help="The question, in words, for the report."),
    metric: str = typer.Option("step_ms_p50", help="Primary metric: ttft_ms, step_ms_p50 or tok_s."),
    min_effect: float = typer.Option(win2.DEFAULT_MIN_EFFECT, help="Declared minimum effect (fraction)."),
    alpha: float = typer.Option(win2.DEFAULT_ALPHA, help="1 - confidence level."),
    seed: int = typer.Option(0, help="Cell plan and bootstrap seed."),
    windows_dir: str = typer.Option("windows", help="Where windows/<id>/ and the cap state live."),
    window_id: str = typer.Option(
        "", "--id", help="Window id (default: UTC time + name).", callback=names.option("window id", empty_ok=True)
    ),
    switch_cmd: str = typer.Option("", help="Shell command run to switch arms; {arm} is replaced."),
    refs_file: str = typer.Option("", "--refs", help="Greedy refs for the smoke start's known answer."),
    no_cap: bool = typer.Option(False, help="Do not apply or record the two-window cap (calibration runs)."),
    metrics: list[str] = typer.Option(
        [],
        "--metrics",
        help="Every rank's /metrics URL, snapshotted around each cell (default: each arm's URL/metrics).",
    ),
    no_metrics: bool = typer.Option(False, help="No /metrics snapshots (endpoints without it)."),
    rank_metrics: str = typer.Option(
        "",
        help="JSON runtime facts (the inventory's dsv41_rank_metrics): every "
        "rank's counters endpoint is snapshotted too (under vLLM each "
        "Spark's overlay endpoint), besides the --metrics URLs.",
    ),
    drafting: bool = typer.Option(
        False,
        help="A drafting candidate: the distributional gate (greedy "
        "prompts on both arms, lengths, acceptance) decides validity.",
    ),
    tolerance_nat: float = typer.Option(0.5, help="Near-tie tolerance of the gate (nat)."),
    fault_after_cells: int = typer.Option(
        0, min=0, help="Fault drill: create --fault-cmd's trigger file once this many cells are written."
    ),
    fault_cmd: str = typer.Option(
        "",
        help="Fault drill command, started before the cells; it must wait for "
        "the file {trigger} (created after --fault-after-cells cells), then strike.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the decision as JSON."),
) -> None:
    """Seeded ABBA/BAAB paired cells between two arms, WIN2 R3 decision, report in windows/<id>/.

    Takes no HOLD itself: `window.yml` holds admission around it. Exit 0 with a verdict; exit 1
    when the smoke start fails, 130 on Ctrl-C (cells so far kept, decision INVALID)."""
    from dsv41.harness import bench, window_run

    sp = bench.load_spec(spec or None)
    params = window_run.WindowParams(
        control=control,
        candidate=candidate,
        spec=sp,
        name=name,
        control_name=control_name,
        question=question,
        metric=metric,
        min_effect=min_effect,
        alpha=alpha,
        seed=seed,
        windows_dir=windows_dir,
        window_id=window_id,
        switch_cmd=switch_cmd,
        refs_path=refs_file,
        cap=not no_cap,
        metrics=list(metrics),
        rank_urls=_rank_urls(rank_metrics) or {},
        snapshot_metrics=not no_metrics,
        drafting=drafting,
        tolerance_nat=tolerance_nat,
        fault_after_cells=fault_after_cells,
        fault_cmd=fault_cmd,
    )
    with bench.sigterm_as_interrupt():
        res = window_run.run_window(params, progress=_progress_bar)
        _print_decision(res.decision, as_json)
        if not as_json:
            print(f"report: {res.summary_path}")
        if res.interrupted:
            raise win2.Win2Error(f"window {res.window_id} interrupted; cells so far in {res.cells_path}", exit_code=130)
        if res.fault_failure:
            # the decision is written; the drill itself did not do what it was asked
            raise win2.Win2Error(f"window {res.window_id}: {res.fault_failure}")


@contextlib.contextmanager
def _progress_bar(window_id: str, total: int):
    """The cells' progress bar on stderr (transient); yields the per-cell callback."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"window {window_id}", total=total)
        yield lambda rec: bar.advance(task)


@app.command("stop-run")
def stop_run_cmd(
    window_id: str = typer.Option(
        ...,
        "--window",
        help="Window id (windows/<id>/package's directory; the journal's op id).",
        callback=names.option("window id"),
    ),
    windows_dir: str = typer.Option("windows", help="Where windows/<id>/ lives."),
    timeout: float = typer.Option(30.0, help="Seconds to wait after SIGTERM before SIGKILL."),
) -> None:
    """Stop a ``dsv41 window run`` of WINDOW still running (left behind by a killed window.yml), by
    the pid and kernel start time (clock ticks after boot) in its ``run.pid``, then the killed
    playbook's orphaned Ansible worker that waited on it; prints ``stopped PID ...`` or ``no run left``."""
    from dsv41.harness import window_pid

    pids = window_pid.stop_runs(windows_dir, window_id, timeout)
    workers = (
        f", and {' '.join(map(str, pids.workers))} (the killed window.yml's Ansible worker that waited on it)"
        if pids.workers
        else ""
    )
    if pids:
        print(f"stopped {' '.join(map(str, pids))} (the killed run of window {window_id}){workers}")
    elif pids.workers:
        print(
            f"stopped {' '.join(map(str, pids.workers))} (the killed window.yml's Ansible worker of window {window_id})"
        )
    else:
        print(f"no run left of window {window_id}")


@app.command("plan")
def plan_cmd(
    candidates: str = typer.Option(
        ..., help="Candidate name(s), comma-separated (chain mode).", callback=names.option("candidate name", many=True)
    ),
    control: str = typer.Option(
        "production",
        help="Control: a candidate name, or production as deployed.",
        callback=names.option("control name"),
    ),
    root: str = typer.Option("candidates", help="Directory of candidate files."),
    windows_dir: str = typer.Option("windows", help="Where the cap state (questions.json) lives."),
    spec: str = typer.Option("", help="Workload spec for candidates that name none."),
    serve_runtime: str = typer.Option(
        "",
        help="The Sparks' serving runtime (vllm or lab); refuses vLLM serving arguments elsewhere. Empty: not checked.",
    ),
) -> None:
    """Check everything window.yml needs before a HOLD and print the plan as JSON; exit 1 with one
    line when refused (unknown candidate, schema error, unrestorable delta, bad spec, cap, vLLM
    serving arguments for Sparks that do not serve vLLM)."""
    from dsv41.harness import window_plan

    doc = window_plan.plan(
        window_plan.split_names(candidates),
        control or "production",
        root,
        windows_dir,
        spec or None,
        serve_runtime or None,
    )
    print(fileio.dumps_json(doc))


def _rank_urls(facts: str) -> dict[str, str] | None:
    """``{rank: url}`` of a ``--rank-metrics`` JSON (None when empty); RankMetricsError on bad
    JSON or facts."""
    if not facts:
        return None
    from dsv41.harness import rank_metrics as RM

    try:
        return RM.urls(fileio.loads_json(facts))
    except ValueError as exc:
        raise RM.RankMetricsError(f"--rank-metrics: not JSON ({exc})") from None


@app.command("ready")
def ready_cmd(
    api: str = typer.Option(..., help="Rank 0's base URL."),
    ranks: str = typer.Option(
        "",
        help="Ranks whose Engram lookups must move with zero fallbacks (comma-separated; empty when Engram is local).",
    ),
    timeout: float = typer.Option(120.0, help="Seconds to keep trying."),
    rank_metrics: str = typer.Option(
        "",
        help="JSON runtime facts (the inventory's dsv41_rank_metrics: runtime, "
        "api_url, ranks, overlay_port): where each rank's counters are read. "
        "Empty: rank 0's /metrics.",
    ),
) -> None:
    """Readiness of a switched arm: a short greedy request, and Engram lookups moving on every
    listed rank with zero fallbacks (under vLLM: its overlay active); exit 1 with the last reason
    after --timeout."""
    from dsv41.harness import window_plan

    urls = _rank_urls(rank_metrics)
    res = window_plan.wait_ready(api, [r.strip() for r in ranks.split(",") if r.strip()], timeout, rank_metrics=urls)
    print(fileio.dumps_json(res, nonfinite="null"))
