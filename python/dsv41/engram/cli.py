"""``dsv41 engram ...``: layout, hash, make-tables, manifest, verify, read-rows.

The remote engineer's ``dsv41.engram.remote_cli`` (serve, sweep) registers itself on ``app``
when present.  Heavy imports happen inside commands so ``dsv41 --help`` stays fast.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated

import typer

from dsv41 import fileio
from dsv41.errors import ConfigError, Dsv41Error

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _ints(value: str, what: str) -> list[int]:
    out = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part, 0)
        except ValueError:
            raise ConfigError(f"{what}: {part!r} is not an integer") from None
        if not -(1 << 63) <= v < (1 << 63):  # numpy int64 is where these go
            raise ConfigError(f"{what}: {part} does not fit in a 64-bit integer")
        out.append(v)
    if not out:
        raise ConfigError(f"{what}: give a comma-separated list of integers")
    return out


def _check_chunk_size(chunk_size: int) -> None:
    if not 4096 <= chunk_size <= (1 << 40):
        raise ConfigError(f"--chunk-size must be in [4096, 2^40] bytes, got {chunk_size}")


@app.command()
def layout(
    config: Annotated[Path, typer.Argument(help="Model config JSON (flat or with text_config).")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")] = 1,
) -> None:
    """Print primes, offsets, multipliers, rows and per-rank columns/row ranges as JSON."""
    from dsv41.engram.layout import EngramLayout

    print(fileio.dumps_json(EngramLayout.from_config(config).to_json(tp)))


@app.command("hash")
def hash_cmd(
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")],
    token_map: Annotated[Path, typer.Option("--token-map", help="JSON list of ints, or object with key token_map.")],
    tokens: Annotated[str, typer.Option("--tokens", help="Comma-separated raw token ids, e.g. 3,5,6,8.")],
    mask: Annotated[str | None, typer.Option("--mask", help="Comma-separated 1 (live) / 0 (DEAD) per token.")] = None,
) -> None:
    """Hash tokens to global row ids: prints {"rows": ...}, shape T x layers x 24."""
    import numpy as np

    from dsv41.engram.hashing import NgramHasher, load_token_map
    from dsv41.engram.layout import EngramLayout

    toks = _ints(tokens, "--tokens")
    m = None
    if mask is not None:
        mv = _ints(mask, "--mask")
        if any(x not in (0, 1) for x in mv):
            raise ConfigError("--mask: values must be 0 or 1")
        if len(mv) != len(toks):
            raise ConfigError(f"--mask has {len(mv)} values, --tokens has {len(toks)}")
        m = np.asarray(mv, dtype=bool)
    h = NgramHasher(EngramLayout.from_config(config), load_token_map(token_map))
    rows, _ = h.hash(np.asarray(toks, dtype=np.int64), m)
    print(fileio.dumps_json({"rows": rows.tolist()}))


@app.command("make-tables")
def make_tables(
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (shards + manifest.json).")],
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic content.")] = 0,
    revision: Annotated[
        str | None, typer.Option("--revision", help="Manifest revision (default synthetic-seedN).")
    ] = None,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="Bytes per verified chunk.")] = 32 << 20,
    force: Annotated[
        bool, typer.Option("--force", help="Replace files in --out that make-tables did not write.")
    ] = False,
) -> None:
    """Write deterministic synthetic shards in the real layout plus manifest.json.

    Shards are written to temporary names and renamed only when all are complete, the manifest
    last; files in --out that are not earlier make-tables output are never replaced without
    --force."""
    from dsv41.engram.synthetic import write_synthetic_tables

    _check_chunk_size(chunk_size)
    p = write_synthetic_tables(config, out, seed, revision=revision, chunk_size=chunk_size, force=force)
    print(str(p))


@app.command("manifest")
def manifest_cmd(
    config: Annotated[Path, typer.Option("--config", help="Model config JSON.")],
    data: Annotated[Path, typer.Option("--data", help="Directory holding the shards.")],
    revision: Annotated[str, typer.Option("--revision", help="Checkpoint revision, e.g. dba1be0a.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the manifest JSON.")],
    file: Annotated[list[str] | None, typer.Option("--file", help="LAYER=NAME (default: the last shards).")] = None,
    chunk_size: Annotated[int, typer.Option("--chunk-size")] = 32 << 20,
) -> None:
    """Build a manifest for existing shards (e.g. the real checkpoint) by hashing them."""
    from dsv41.engram.manifest import build_manifest

    files = None
    if file:
        files = {}
        for f in file:
            k, sep, v = f.partition("=")
            if not sep or not k.strip().isdigit() or not v:
                raise ConfigError(f"--file {f!r}: expected LAYER=NAME")
            files[int(k)] = v
    _check_chunk_size(chunk_size)
    m = build_manifest(config, data, files, revision=revision, chunk_size=chunk_size)
    m.save(out)
    print(str(out))


@app.command()
def verify(
    manifest: Annotated[Path, typer.Option("--manifest", help="manifest.json")],
    data: Annotated[Path | None, typer.Option("--data", help="Shard directory (default: the manifest's).")] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="Hashing threads (default: CPUs).")] = None,
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="Progress bar (default: on a TTY).")
    ] = None,
    cache: Annotated[
        Path | None,
        typer.Option("--cache", help="Verify cache file: skip shards unchanged since their last verification."),
    ] = None,
    full: Annotated[bool, typer.Option("--full", help="Re-hash every shard whatever the cache says.")] = False,
) -> None:
    """Verify sizes, every chunk's sha256 and the safetensors headers; exit 1 naming file, chunk
    and byte range (or file and tensor)."""
    from dsv41.engram.manifest import load_manifest, verify as do_verify

    if workers is not None and not 1 <= workers <= 1024:
        raise ConfigError(f"--workers must be in [1, 1024], got {workers}")
    m = load_manifest(manifest)
    rep = do_verify(m, data, workers=workers, progress=progress, cache=cache, mode="full" if full else "cached")
    total = sum(f["size"] for f in m.files)
    print(
        fileio.dumps_json(
            {
                "verified": True,
                "files": len(m.files),
                "bytes": total,
                "hashed": rep.verified,
                "cached": rep.cached,
                "tables": {str(t.layer_id): t.identity for t in m.tables},
            }
        )
    )


@app.command("read-rows")
def read_rows(
    manifest: Annotated[Path, typer.Option("--manifest", help="manifest.json")],
    layer: Annotated[int, typer.Option("--layer", help="Engram layer id, e.g. 1.")],
    rows: Annotated[str, typer.Option("--rows", help="Comma-separated global row ids.")],
    data: Annotated[Path | None, typer.Option("--data", help="Shard directory (default: the manifest's).")] = None,
    source: Annotated[
        str, typer.Option("--source", help="local, or tcp://H:P / nixl://H:P of a table server.")
    ] = "local",
) -> None:
    """Print one hex row (weight + scale bytes) per line, in request order."""
    import numpy as np

    from dsv41.engram.manifest import load_manifest

    ids = np.asarray(_ints(rows, "--rows"), dtype=np.int64)
    m = load_manifest(manifest)
    if source == "local":
        from dsv41.engram.reader import LocalRowReader

        with LocalRowReader(m, data or manifest.parent, threads=4) as r:
            out = r.read(layer, ids)
    else:
        from dsv41.engram.rowsource import parse_remote_url

        parse_remote_url(source, what="--source")
        try:
            client = importlib.import_module("dsv41.engram.client")
        except ModuleNotFoundError as exc:
            if exc.name == "dsv41.engram.client":
                raise Dsv41Error(
                    f"--source {source}: remote reads need dsv41.engram.client, which is not installed"
                ) from None
            raise
        m.table(layer)
        out = client.read_rows_remote(source, m, layer, ids)
    print("\n".join(bytes(row).hex() for row in out))


def _register_remote(target: typer.Typer = app) -> bool:
    """Let the remote part (serve, sweep) add its commands to ``target`` when it is installed;
    returns whether it was."""
    import importlib.util

    if importlib.util.find_spec("dsv41.engram.remote_cli") is None:
        return False  # the remote part is not installed here
    # errors inside remote_cli itself must surface, not be hidden
    remote_cli = importlib.import_module("dsv41.engram.remote_cli")

    remote_cli.register(target)
    return True


_register_remote()
