"""``dsv41 package``: show, compare and verify promotion packages (``packages/<id>`` on the controller).

Ids may be given in full or as a unique prefix of 8+ hex characters. Every command exits 1 with
one line on bad input (unknown id, malformed record) and on a tampered package.
"""

from __future__ import annotations

from pathlib import Path

import typer

from dsv41 import fileio
from dsv41.promotion import journal as journal_mod, package as pkg

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

ROOT_OPT = typer.Option("packages", "--root", help="Directory holding the packages (the controller's packages/).")


def _short(x) -> str:
    return fileio.dumps_json(x, sort_keys=True) if isinstance(x, (dict, list)) else str(x)


@app.command()
def show(
    ref: str = typer.Argument(..., help="Package id (or unique prefix)."),
    root: Path = ROOT_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print package.json as JSON."),
) -> None:
    """Print one package: provenance and, per host, facts and managed files with sha256."""
    pid = pkg.resolve(root, ref)
    doc = pkg.load(root, pid)
    if as_json:
        print(fileio.dumps_json({"id": pid, **doc}, sort_keys=True, indent=1))
        return
    p = doc["provenance"]
    print(f"package {pid}")
    print("  " + ", ".join(f"{k}={p[k]}" for k in sorted(p) if p[k] not in (None, False)))
    if doc["greedy_refs"]:
        print(f"  greedy references sha256 {doc['greedy_refs']['sha256']}")
    for host, h in doc["hosts"].items():
        print(
            f"  {host} (rank {h['rank']}, {','.join(h['groups'])}): dsv41 {h['dsv41']}"
            + (f", KV budget {h['kv_budget']}" if h.get("kv_budget") is not None else "")
            + (f", image {h['image']}" if h.get("image") else "")
        )
        for path, f in h["files"].items():
            print(f"    {f['sha256']}  {f['mode']}  {path}")


@app.command("diff")
def diff_cmd(
    a: str = typer.Argument(..., help="From package id."),
    b: str = typer.Argument(..., help="To package id."),
    root: Path = ROOT_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print the diff as JSON."),
) -> None:
    """What changes on which host going from package A to package B (exit 0 either way)."""
    ida, idb = pkg.resolve(root, a), pkg.resolve(root, b)
    d = pkg.diff(pkg.load(root, ida), pkg.load(root, idb))
    if as_json:
        print(fileio.dumps_json({"from": ida, "to": idb, **d}, sort_keys=True, indent=1))
        return
    print(f"{ida[:12]} -> {idb[:12]}: " + (f"{len(d['hosts'])} host(s) change" if d["hosts"] else "same production"))
    for k, (va, vb) in d["provenance"].items():
        print(f"  provenance {k}: {va} -> {vb}")
    if d["greedy_refs"]:
        print("  greedy references change")
    for host, h in d["hosts"].items():
        print(f"  {host}:")
        for tag, key in (("+", "added"), ("-", "removed"), ("~", "changed")):
            for path in h[key]:
                print(f"    {tag} {path}")
        for k, (va, vb) in h["facts"].items():
            print(f"    {k}: {_short(va)} -> {_short(vb)}")


@app.command()
def verify(
    ref: str = typer.Argument(..., help="Package id (or unique prefix)."),
    root: Path = ROOT_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Recompute the package id and every file's sha256; exit 1 naming the first mismatch."""
    r = pkg.verify(root, pkg.resolve(root, ref))
    if as_json:
        print(fileio.dumps_json({"ok": True, **r}, sort_keys=True))
    else:
        print(
            f"package {r['id']} verified: {r['files']} files, {r['bytes']} bytes, "
            + ", ".join(f"{h} {n}" for h, n in r["hosts"].items())
        )


@app.command("list")
def list_cmd(root: Path = ROOT_OPT) -> None:
    """The stored package ids, one a line, with their provenance."""
    for pid in pkg.known_ids(root):
        p = pkg.load(root, pid)["provenance"]
        print(
            f"{pid}  {p['op']}"
            + (f" {p['candidate']}" if p.get("candidate") else "")
            + (f" {p['component']}" if p.get("component") else "")
        )


@app.command()
def journal(
    path: Path = typer.Option(Path("packages/journal.jsonl"), "--path", help="The promotion journal."),
    as_json: bool = typer.Option(False, "--json", help="Print the replay decision as JSON."),
) -> None:
    """What a re-run would do first after an interruption (finish, revert or nothing)."""
    d = journal_mod.decide(journal_mod.read_journal(path))
    if as_json:
        print(fileio.dumps_json(d.as_dict(), sort_keys=True))
    elif d.action == "none":
        print(f"journal {path}: nothing interrupted" + (f" (last operation {d.op} {d.kind})" if d.op else ""))
    else:
        print(f"journal {path}: {d.kind} {d.op} stopped after {d.last_step}; a re-run will {d.action} to {d.package}")


JOURNAL_OPT = typer.Option("packages/journal.jsonl", "--path", help="The promotion journal.")


@app.command("bringup-plan")
def bringup_plan(
    path: Path = JOURNAL_OPT,
    stage: str = typer.Option("", "--stage", help="Run only this stage (its earlier stages passed)."),
    restart: bool = typer.Option(False, "--restart", help="A new bring-up from stage stock."),
) -> None:
    """Which bring-up stages run now, as JSON: {run, new, passed, stages, role_vars: {stage: vars}}."""
    from dsv41.promotion import bringup

    out = bringup.plan(journal_mod.read_journal(path), stage=stage, restart=restart)
    out["role_vars"] = {s: bringup.role_vars(s) for s in bringup.STAGES}
    print(fileio.dumps_json(out, sort_keys=True))


@app.command("bringup-gate")
def bringup_gate(
    stage: str = typer.Argument(..., help="The stage whose gate decides."),
    host: str = typer.Option(..., "--host", help="The host the values were measured on."),
    measured: str = typer.Option(..., "--measured", help="JSON: the gate's measured values."),
) -> None:
    """A bring-up stage's gate: prints the fields to journal (JSON), or exits 1 with one line
    naming the stage, the host and the measured value."""
    from dsv41.promotion import bringup

    try:
        values = fileio.loads_json(measured)
    except ValueError as exc:
        raise bringup.BringupError(f"--measured is not JSON: {exc}") from None
    print(fileio.dumps_json(bringup.gate(stage, host, values), sort_keys=True))
