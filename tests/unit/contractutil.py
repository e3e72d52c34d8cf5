"""Fake vLLM trees for the overlay contract tests (dsv41 overlay contract, the deploy's image check)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dsv41.overlay import contract as C


def fake_tree(
    root: Path, version: str | None, contract: dict, change: tuple[str, ...] = (), drop: tuple[str, ...] = ()
) -> None:
    """A vLLM installed under ``root``: the package, a dist-info naming ``version`` (none: no
    metadata) and every contract file with its contract bytes' stand-in; ``change`` files get other
    bytes, ``drop`` files are missing."""
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / "vllm" / "__init__.py").write_text("")
    if version is not None:
        d = root / f"vllm-{version}.dist-info"
        d.mkdir(exist_ok=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    for rel in contract["files"]:
        if rel in drop:
            continue
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(("# changed\n" if rel in change else "# stand-in\n") + rel + "\n")


def contract_of(root: Path) -> dict:
    """The shipped contract with its digests replaced by those of the tree's stand-in files."""
    c = json.loads(json.dumps(C.load()))
    for rel in c["files"]:
        c["files"][rel]["sha256"] = hashlib.sha256(f"# stand-in\n{rel}\n".encode()).hexdigest()
    return c
