"""The vLLM contract: what the overlay patches and relies on in one vLLM release, and the checks
made against the installed vLLM before anything is patched.  Torch-free.

``vllm_contract.json`` (next to this module) is written by ``tools/vllm_contract.py`` from the
wheel itself and committed; re-pinning vLLM means re-running the tool and reviewing the diff.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from dsv41 import fileio
from dsv41.envs import RENAMED
from dsv41.errors import ConfigError, Dsv41Error

FORMAT = "dsv41-vllm-contract"
VERSION = 1
CONTRACT_PATH = Path(__file__).with_name("vllm_contract.json")

ENGRAM_FILE = "vllm/models/deepseek_v41/common/engram.py"
SPEC_INIT_FILE = "vllm/v1/worker/gpu/spec_decode/__init__.py"
SPECULATOR_FILE = "vllm/v1/worker/gpu/spec_decode/speculator.py"
MODEL_RUNNER_FILE = "vllm/v1/worker/gpu/model_runner.py"
BREAKABLE_FILE = "vllm/compilation/breakable_cudagraph.py"
PLUGINS_FILE = "vllm/plugins/__init__.py"
ENGRAM_CONFIG_FILE = "vllm/config/engram.py"
#: Files whose objects the overlay replaces (Engram: ParallelEngramEmbedding._allocate_weights,
#: .lookup, Engram._create_embedding, Engram._finish_prefetch; drafter: init_speculator in both
#: modules). BREAKABLE_FILE is relied on: eager breaks, and BreakableCUDAGraphCapture.is_active
#: (the lookup runs on the launching thread while a capture is open).
PATCHED_FILES = (ENGRAM_FILE, SPEC_INIT_FILE, MODEL_RUNNER_FILE)
#: Files whose behaviour the overlay relies on without patching them.
RELIED_FILES = (SPECULATOR_FILE, BREAKABLE_FILE, PLUGINS_FILE, ENGRAM_CONFIG_FILE)
CHECKED_FILES = PATCHED_FILES + RELIED_FILES
CONTRACT_TPS = (1, 2, 4)

PLUGIN_NAME = "dsv41_overlay"
PLUGIN_VALUE = "dsv41.overlay.plugin:register"
VLLM_ENV = ("VLLM_PLUGINS", "VLLM_USE_BREAKABLE_CUDAGRAPH")
DSV41_ENV = (
    "DSV41_ENGRAM_REMOTE",
    "DSV41_ENGRAM_REMOTE_TIMEOUT_MS",
    "DSV41_ENGRAM_REMOTE_REQUIRED",
    "DSV41_RUNTIME_ROOT",
    "DSV41_DRAFTER_REMOTE",
    "DSV41_DRAFTER_DIR",
    "DSV41_DRAFTER_ASYNC",
    "DSV41_DRAFTER_K",
    "DSV41_DRAFTER_TIMEOUT_MS",
)
#: Old names, refused with the new name in the message (dsv41.envs.RENAMED).
OLD_ENV = dict(RENAMED)
PIECEWISE_FLAG = '--compilation-config \'{"cudagraph_mode": "PIECEWISE"}\''
#: What the overlay requires of vLLM's compilation when Engram rows are remote: the host-side
#: fetch runs in an eager_break_during_capture function, which re-runs at every PIECEWISE
#: replay but is captured once (stale rows) under FULL graphs and the specialized decode.
COMPILATION = {
    "engram_remote": {
        "cudagraph_mode_allowed": ["NONE", "PIECEWISE"],
        "cudagraph_mode_refused": ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"],
        "flag": PIECEWISE_FLAG,
        "breakable_cudagraph_env": "VLLM_USE_BREAKABLE_CUDAGRAPH",
        "breakable_cudagraph_required_for": "PIECEWISE",
        "specialized_decode": {"additional_config_key": "decode_backend", "refused": "latency_specialized"},
        "engram_config": {"cpu_offload": True, "dp_shared_memory": False, "engram_dp_size": 1},
    }
}


class ContractMismatch(Dsv41Error):
    """The installed vLLM is not the one the contract was written for."""


def load(path: str | Path | None = None) -> dict[str, Any]:
    """The contract dict; ConfigError when missing, not JSON or not this format."""
    p = Path(path) if path is not None else CONTRACT_PATH
    from dsv41 import fileio

    try:
        c = fileio.loads_json(fileio.read_text(p, "vLLM contract", error=ConfigError))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"vLLM contract {p}: not JSON ({exc})") from None
    if not isinstance(c, dict) or c.get("format") != FORMAT or c.get("version") != VERSION:
        raise ConfigError(f"vLLM contract {p}: not a {FORMAT} v{VERSION} file")
    for key in ("vllm_version", "files", "ranges", "entry_point"):
        if key not in c:
            raise ConfigError(f"vLLM contract {p}: missing {key!r}")
    return c


def installed_vllm_root() -> Path | None:
    """Directory holding the installed ``vllm`` package (its parent), found without importing
    it; None when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def installed_version() -> str | None:
    """``vllm``'s distribution version, or None when not installed."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_files(contract: dict[str, Any], root: str | Path, version: str | None) -> list[str]:
    """Every difference between the contract and the vLLM under ``root`` (``root/vllm/...``):
    version, missing files and sha256 mismatches.  Empty list = the contract holds."""
    problems = []
    if version != contract["vllm_version"]:
        problems.append(f"vLLM version {version} != contract {contract['vllm_version']}")
    for rel, rec in sorted(contract["files"].items()):
        p = Path(root) / rel
        from dsv41 import fileio

        try:
            digest = hashlib.sha256(fileio.read_bytes(p)).hexdigest()
        except fileio.FileError as exc:
            problems.append(f"{rel} is missing" if not os.path.lexists(p) else str(exc))
            continue
        if digest != rec["sha256"]:
            problems.append(f"{rel} sha256 {digest[:12]} != contract {rec['sha256'][:12]}")
    return problems


def expected_ranges(contract: dict[str, Any], tp: int, rank: int) -> dict[str, Any] | None:
    """The contract's ranges of ``rank`` at ``tp`` (None when the contract has no such TP)."""
    ranks = contract["ranges"]["tp"].get(str(tp))
    if ranks is None or not 0 <= rank < len(ranks):
        return None
    return ranks[rank]


