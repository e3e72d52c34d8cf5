#!/usr/bin/env python3
"""Record what the dsv41 vLLM overlay relies on in one vLLM wheel: ``vllm_contract.json``.

    python tools/vllm_contract.py --wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl \
        [--wheel vllm-0.33.0-...aarch64.whl] --out python/dsv41/overlay/vllm_contract.json

The wheel is read as a zip file (nothing is imported or installed). The contract holds: the vLLM
version, each wheel's sha256 by arch, the sha256 and size of every file the overlay patches or
relies on, the signatures of the patched symbols (from the source, with ``ast``), the facts the
overlay depends on (checked here: the tool fails when one no longer holds), the plugin entry
point, the env names, the compilation settings the overlay requires and the per-rank Engram
ranges of DeepSeek-V4.1-Flash at TP 1, 2 and 4 (from ``dsv41.engram.layout``, which follows
vLLM's ``ParallelEngramEmbedding`` column split; the GPU qualification checks the two agree).

Re-pinning vLLM = re-run this tool on the new wheel and review the diff of the JSON; the overlay
refuses (required mode) or stays inert when the installed vLLM differs from the contract.
Exit codes: 0 written, 1 bad input or a fact that no longer holds (one line on stderr).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

from dsv41.engram.layout import EngramLayout  # noqa: E402
from dsv41.errors import Dsv41Error  # noqa: E402
from dsv41.overlay import contract as C  # noqa: E402

FLASH_CONFIG = REPO / "python" / "dsv41" / "data" / "dsv41_flash_engram_config.json"

#: Symbols whose signatures are recorded, per file (class.method or function or constant).
SYMBOLS: dict[str, list[str]] = {
    C.ENGRAM_FILE: [
        "ParallelEngramEmbedding.__init__",
        "ParallelEngramEmbedding._allocate_weights",
        "ParallelEngramEmbedding.lookup",
        "ParallelEngramEmbedding._weight_loader",
        "_engram_lookup_kernel",
        "Engram._create_embedding",
        "Engram._init_staging",
        "Engram.prepare_embeddings",
        "Engram._start_prefetch",
        "Engram._finish_prefetch",
        "Engram._ready_rows",
        "EngramBatch.create",
    ],
    C.SPEC_INIT_FILE: ["init_speculator"],
    C.SPECULATOR_FILE: ["BaseSpeculator.init_cudagraph_manager", "BaseSpeculator.capture", "BaseSpeculator.propose"],
    C.MODEL_RUNNER_FILE: [],
    C.BREAKABLE_FILE: [
        "eager_break_during_capture",
        "BreakableCUDAGraphCapture.is_active",
        "BreakableCUDAGraphCapture.add_eager",
        "BreakableCUDAGraphCapture._begin_segment",
    ],
    C.PLUGINS_FILE: ["load_general_plugins", "load_plugins_by_group"],
    C.ENGRAM_CONFIG_FILE: [],
}


class ContractError(Dsv41Error):
    """A wheel that does not hold what the overlay relies on."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _find(tree: ast.Module, dotted: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in dotted.split("."):
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child
            elif isinstance(child, ast.Assign) and any(isinstance(t, ast.Name) and t.id == part for t in child.targets):
                found = child
        if found is None:
            return None
        node = found
    return node


def _signature(node: ast.AST) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
        decos = "".join(f"@{ast.unparse(d).split('(')[0]} " for d in node.decorator_list)
        return f"{decos}({ast.unparse(node.args)}){ret}"
    if isinstance(node, ast.Assign):
        return f"= {ast.unparse(node.value)}"
    return f"class {getattr(node, 'name', '?')}"


