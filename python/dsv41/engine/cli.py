"""``dsv41 engine``: init-weights, identity, generate (engine-only commands).

``dsv41 engine serve`` joins the engine and the drafter, so it lives in the composition root
(:mod:`dsv41.entrypoints.engine_serve`), which adds it to this group.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from dsv41 import envs, fileio
from dsv41.envs import Settings
from dsv41.errors import Dsv41Error

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "data" / "lab_model.json"


def set_threads(n: int | None, settings: Settings | None = None) -> None:
    """torch CPU threads: ``n``, else ``DSV41_ENGINE_THREADS`` (``settings`` or the environment)."""
    import torch

    torch.set_num_threads(max(1, n or (settings or envs.parse()).engine_threads))


@app.command("init-weights")
def init_weights_cmd(
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")] = DEFAULT_CONFIG,
    out: Annotated[Path, typer.Option("--out", help="Output safetensors file.")] = Path("weights.safetensors"),
    quiet: Annotated[bool, typer.Option("--quiet", help="No training progress on stderr.")] = False,
) -> None:
    """Deterministic weights from the config seed: seeded init + a short single-threaded training
    run on the built-in toy corpus. Prints the target identity (sha256 of config + weights)."""
    from dsv41.engine.model_config import load_config
    from dsv41.engine.weights import init_weights, save_weights, target_identity

    cfg = load_config(config)
    # Fail before the ~1 min training run, not after it.
    if not out.parent.is_dir():
        raise Dsv41Error(f"--out {out}: directory {out.parent} does not exist")
    if out.is_dir():
        raise Dsv41Error(f"--out {out} is a directory; give a file name")
    prog = None if quiet else (lambda s, loss: print(f"init-weights: step {s} loss {loss:.3f}", file=sys.stderr))
    w, meta = init_weights(cfg, progress=prog)
    save_weights(cfg, w, meta, out)
    print(f"{out} {target_identity(config, out)}")


@app.command("identity")
def identity_cmd(
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")] = DEFAULT_CONFIG,
    weights: Annotated[Path, typer.Option("--weights", help="Weights safetensors.")] = Path("weights.safetensors"),
) -> None:
    """Print the target identity: sha256 over the config bytes then the weights bytes."""
    from dsv41.engine.weights import target_identity

    print(target_identity(config, weights))


def row_source(manifest: Path, data: Path | None, rank: int, tp: int, settings: Settings | None = None):
    """The rank's RowSource (``DSV41_ENGRAM_REMOTE*`` in ``settings``); one-line errors for
    a missing manifest or data directory."""
    from dsv41.engram import sources

    if not manifest.is_file():
        raise Dsv41Error(f"manifest {manifest} does not exist (run `dsv41 engram make-tables`)")
    if data is not None and not data.is_dir():
        raise Dsv41Error(f"--data {data} is not a directory (the table shards from `dsv41 engram make-tables`)")
    return sources.from_env(str(manifest), str(data) if data else None, rank, tp, settings=settings)


@app.command("generate")
def generate_cmd(
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text.")],
    manifest: Annotated[Path, typer.Option("--manifest", help="Engram manifest.json.")],
    data: Annotated[Path | None, typer.Option("--data", help="Directory of the table shards.")] = None,
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")] = DEFAULT_CONFIG,
    weights: Annotated[Path, typer.Option("--weights", help="Weights safetensors.")] = Path("weights.safetensors"),
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate (greedy).")] = 32,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="JSON output.")] = False,
) -> None:
    """Greedy-generate from one prompt at TP1 (row source from DSV41_ENGRAM_REMOTE*); prints the
    token ids and the text."""

    from dsv41.engine.runner import LocalRunner
    from dsv41.tokenizer import ByteTokenizer

    settings = envs.parse()
    set_threads(None, settings)
    check_device(device)
    tok = ByteTokenizer()
    rows = row_source(manifest, data if data else manifest.parent, 0, 1, settings)
    try:
        res = LocalRunner(config, weights, rows, device=device).generate(tok.encode(prompt), max_tokens)
    finally:
        rows.close()
    if as_json:
        print(fileio.dumps_json({"tokens": res.tokens, "text": tok.decode(res.tokens), "counters": rows.counters()}))
    else:
        print(",".join(map(str, res.tokens)))
        print(tok.decode(res.tokens))


def check_device(device: str) -> None:
    """``cpu`` or ``cuda[:N]`` with a CUDA device torch can see; Dsv41Error otherwise."""
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise Dsv41Error(f"--device must be cpu or cuda[:N], got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise Dsv41Error("--device cuda asked for, but torch sees no CUDA device")
