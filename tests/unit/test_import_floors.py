"""Import structure of ``python/dsv41``: no import circle, and no import that runs up the floors.

Floors, bottom to top (a module may import its own floor and the floors below, never above):

0. ground: ``errors``, ``envs`` (and its table ``env_vars``), ``fileio`` (every file read and write), ``codec`` (strict JSON and
   YAML text), ``httpd`` (limits on
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

The C++ is held to the same floors: each native extension (setup.py's ``NATIVE``:
``dsv41.transport._fastrow`` on floor 1, ``dsv41.overlay._core`` on floor 7) is built from a
translation unit in its own package's folder, and an ``#include "dsv41/..."`` may name a header of
its own floor or below (the overlay's core includes the transport's ``wire.h`` and ``client.h``,
never the other way). Every C++ file under ``python/dsv41`` belongs to an extension, whose file list
is exactly what its translation unit includes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "python" / "dsv41"
CPP_SUFFIXES = (".cpp", ".h")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

FLOORS: list[tuple[str, ...]] = [
    (
        "errors",
        "envs",
        "env_vars",
        "fileio",
        "codec",
        "httpd",
        "tokenizer",
        "service_control",
        "authz",
        "names",
        "filelock",
        "__init__",
    ),
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
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in mods else "" if _extension(base, a.name, mods) else base
                for a in node.names
            ]
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
    up = [
        f"{a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})"
        for a, deps in sorted(graph.items())
        for b in sorted(deps)
        if _floor(b) > _floor(a)
    ]
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


# ---- the native extensions ------------------------------------------------------------------


def _native(root: Path = ROOT) -> dict[str, list[str]]:
    """setup.py's ``NATIVE`` (extension module -> its files, relative to the root), read as a
    literal: setup.py is never imported."""
    tree = ast.parse((root / "setup.py").read_text())
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "NATIVE":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py: no NATIVE")


def _cpp_module(path: Path) -> str:
    """The dotted name a C++ file is counted under (``python/dsv41/overlay/core_slot.h`` ->
    ``dsv41.overlay.core_slot``): its floor is its package's."""
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts)


def _includes(path: Path) -> list[Path]:
    """The project headers a C++ file includes (``#include "dsv41/..."``, from ``python/``)."""
    return [PKG.parent / inc for inc in INCLUDE.findall(path.read_text())]


def test_every_native_extension_lives_in_its_package_on_a_floor() -> None:
    native = _native()
    assert {"dsv41.transport._fastrow", "dsv41.overlay._core"} <= set(native)
    for name, files in native.items():
        unit = Path(*name.split(".")).with_suffix(".cpp")
        assert files[0] == f"python/{unit.as_posix()}", f"{name}: its translation unit must be python/{unit}"
        _floor(name)


def test_every_cpp_file_belongs_to_an_extension_that_lists_exactly_its_includes() -> None:
    native = _native()
    on_disk = {p.relative_to(ROOT).as_posix() for p in PKG.rglob("*") if p.suffix in CPP_SUFFIXES}
    listed = {f for files in native.values() for f in files}
    assert on_disk == listed, (
        f"C++ files not in setup.py's NATIVE: {sorted(on_disk - listed)}; listed but absent: {sorted(listed - on_disk)}"
    )
    for name, files in native.items():
        seen, todo = set(), [ROOT / files[0]]
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            for inc in _includes(p):
                assert inc.is_file(), (
                    f"{p.relative_to(ROOT)} includes {inc.relative_to(PKG.parent)}, which does not exist"
                )
                todo.append(inc)
        assert sorted(q.relative_to(ROOT).as_posix() for q in seen) == sorted(files), (
            f"{name}: setup.py's NATIVE must list exactly the files its translation unit includes"
        )


def test_no_cpp_include_runs_up_the_floors() -> None:
    up = []
    for p in sorted(q for q in PKG.rglob("*") if q.suffix in CPP_SUFFIXES):
        a = _cpp_module(p)
        for inc in _includes(p):
            b = _cpp_module(inc)
            if _floor(b) > _floor(a):
                up.append(f"{a} (floor {_floor(a)}) includes {b} (floor {_floor(b)})")
    assert up == [], "includes running up the floors:\n" + "\n".join(up)
    assert any(_cpp_module(i) == "dsv41.transport.client" for i in _includes(PKG / "overlay" / "core_engram.h"))
