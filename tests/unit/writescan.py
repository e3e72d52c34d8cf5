"""Finding the file writes in Python source (tests/unit/test_fileio_sites.py's class test: every file
the package writes goes through ``dsv41.fileio``). A write is a call that creates or changes a
file: ``open`` with a mode holding ``w``/``a``/``x``/``+``, ``os.open`` with a write flag,
``Path.write_text``/``write_bytes``/``touch``, ``json.dump`` (and pickle, marshal, yaml with a
stream, numpy, torch), ``shutil.copy*``/``move``, ``savefig``, ``tofile``, ``save_file``, an
archive's ``extract``/``extractall``, ``tempfile.mkstemp``/``NamedTemporaryFile``."""

from __future__ import annotations

import ast

WRITE_MODE_CHARS = set("wax+")
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
COPIERS = {"copy", "copy2", "copyfile", "copytree", "move"}
DUMPERS = {
    ("json", "dump"),
    ("pickle", "dump"),
    ("marshal", "dump"),
    ("yaml", "dump"),
    ("yaml", "safe_dump"),
    ("np", "save"),
    ("np", "savez"),
    ("np", "savetxt"),
    ("numpy", "save"),
    ("torch", "save"),
}
OPEN_MODULES = {"gzip", "bz2", "lzma", "tarfile", "codecs", "io"}


def _const(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _write_kind(node: ast.Call, assigned: dict[str, list[ast.AST]]) -> str | None:
    """The kind of file write ``node`` is (``open``, ``os.open``, ``write_text``, ``write_bytes``,
    ``touch``, ``json.dump``..., ``shutil.copy``..., ``savefig``, ``tofile``, ``save_file``,
    ``extract``, ``tempfile``), or None when it writes no file. A mode or flags that are not
    literals count as a write (``assigned``: the values assigned to each name in the function)."""
    f = node.func
    owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    kw = {k.arg: k.value for k in node.keywords}
    if name == "open" and owner == "os":
        flags = node.args[1] if len(node.args) > 1 else kw.get("flags")
        seen = [
            n for x in ([flags] + assigned.get(getattr(flags, "id", None), [])) if x is not None for n in ast.walk(x)
        ]
        names = {getattr(n, "attr", None) or getattr(n, "id", None) for n in seen}
        return "os.open" if names & WRITE_FLAGS or not names - {None} else None
    if name in ("open", "fdopen", "GzipFile"):
        if owner in OPEN_MODULES and "fileobj" in kw and not node.args:
            return None  # an archive in memory or in a file object someone else opened
        at = 0 if isinstance(f, ast.Attribute) and owner not in OPEN_MODULES | {"os"} else 1  # Path.open(mode)
        mode = node.args[at] if len(node.args) > at else kw.get("mode")
        if mode is None:
            return None  # read ("r" is every opener's default)
        text = _const(mode)
        return "open" if text is None or set(text) & WRITE_MODE_CHARS else None
    if name in ("write_text", "write_bytes", "touch", "savefig", "tofile", "save_file"):
        return name
    if name in ("extractall", "extract") and owner not in ("re",):
        return "extract"
    if owner == "shutil" and name in COPIERS:
        return f"shutil.{name}"
    if (owner, name) in DUMPERS and (owner != "yaml" or len(node.args) > 1 or "stream" in kw):
        return f"{owner}.{name}"
    if owner == "tempfile" and name in ("mkstemp", "NamedTemporaryFile"):
        return "tempfile"
    return None


def write_calls(source: str, module: str) -> list[tuple[str, str, str, int]]:
    """Every file write in ``source`` (a module's text) as ``(module, qualified function name,
    kind, line)``; ``<module>`` for module-level code. Not counted: calls inside a lambda or a
    local function handed to ``fileio.*`` (they fill the file fileio opened), and calls given the
    path of a ``with fileio.atomic_path(...) as tmp`` block (a third-party writer's temporary file)."""
    tree = ast.parse(source)
    through = set()
    for c in ast.walk(tree):
        if (
            isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute)
            and getattr(c.func.value, "id", None) == "fileio"
        ):
            handed = {a.id for a in c.args if isinstance(a, ast.Name)}
            through |= {id(n) for a in c.args if isinstance(a, ast.Lambda) for n in ast.walk(a)}
            through |= {
                id(n)
                for d in ast.walk(tree)
                if isinstance(d, ast.FunctionDef) and d.name in handed
                for n in ast.walk(d)
            }
    found = []

    def visit(node, qual: str, assigned: dict, staged: set) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                q = child.name if qual == "<module>" else f"{qual}.{child.name}"
                a = {}
                for n in ast.walk(child):
                    if isinstance(n, ast.Assign):
                        for t in n.targets:
                            if isinstance(t, ast.Name):
                                a.setdefault(t.id, []).append(n.value)
                visit(child, q, a, set())
                continue
            if isinstance(child, ast.With):
                staged = staged | {
                    i.optional_vars.id
                    for i in child.items
                    if isinstance(i.optional_vars, ast.Name)
                    and isinstance(i.context_expr, ast.Call)
                    and isinstance(i.context_expr.func, ast.Attribute)
                    and i.context_expr.func.attr == "atomic_path"
                }
            if isinstance(child, ast.Call) and id(child) not in through:
                kind = _write_kind(child, assigned)
                uses = {
                    n.id
                    for a in [*child.args, *(k.value for k in child.keywords)]
                    for n in ast.walk(a)
                    if isinstance(n, ast.Name)
                }
                if kind and not uses & staged:
                    found.append((module, qual, kind, child.lineno))
            visit(child, qual, assigned, staged)

    visit(tree, "<module>", {}, set())
    return found
