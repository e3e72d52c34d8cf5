"""``dsv41 overlay``: the vLLM overlay's checks an operator runs by hand.

``dsv41 overlay contract [--image IMAGE | --python PY]``: read an installed vLLM's version and
the sha256 of the files the overlay patches or relies on (inside a serving image through
``docker run --entrypoint python3``, with another interpreter, or the current one), compare them
with every contract the overlay ships (``dsv41/overlay/vllm_contract.json``) and say exactly what
differs. Exit 0: a shipped contract holds; 1: none does (each difference listed); 2: the vLLM
could not be read (no vLLM, the image or interpreter does not run, bad arguments).
"""

from __future__ import annotations

import typer

from dsv41 import fileio
from dsv41.errors import Dsv41Error

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _line(d: dict) -> str:
    found = d["found"] if d["found"] is not None else ("missing" if d["what"] != "version" else "no vLLM")
    if d["what"] == "version":
        return f"  version: expected {d['expected']}, found {found}"
    return f"  {d['what']}: expected sha256 {d['expected']}, found {found}"


@app.command("contract")
def contract_cmd(
    image: str | None = typer.Option(
        None, "--image", help="A serving image (name[:tag][@digest]); run with --pull never, so pull it first."
    ),
    python: str | None = typer.Option(None, "--python", help="Another Python interpreter whose vLLM to read."),
    container_runtime: str = typer.Option("docker", help="The container CLI that runs --image."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    timeout: float = typer.Option(300.0, min=1.0, help="Seconds allowed for the inspection."),
) -> None:
    """Compare an installed vLLM with the overlay's shipped contracts (exit 0 holds, 1 differs,
    2 could not read)."""
    from dsv41.overlay import contract as C

    if image is not None and python is not None:
        raise Dsv41Error("give --image or --python, not both", exit_code=2)
    if container_runtime not in ("docker", "podman"):
        raise Dsv41Error(f"--container-runtime must be docker or podman, got {container_runtime!r}", exit_code=2)
    try:
        contracts = C.shipped_contracts()
    except Dsv41Error as exc:
        raise Dsv41Error(str(exc), exit_code=2) from None
    found = C.inspect(python=python, image=image, container_runtime=container_runtime, timeout_s=timeout)
    where = f"image {image}" if image else f"interpreter {python}" if python else "this interpreter"
    if found.get("root") is None:
        raise Dsv41Error(
            f"{where}: no vllm package is installed (supported: vLLM {', '.join(C.supported_versions(contracts))})",
            exit_code=2,
        )
    results = [{"vllm_version": c["vllm_version"], "differences": C.differences(c, found)} for c in contracts]
    ok = any(not r["differences"] for r in results)
    if as_json:
        print(fileio.dumps_json({"where": where, "found": found, "contracts": results, "holds": ok}))
    else:
        print(
            f"{where}: vLLM {found.get('version') or '(no distribution metadata)'} at {found['root']} "
            f"(Python {found.get('python')})"
        )
        for r in results:
            if not r["differences"]:
                print(f"matches the overlay's vLLM {r['vllm_version']} contract: supported")
                continue
            print(f"differs from the overlay's vLLM {r['vllm_version']} contract ({len(r['differences'])}):")
            for d in r["differences"]:
                print(_line(d))
        if not ok:
            print(
                f"unsupported: the overlay supports vLLM {', '.join(C.supported_versions(contracts))} only "
                '(docs/operations.md, "Supported serving images")'
            )
    if not ok:
        raise typer.Exit(1)