def _facts(sources: dict[str, str], trees: dict[str, ast.Module]) -> dict[str, object]:
    """Facts of the wheel the overlay builds on; ContractError when one does not hold."""
    eng = sources[C.ENGRAM_FILE]
    facts: dict[str, object] = {}

    def need(name: str, ok: bool, value: object = True) -> None:
        if not ok:
            raise ContractError(f"vLLM wheel: fact {name!r} does not hold; review the overlay before re-pinning")
        facts[name] = value

    start = _find(trees[C.ENGRAM_FILE], "Engram._start_prefetch")
    need(
        "Engram._start_prefetch is decorated eager_break_during_capture",
        start is not None and any(ast.unparse(d) == "eager_break_during_capture" for d in start.decorator_list),
    )
    fin = _find(trees[C.ENGRAM_FILE], "Engram._finish_prefetch")
    need(
        "Engram._finish_prefetch is decorated eager_break_during_capture (re-runs at every PIECEWISE replay)",
        fin is not None and any(ast.unparse(d) == "eager_break_during_capture" for d in fin.decorator_list),
    )
    need(
        "_start_prefetch orders the prefetch stream after the current stream, then records _prefetch_done "
        "right after lookup returns (the overlay's worker rows come later: _finish_prefetch joins them)",
        "stream.wait_stream(current)" in eng
        and "self.embed_tokens.lookup(hash_ids, rows, background=True)\n        assert self._prefetch_done is not None"
        "\n        self._prefetch_done.record(stream)"
        in eng,
    )
    need(
        "_ready_rows calls _finish_prefetch(_prefetch_done) before it reads staged_rows",
        "self._finish_prefetch(self._prefetch_done)" in eng,
    )
    brk = sources[C.BREAKABLE_FILE]
    need(
        "an eager break ends the capture segment before the function runs and begins the next after it",
        "self._end_segment()\n        result = fn()\n        self.segments.append(fn)" in brk
        and "self._begin_segment()\n        return result" in brk,
    )
    need(
        "breakable capture segments use CUDAGraph.capture_begin's default (global) capture error mode; "
        "the capture context is thread-local (BreakableCUDAGraphCapture.is_active)",
        "g.capture_begin()" in brk and "capture_error_mode" not in brk and "_tls = threading.local()" in brk,
    )
    need(
        "lookup runs on the prefetch stream with background=True",
        "self.embed_tokens.lookup(hash_ids, rows, background=True)" in eng,
    )
    need(
        "kernel masks ids outside [vocab_start, vocab_end) and padded heads to zero",
        "owned &= (index >= vocab_start) & (index < vocab_end)" in eng
        and "owned = valid & (head < TOTAL_HEADS)" in eng,
    )
    need(
        "kernel BF16 mode: scale byte shifted into the fp32 exponent (0 -> 0.0, 255 -> +inf)",
        "(scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)" in eng,
    )
    need("kernel SORTED mode takes local row ids and output rows", "if SORTED:" in eng and "sorted_dst" in eng)
    need(
        "rank ranges: head_start = rank * ceil(n_hash_cols / shards)",
        "self.head_start = head_rank * self.part_n_hash_cols" in eng
        and "self.part_n_hash_cols = triton.cdiv(self.n_hash_cols, num_shards)" in eng,
    )
    need(
        "staged_rows is bf16 [max_tokens, part_n_hash_cols, head_dim]",
        re.search(
            r"self\.staged_rows = torch\.empty\(\s*max_tokens \* self\.embed_tokens\.dp_size,\s*"
            r"self\.embed_tokens\.part_n_hash_cols,\s*head_dim,\s*dtype=torch\.bfloat16",
            eng,
        )
        is not None,
    )
    m = re.search(r'DEFAULT_PLUGINS_GROUP = "([^"]+)"', sources[C.PLUGINS_FILE])
    need("general plugin entry-point group", m is not None, m.group(1) if m else None)
    need("VLLM_PLUGINS is an allowlist", "plugin.name in allowed_plugins" in sources[C.PLUGINS_FILE])
    need(
        "a general plugin's register() runs outside the loader's try (its exception stops the process)",
        "for func in plugins.values():\n        func()" in sources[C.PLUGINS_FILE],
    )
    need("EngramConfig.cpu_offload defaults to True", "cpu_offload: bool = True" in sources[C.ENGRAM_CONFIG_FILE])
    need(
        "FULL runtime mode runs an eager-break function inside the graph (captured once)",
        "if mode == CUDAGraphMode.FULL:\n                return fn(*args, **kwargs)" in sources[C.BREAKABLE_FILE],
    )
    need(
        "model runner binds init_speculator by name",
        "from vllm.v1.worker.gpu.spec_decode import init_speculator" in sources[C.MODEL_RUNNER_FILE],
    )
    need(
        "init_speculator(vllm_config, device, req_states)",
        "def init_speculator(\n    vllm_config: VllmConfig,\n    device: torch.device,\n    req_states"
        in sources[C.SPEC_INIT_FILE],
    )
    need("dspark speculator exists", 'speculative_config.method == "dspark"' in sources[C.SPEC_INIT_FILE])
    return facts


