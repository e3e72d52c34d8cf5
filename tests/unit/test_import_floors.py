"""Import structure of ``python/dsv41``: no import circle, and no import that runs up the floors.

Floors, bottom to top (a module may import its own floor and the floors below, never above):

0. ground: ``errors``, ``envs``, ``fileio`` (every file read and write), ``httpd`` (limits on
   slow and idle HTTP clients), ``tokenizer``, ``service_control`` (the systemctl command lines
   of the drills and status), the ``dsv41`` package itself (version);
1. ``transport`` (row wire protocol, TCP/NIXL);
2. ``version`` (reports the install, including the native transport extension);
3. ``engram`` (tables, manifest, row sources, table server);
4. ``engine`` (the lab target; ``engine.spec_decode`` is the hook the drafter implements);
5. ``harness`` (greedy references, admission, measurement clients), ``monitoring`` (rules,
   dashboard, operations exporter, alerts reader), ``promotion`` (promotion
   packages and their journal; docs/architecture.md puts both on floor 5);
6. ``drafter`` (speculators, worker, proxy; trains against the engine);
7. ``entrypoints``, ``overlay`` (composition roots: the only code that knows engine and drafter;
   ``overlay`` composes them inside vLLM);
8. ``cli`` (the ``dsv41`` command).

Every import counts, including the lazy ones inside functions: a lazy import hides a cost, not a
dependency. A new subpackage must be given a floor here (and in docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "python" / "dsv41"

FLOORS: list[tuple[str, ...]] = [
    ("errors", "envs", "fileio", "httpd", "tokenizer", "service_control", "authz", "names", "filelock", "__init__"),
    ("transport",),
    ("version", "wheelhouse", "serve_image"),
    ("engram",),
    ("engine",),
    ("harness", "promotion", "monitoring"),
    ("drafter",),
    ("entrypoints", "overlay"),
    ("cli",),
]

# Module pairs allowed to import each other. Each entry names the change that removes it.
# Module pairs allowed to import each other (none: keep it that way).
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module an import of ``name`` loads (longest known prefix), None outside dsv41."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _extension(package: str, name: str, mods: dict[str, Path]) -> bool:
    """True when ``from package import name`` loads a compiled submodule (``_fastrow.cpp`` built
    to ``_fastrow.*.so``), not a name of the package's ``__init__``."""
    path = mods.get(package)
    if path is None or path.name != "__init__.py":
        return False
    return any(p.name.split(".")[0] == name and p.suffix != ".py" for p in path.parent.iterdir())


def _imports(mod: str, path: Path, mods: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else
                     "" if _extension(base, a.name, mods) else base for a in node.names]
        else:
            continue
        for n in names:
            r = _resolve(n, mods)
            if r is not None and r != mod:
                out.add(r)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _floor(mod: str) -> int:
    parts = mod.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"{mod}: subpackage {top!r} has no floor; add it to FLOORS in {Path(__file__).name}")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan 1972), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_subpackage_has_a_floor() -> None:
    for mod in _graph():
        _floor(mod)


def test_no_upward_import() -> None:
    graph = _graph()
    up = [f"{a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})"
          for a, deps in sorted(graph.items()) for b in sorted(deps) if _floor(b) > _floor(a)]
    assert up == [], "imports running up the floors:\n" + "\n".join(up)


def test_no_import_circle() -> None:
    bad = [c for c in _cycles(_graph()) if frozenset(c) not in KNOWN_CIRCLES]
    assert bad == [], f"import circles: {bad}"


def test_checker_sees_circles_and_known_ones_are_still_real() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    # a known exception that no longer exists must be dropped from KNOWN_CIRCLES
    real = {frozenset(c) for c in _cycles(_graph())}
    assert KNOWN_CIRCLES <= real, f"stale KNOWN_CIRCLES entries: {KNOWN_CIRCLES - real}"


def test_engine_and_drafter_meet_only_in_entrypoints() -> None:
    graph = _graph()
    for mod, deps in graph.items():
        if mod.startswith("dsv41.engine"):
            assert not any(d.startswith("dsv41.drafter") for d in deps), mod
    users = {m for m, deps in graph.items() if "dsv41.drafter.factory" in deps}
    roots = ("dsv41.entrypoints", "dsv41.overlay", "dsv41.drafter")
    assert users and all(m.startswith(roots) for m in users), users
