"""``dsv41 bench run``: a smoke start, then the spec's streamed requests, timed per request."""

from __future__ import annotations

import os
import uuid

import typer

from dsv41 import fileio

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command()
def run(
    endpoint: str = typer.Option(..., help="OpenAI-compatible base URL, e.g. http://198.18.0.11:8000"),
    spec: str = typer.Option("", help="Workload spec JSON (default: $DSV41_BENCH_SPEC_FILE, else the shipped spec)."),
    metrics: list[str] = typer.Option(
        [], "--metrics", help="A rank's /metrics URL (repeat per rank; default: ENDPOINT/metrics)."
    ),
    refs_file: str = typer.Option("", "--refs", help="Greedy refs file: the smoke's known answer."),
    out: str = typer.Option("", help="Write per-request results (JSON lines) here."),
    no_metrics: bool = typer.Option(False, help="Do not read /metrics (endpoints without it)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Smoke start, then every spec prompt ``repeats`` times; prints p50s per category and the
    /metrics counter deltas. Ctrl-C or a smoke failure: partial results kept, exit non-zero."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dsv41.harness import bench, refs

    sp = bench.load_spec(spec or None)
    with bench.sigterm_as_interrupt():
        if out and os.path.isdir(out):
            raise bench.BenchError(f"--out {out} is a directory")
        refs_doc = refs.load_refs(refs_file) if refs_file else None
        model = sp["model"] or bench.served_model(endpoint)
        urls = [] if no_metrics else (list(metrics) or [endpoint.rstrip("/") + "/metrics"])
        try:
            smoke = bench.smoke(endpoint, model, refs_doc, sp["timeout_s"])
        except KeyboardInterrupt:
            raise bench.BenchAborted("interrupted during the smoke start; nothing was timed", exit_code=130) from None
        items = bench.plan_requests(sp, uuid.uuid4().hex[:12])
        before = bench.snapshot_metrics(urls) if urls else {}
        results: list = []
        interrupted = False
        cols = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[failed]} failed"),
        )
        # The bar goes to stderr so that stdout stays the summary (JSON with --json).
        with Progress(*cols, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(f"bench {sp['name']}", total=len(items), failed=0)

            def tick(r) -> None:
                results.append(r)
                bar.update(task, advance=1, failed=sum(not x.ok for x in results))

            try:
                bench.run_requests(endpoint, model, items, sp["sampler"], sp["concurrency"], sp["timeout_s"], tick)
            except KeyboardInterrupt:
                interrupted = True
        after = bench.snapshot_metrics(urls) if urls and not interrupted else {}
        if out:
            fileio.atomic_write(
                out,
                "".join(fileio.dumps_json(r.to_dict(), nonfinite="null") + "\n" for r in results),
                "bench run --out",
            )
        summary = {
            "spec": sp["name"],
            "spec_source": sp["source"],
            "endpoint": endpoint,
            "model": model,
            "smoke": smoke,
            "summary": bench.summarize(results),
            "interrupted": interrupted,
            "metrics_delta": bench.metrics_delta(before, after) if after else {},
        }
        if as_json:
            print(fileio.dumps_json(summary, indent=1, nonfinite="null"))
        else:
            print(f"bench {sp['name']} against {endpoint} ({model}); smoke ok")
            for cat, s in summary["summary"].items():
                f = lambda v, u="": "-" if v is None else f"{v:.2f}{u}"  # noqa: E731
                print(
                    f"  {cat:10s} {s['requests']:4d} req {s['failed']:3d} failed  TTFT p50 {f(s['ttft_ms_p50'], ' ms')}  "
                    f"step p50 {f(s['step_ms_p50'], ' ms')}  {f(s['tok_s_p50'], ' tok/s')}  "
                    f"{f(s['tokens_per_step_p50'])} tok/step"
                )
        if interrupted:
            raise bench.BenchAborted(
                f"interrupted after {len(results)} of {len(items)} requests"
                + (f"; partial results in {out}" if out else ""),
                exit_code=130,
            )
        failed = sum(not r.ok for r in results)
        if failed:
            first = next(r for r in results if not r.ok)
            raise bench.BenchError(
                f"{failed} of {len(results)} requests failed (first: {first.prompt_id}: {first.error})"
            )