def build(wheels: list[Path], flash_config: Path = FLASH_CONFIG) -> dict:
    """The contract dict for ``wheels`` (one per arch, same vLLM version and Python files)."""
    if not wheels:
        raise ContractError("give at least one --wheel")
    version = None
    per_arch: dict[str, dict] = {}
    files: dict[str, dict] | None = None
    sources: dict[str, str] = {}
    for w in wheels:
        if not w.is_file():
            raise ContractError(f"{w}: no such wheel file")
        m = re.match(r"vllm-([^-]+)-.*-(manylinux[^.]*?_(x86_64|aarch64))\.whl$", w.name)
        if not m:
            raise ContractError(f"{w.name}: not a vllm manylinux wheel name")
        if version not in (None, m.group(1)):
            raise ContractError(f"{w.name}: version {m.group(1)} differs from {version}")
        version = m.group(1)
        per_arch[m.group(3)] = {"file": w.name, "sha256": _sha256_file(w)}
        try:
            zf = zipfile.ZipFile(w)
        except zipfile.BadZipFile:
            raise ContractError(f"{w}: not a zip file") from None
        with zf:
            mine = {}
            for path in C.CHECKED_FILES:
                try:
                    data = zf.read(path)
                except KeyError:
                    raise ContractError(f"{w.name}: has no {path}") from None
                mine[path] = {
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "role": "patched" if path in C.PATCHED_FILES else "relied on",
                }
                sources[path] = data.decode()
        if files is not None and files != mine:
            raise ContractError(f"{w.name}: its Python files differ from the other wheel's")
        files = mine
    assert files is not None and version is not None
    trees = {p: ast.parse(s) for p, s in sources.items()}
    symbols: dict[str, dict[str, str]] = {}
    for path, names in SYMBOLS.items():
        for name in names:
            node = _find(trees[path], name)
            if node is None:
                raise ContractError(f"vLLM wheel: {path} has no {name}")
            symbols.setdefault(path, {})[name] = _signature(node)
    facts = _facts(sources, trees)
    layout = EngramLayout.from_config(str(flash_config))
    ranges = {}
    for tp in C.CONTRACT_TPS:
        ranks = []
        for rank in range(tp):
            c0, c1 = layout.columns_for_rank(tp, rank)
            part = -(-layout.n_columns // tp)
            ranks.append(
                {
                    "rank": rank,
                    "head_start": c0,
                    "part_n_hash_cols": part,
                    "columns": [c0, c1],
                    "layers": [
                        {
                            "layer_id": lid,
                            "vocab_start_idx": layout.row_range(li, tp, rank)[0],
                            "vocab_end_idx": layout.row_range(li, tp, rank)[1],
                        }
                        for li, lid in enumerate(layout.layer_ids)
                    ],
                }
            )
        ranges[str(tp)] = ranks
    return {
        "format": C.FORMAT,
        "version": C.VERSION,
        "vllm_version": version,
        "wheels": per_arch,
        "files": files,
        "symbols": symbols,
        "facts": facts,
        "entry_point": {
            "group": facts["general plugin entry-point group"],
            "name": C.PLUGIN_NAME,
            "value": C.PLUGIN_VALUE,
        },
        "env": {"vllm": list(C.VLLM_ENV), "dsv41": list(C.DSV41_ENV), "refused": dict(C.OLD_ENV)},
        "compilation": C.COMPILATION,
        "ranges": {
            "model": "DeepSeek-V4.1-Flash (dsv41/data/dsv41_flash_engram_config.json)",
            "n_hash_cols": layout.n_columns,
            "head_dim": layout.head_dim,
            "layer_rows": dict(zip(map(str, layout.layer_ids), layout.rows, strict=False)),
            "tp": ranges,
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", action="append", type=Path, required=True, help="vLLM wheel (once per arch)")
    ap.add_argument("--out", type=Path, required=True, help="contract JSON to write")
    ap.add_argument("--flash-config", type=Path, default=FLASH_CONFIG, help="Engram config for the rank ranges")
    args = ap.parse_args(argv)
    try:
        contract = build(args.wheel, args.flash_config)
        text = json.dumps(contract, indent=1, sort_keys=True) + "\n"
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    except (Dsv41Error, OSError) as exc:
        print(f"vllm_contract: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"vllm_contract: vLLM {contract['vllm_version']}: {len(contract['files'])} files, "
        f"{sum(len(v) for v in contract['symbols'].values())} symbols -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