def check_ranges(
    layout: Any, layer_id: int, tp: int, rank: int, got: dict[str, int], contract: dict[str, Any] | None = None
) -> list[str]:
    """Compare vLLM's ranges of one embedding (``got``: head_start, part_n_hash_cols,
    vocab_start_idx, vocab_end_idx) with the dsv41 layout's (``layout``: EngramLayout of the
    manifest) and, when the layout is the contract's model, with the contract's.  Returns the
    differences (empty = agree)."""
    li = layout.layer_index(layer_id)
    c0, _ = layout.columns_for_rank(tp, rank)
    lo, hi = layout.row_range(li, tp, rank)
    part = -(-layout.n_columns // tp)
    want = {"head_start": c0, "part_n_hash_cols": part, "vocab_start_idx": lo, "vocab_end_idx": hi}
    problems = [
        f"layer {layer_id} rank {rank}/{tp}: vLLM {k}={got.get(k)} != dsv41 layout {v}"
        for k, v in want.items()
        if got.get(k) != v
    ]
    if contract is not None:
        rows = contract["ranges"].get("layer_rows", {})
        same_model = [str(x) for x in layout.layer_ids] == list(rows) and [
            rows[str(x)] for x in layout.layer_ids
        ] == list(layout.rows)
        exp = expected_ranges(contract, tp, rank) if same_model else None
        if exp is not None:
            lay = {x["layer_id"]: x for x in exp["layers"]}.get(layer_id, {})
            cwant = {
                "head_start": exp["head_start"],
                "part_n_hash_cols": exp["part_n_hash_cols"],
                "vocab_start_idx": lay.get("vocab_start_idx"),
                "vocab_end_idx": lay.get("vocab_end_idx"),
            }
            problems += [
                f"layer {layer_id} rank {rank}/{tp}: vLLM {k}={got.get(k)} != contract {v}"
                for k, v in cwant.items()
                if got.get(k) != v
            ]
    return problems


# ---- an installed vLLM compared with the shipped contracts (`dsv41 overlay contract`) -----------

#: Run by the inspected interpreter (``python3 -c PROBE FILES_JSON``): the vLLM distribution's
#: version and the sha256 of each named file under the directory holding the ``vllm`` package,
#: found without importing vLLM. Prints one JSON object; standard library only.
PROBE = r"""
import hashlib, importlib.metadata, importlib.util, json, os, sys
if sys.path and sys.path[0] == "":  # -c puts the working directory first: read the installed vLLM only
    sys.path.pop(0)
out = {"python": sys.version.split()[0], "version": None, "root": None, "files": {}}
try:
    out["version"] = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pass
spec = importlib.util.find_spec("vllm")
if spec is not None and spec.submodule_search_locations:
    out["root"] = os.path.dirname(list(spec.submodule_search_locations)[0])
    for rel in json.loads(sys.argv[1]):
        try:
            with open(os.path.join(out["root"], rel), "rb") as f:
                out["files"][rel] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            out["files"][rel] = None
print(json.dumps(out))
"""


def shipped_contracts() -> list[dict[str, Any]]:
    """Every contract the overlay ships (today one: ``vllm_contract.json``), loaded (ConfigError
    when one is unreadable)."""
    return [load()]


def supported_versions(contracts: list[dict[str, Any]] | None = None) -> list[str]:
    """The vLLM versions of ``contracts`` (default :func:`shipped_contracts`)."""
    return [c["vllm_version"] for c in (contracts if contracts is not None else shipped_contracts())]


def differences(contract: dict[str, Any], found: dict[str, Any]) -> list[dict[str, Any]]:
    """What differs between ``contract`` and ``found`` (what :data:`PROBE` printed): a list of
    ``{"what": "version" | <file>, "expected": str, "found": str | None}`` (None: missing); empty
    when the contract holds."""
    out: list[dict[str, Any]] = []
    if found.get("version") != contract["vllm_version"]:
        out.append({"what": "version", "expected": contract["vllm_version"], "found": found.get("version")})
    files = found.get("files") or {}
    for rel, rec in sorted(contract["files"].items()):
        got = files.get(rel)
        if got != rec["sha256"]:
            out.append({"what": rel, "expected": rec["sha256"], "found": got})
    return out


def probe_command(
    files: list[str], *, python: str | None = None, image: str | None = None, container_runtime: str = "docker"
) -> list[str]:
    """The argv that runs :data:`PROBE` with ``python`` (a path; default this interpreter) or inside ``image`` (``RUNTIME run
    --rm --pull never --network none --entrypoint python3 IMAGE``). ConfigError for an image
    reference that is not a plain name (no leading ``-``, no spaces, only ``A-Za-z0-9._/:@+-``)."""
    arg = fileio.dumps_json(sorted(files))
    if image is not None:
        import re

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}", image):
            raise ConfigError(f"--image must be an image reference (name[:tag][@digest]), got {image!r}", exit_code=2)
        return [
            container_runtime,
            "run",
            "--rm",
            "--pull",
            "never",
            "--network",
            "none",
            "--entrypoint",
            "python3",
            image,
            "-c",
            PROBE,
            arg,
        ]
    import sys

    return [python or sys.executable, "-c", PROBE, arg]


def inspect(
    *,
    python: str | None = None,
    image: str | None = None,
    container_runtime: str = "docker",
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run :data:`PROBE` (:func:`probe_command`) and return its JSON: ``python`` (version),
    ``version`` (vLLM's, None when absent), ``root``, ``files`` ({file: sha256 or None}).
    Dsv41Error (exit 2) when it cannot run, fails or prints no JSON."""
    import subprocess

    files = sorted({f for c in shipped_contracts() for f in c["files"]})
    argv = probe_command(files, python=python, image=image, container_runtime=container_runtime)
    where = f"image {image}" if image is not None else f"interpreter {argv[0]}"
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except FileNotFoundError:
        raise Dsv41Error(f"cannot run {argv[0]}: not found", exit_code=2) from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Dsv41Error(f"cannot inspect the {where}: {exc}", exit_code=2) from None
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise Dsv41Error(f"cannot inspect the {where}: {tail}", exit_code=2)
    try:
        found = fileio.loads_json(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Dsv41Error(f"cannot inspect the {where}: it printed no JSON", exit_code=2) from None
    if not isinstance(found, dict):
        raise Dsv41Error(f"cannot inspect the {where}: it printed no JSON object", exit_code=2)
    return found
