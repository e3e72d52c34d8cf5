"""``dsv41 env check FILE``: validate an env file against the ``DSV41_*`` contract.

An env file is what the roles write for systemd units: ``KEY=VALUE`` lines, blank lines and
``#`` comments; a value may be wrapped in matching single or double quotes (systemd's
``EnvironmentFile`` strips them). The check refuses: a line that is not ``KEY=VALUE``, a key
given twice, a ``DSV41_*`` name not in :data:`dsv41.envs.ENV_VARS` (a typo would otherwise be
ignored), an old ``VLLM_ENGRAM_REMOTE*`` spelling, and every value or combination that
:func:`dsv41.envs.parse` refuses; with ``--tp N`` also an Engram URL list that is not one valid
URL per rank. Names outside ``DSV41_*`` (``UCX_TLS``, ``OMP_NUM_THREADS``...) pass unchecked.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from dsv41 import envs, fileio
from dsv41.errors import Dsv41Error

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

MAX_BYTES = 1 << 20  # an env file is a few hundred bytes; refuse to slurp a wrong path


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` pairs of ``path`` in file order. Raises :class:`Dsv41Error` naming the file
    and line of the first malformed line or repeated key, or an unreadable file."""

    text = fileio.read_text(path, "env file", max_bytes=MAX_BYTES)
    return envs.parse_env_text(text, str(path))


def check_env(values: dict[str, str], tp: int | None = None) -> envs.Settings:
    """Validate ``values`` (an env file's pairs) and return their :class:`dsv41.envs.Settings`.

    Raises :class:`dsv41.envs.ConfigError` naming the variable at fault."""
    for key in values:
        if key.startswith(envs.PREFIX) and key not in envs.ENV_VARS:
            raise envs.ConfigError(key, f"{key} is not a dsv41 variable (dsv41.envs.ENV_VARS; a typo?)")
    settings = envs.parse(values)
    if tp is not None:
        from dsv41.engram.rowsource import remote_config

        remote_config(settings, tp)
    return settings


@app.command("check")
def check_cmd(
    file: Annotated[Path, typer.Argument(help="Env file (KEY=VALUE lines, # comments).")],
    tp: Annotated[
        int | None,
        typer.Option("--tp", min=1, max=64, help="Also check DSV41_ENGRAM_REMOTE holds one URL per rank of TP N."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="JSON output: the variables set and their parsed values.")
    ] = False,
) -> None:
    """Validate an env file: exit 0 when the engine would accept it, else one line and exit 1."""
    values = read_env_file(file)
    try:
        settings = check_env(values, tp)
    except envs.ConfigError as exc:
        raise Dsv41Error(f"env file {file}: {exc}") from None
    parsed = asdict(settings)
    mine = {name: parsed[v.field] for name, v in envs.ENV_VARS.items() if name in values}
    if as_json:
        print(
            fileio.dumps_json(
                {
                    "file": str(file),
                    "ok": True,
                    "variables": mine,
                    "other": sorted(k for k in values if k not in envs.ENV_VARS),
                },
                sort_keys=True,
            )
        )
    else:
        print(f"{file}: ok ({len(mine)} dsv41 variable(s), {len(values) - len(mine)} other)")


@app.command("unit")
def unit_cmd(
    file: Annotated[Path, typer.Argument(help="Rendered systemd unit (Ansible's validate passes it as %s).")],
    name: Annotated[str, typer.Option("--name", help="The unit's name on the host, NAME.service.")],
    root: Annotated[
        Path | None,
        typer.Option(
            "--root",
            help="Verify against this filesystem root (its executables and system units) instead of this host.",
        ),
    ] = None,
) -> None:
    """Verify a systemd unit with systemd-analyze: exit 0 only when it reports nothing at all."""
    from dsv41.entrypoints.unit_check import check_unit_file

    if root is not None and not root.is_dir():
        raise Dsv41Error(f"--root {root}: not a directory")
    lines = check_unit_file(file, name, root)
    print(f"{file}: ok (unit {name}, {lines} lines, systemd-analyze verify reported nothing)")


@app.command("image")
def image_cmd(
    pin: Annotated[str, typer.Option("--pin", help="The pinned image: REPO@sha256:<hex> or an image ID sha256:<hex>.")],
    host: Annotated[str, typer.Option("--host", help="The host's inventory name (named in the refusal).")],
    docker: Annotated[str, typer.Option("--docker", help="The container CLI.")] = "/usr/bin/docker",
    repository: Annotated[
        str,
        typer.Option(
            "--repository", help="Repository whose images are named when the pin is absent (default: the pin's)."
        ),
    ] = "",
) -> None:
    """Is the pinned serving image in this host's dockerd with exactly that ID/digest? Exit 0 and one
    JSON line, else one line naming the host, the pin and what was found, exit 1."""
    from dsv41 import serve_image

    serve_image.parse_pin(pin)  # a bad pin is refused before dockerd is asked
    print(fileio.dumps_json(serve_image.check(pin, serve_image.list_images(docker), host, repository), sort_keys=True))
