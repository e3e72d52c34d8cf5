"""``dsv41 refs record|verify``: the six greedy reference prompts against a serving endpoint."""

from __future__ import annotations

import os

import typer

from dsv41 import fileio
from dsv41.errors import VerificationError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command()
def record(
    endpoint: str = typer.Option(..., help="Rank 0 HTTP base URL, e.g. http://198.18.0.11:8000"),
    out: str = typer.Option(..., help="Refs file to write (JSON)."),
    max_tokens: int = typer.Option(16, min=1, help="New tokens per prompt (greedy)."),
    model: str = typer.Option("", help="Model name (default: first of /v1/models)."),
    force: bool = typer.Option(False, help="Overwrite an existing refs file."),
) -> None:
    """Run the six prompts ($DSV41_GREEDY_PROMPTS_FILE when set) at temperature 0 and record their ids."""
    from dsv41.harness import refs
    from dsv41.harness.bench import greedy_prompts

    if os.path.exists(out) and not force:
        raise refs.RefsError(f"{out} exists; pass --force to record again")
    doc = refs.run_prompts(endpoint, model or None, max_tokens, greedy_prompts())
    refs.save_refs(doc, out)
    print(f"recorded {len(doc['prompts'])} prompts ({doc['max_tokens']} tokens each) to {out}")


@app.command()
def verify(
    endpoint: str = typer.Option(..., help="Rank 0 HTTP base URL."),
    refs_file: str = typer.Option(..., "--refs", help="Refs file written by `dsv41 refs record`."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    metrics_url: str = typer.Option("", help="Rank 0 /metrics (default: ENDPOINT/metrics)."),
    rank_metrics: str = typer.Option(
        "",
        help="JSON runtime facts (the inventory's dsv41_rank_metrics: runtime, "
        "api_url, ranks, overlay_port): read each rank's counters there "
        "(under vLLM each Spark's overlay endpoint) instead of --metrics-url.",
    ),
    require_rank: list[str] = typer.Option(
        ["0", "1"], "--require-rank", help="Rank whose Engram lookups must grow with zero fallbacks (repeat)."
    ),
    counters: bool = typer.Option(
        True, "--counters/--no-counters", help="Read /metrics around the prompts and check the requirements."
    ),
    require_drafter: bool = typer.Option(
        True,
        "--require-drafter/--no-require-drafter",
        help="Rank 0's speculator must run rounds with no identity refusal.",
    ),
    attempts: int = typer.Option(5, min=1, help="Runs while only the counters fail (a token mismatch fails at once)."),
    delay: float = typer.Option(3.0, min=0.0, help="Seconds between attempts."),
) -> None:
    """Re-run the recorded prompts and check the Engram and drafter counters, as the deploy does
    (dsv41.harness.refs.check); exit 1 naming the first differing positions or the failing rank."""
    from dsv41.harness import refs

    url = (metrics_url or endpoint.rstrip("/") + "/metrics") if counters else None
    if counters and rank_metrics:
        from dsv41.harness import rank_metrics as RM

        try:
            url = RM.urls(fileio.loads_json(rank_metrics))
        except ValueError as exc:
            raise RM.RankMetricsError(f"--rank-metrics: not JSON ({exc})") from None
    res = refs.check(
        endpoint,
        refs_file,
        mode="verify",
        metrics_url=url,
        require_ranks=require_rank if counters else [],
        require_drafter=counters and require_drafter,
        attempts=attempts,
        delay_s=delay,
    )
    print(fileio.dumps_json(res.to_dict(), nonfinite="null") if as_json else res.comparison.summary())
    msg = res.message()
    if msg:
        raise VerificationError(msg)
