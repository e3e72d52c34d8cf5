"""``dsv41 refs record|verify``: the six greedy reference prompts against a serving endpoint."""

from __future__ import annotations

import json
import os

import typer

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
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Re-run the recorded prompts and compare; exit 1 naming the first differing positions."""
    from dsv41.harness import refs

    cmp = refs.verify(endpoint, refs.load_refs(refs_file))
    if as_json:
        print(json.dumps(cmp.to_dict()))
    else:
        print(cmp.summary())
    if cmp.identical != cmp.total:
        raise VerificationError(f"greedy references differ: {cmp.summary()}")
