"""Reading docs/architecture.md for tests/unit/test_architecture_map.py: its tables
(:func:`doc_table`, :func:`first_column`, :func:`ticked`), and the prose check: every name the
doc writes in backticks (a path or folder, a ``make`` target, an ``ansible-playbook`` argument, a
``dsv41`` command, a ``dsv41.`` module or a name defined in it, a role's entry point, a variable or
option of the code) must exist in the tree (:class:`TreeIndex`); :func:`prose_errors` names each
one that does not. ``EXTERNAL`` lists the few names from other projects, each with why."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = "docs/architecture.md"
#: The check's own files, whose example names (wrong on purpose) must not count as the tree's.
CHECK_FILES = ("tests/unit/test_architecture_map.py", "tests/unit/mapproseutil.py")


def doc_table(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells stripped, header and ``|---|`` rule dropped) of the first markdown
    table under ``## heading``. Raises AssertionError when the heading or its table is missing."""
    lines = text.splitlines()
    try:
        start = lines.index(f"## {heading}")
    except ValueError:
        raise AssertionError(f"{DOC}: no heading '## {heading}'") from None
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break  # the table ended
    assert len(rows) >= 2 and set(rows[1][0]) <= set("-: "), f"{DOC}: no table under '## {heading}'"
    return rows[2:]


def ticked(cell: str) -> list[str]:
    """The backticked names of a cell: "`a`, `b`" -> ["a", "b"]."""
    return re.findall(r"`([^`]+)`", cell)


def first_column(rows: list[list[str]]) -> list[str]:
    """Each row's name: its first cell's single backticked name (or the cell's text)."""
    return [(ticked(r[0]) or [r[0]])[0] for r in rows]


def tree_roles(root: Path) -> set[str]:
    return {p.name for p in (root / "roles").iterdir() if p.is_dir()}


#: Backticked names the doc may use that are not in this tree, each with the reason.
EXTERNAL = {
    "kubespray_defaults": "kubespray's defaults role, which role `dsv41` is modelled on",
    "_common": "prometheus-community's internal role, which `dsv41_service` is modelled on",
}


#: A token with one of these is a pattern, not a name (only its fixed part is checked).
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\b(?:NAME|DIR|FILE|URL|PLAYBOOK)\b")


FILE_EXT = (".py", ".yml", ".yaml", ".md", ".json", ".txt", ".cfg", ".sh", ".toml", ".cpp", ".j2")


ROLE_ENTRY = re.compile(r"`(\w+)`\s+`(?:tasks_from: |tasks: )?([\w/.]+)`((?:\s*/\s*`\w+`)*)")


class TreeIndex:
    """What the prose may name, read once from a checkout: tracked files, directories, the words of
    its code, roles and their entry points, make targets, playbooks and the `dsv41` command tree."""

    def __init__(self, root: Path, commands: dict[str, set[str]] | None = None):
        self.root = root
        files = tracked_files(root)
        self.files = set(files)
        self.dirs = {str(Path(f).parents[i]) for f in files for i in range(len(Path(f).parents) - 1)}
        self.basenames = {Path(f).name for f in files}
        own = {Path(f) for f in CHECK_FILES} if root == ROOT else set()
        code = [
            f
            for f in files
            if not f.startswith("docs/")
            and f != "README.md"
            and Path(f) not in own
            and (f.endswith(FILE_EXT) or Path(f).name == "Makefile")
        ]
        self.text = "\n".join((root / f).read_text(errors="replace") for f in code if (root / f).is_file())
        self.words = set(re.findall(r"[\w-]+", self.text))
        self.entry = {r: entry_points(root, r) for r in tree_roles(root)}
        self.targets = set(re.findall(r"^([a-z][\w-]*):", (root / "Makefile").read_text(), re.M))
        self.commands = command_tree() if commands is None else commands

    def path_exists(self, path: str) -> bool:
        """A path as the prose writes it: from the root, from python/ or python/dsv41/, inside a
        role, or a bare file name anywhere; a trailing '/' must be a directory; globs must match."""
        is_dir = path.endswith("/")
        p = path.rstrip("/")
        if "*" in p:
            return any(True for _ in self.root.glob(p))
        if "/" not in p and not is_dir:  # a file of the tree, or one the code writes
            return p in self.basenames or p in self.dirs or p in self.text
        bases = ["", "python/", "python/dsv41/", *(f"roles/{r}/" for r in self.entry)]
        pool = self.dirs if is_dir else self.files | self.dirs
        return any(b + p in pool for b in bases)


def tracked_files(root: Path) -> list[str]:
    """The checkout's files (tracked and new, ignored ones left out), relative to ``root``."""
    import subprocess

    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode == 0 and out.stdout.strip():
        return [f for f in out.stdout.splitlines() if (root / f).exists()]
    skip = {".git", ".venv", "__pycache__", "build", ".tox"}
    return [
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not skip & set(p.relative_to(root).parts)
    ]


def entry_points(root: Path, role: str) -> set[str]:
    """The entry points a role declares in meta/argument_specs.yml."""
    spec = root / "roles" / role / "meta" / "argument_specs.yml"
    if not spec.is_file():
        return set()
    return set((yaml.safe_load(spec.read_text()) or {}).get("argument_specs", {}))


def command_tree() -> dict[str, set[str]]:
    """``{command: its subcommands}`` of `dsv41`, two levels (a plain command has none)."""
    import click
    import typer

    from dsv41 import cli

    top = typer.main.get_command(cli.app)
    ctx = click.Context(top)
    out = {}
    for name in top.list_commands(ctx):
        cmd = top.get_command(ctx, name)
        out[name] = set(cmd.list_commands(click.Context(cmd))) if hasattr(cmd, "list_commands") else set()
    return out


def command_error(words: list[str], tree: TreeIndex) -> str | None:
    """Why ``dsv41 WORDS...`` is not a command of the tree (None when it is)."""
    words = [w for w in words if not w.startswith("-")][:2]
    if not words:
        return None
    if words[0] not in tree.commands:
        return f"no command 'dsv41 {words[0]}'"
    if (
        len(words) > 1
        and re.fullmatch(r"[a-z][\w-]*", words[1])
        and tree.commands[words[0]]
        and words[1] not in tree.commands[words[0]]
    ):
        return f"no command 'dsv41 {words[0]} {words[1]}'"
    return None


def module_error(dotted: str, tree: TreeIndex) -> str | None:
    """Why the dotted name ``dsv41.a.b[.attr]`` names no module (or no name defined in it)."""
    parts = dotted.split(".")
    if parts[:2] == ["dsv41", "offload"]:  # the collection's content
        name = parts[2] if len(parts) > 2 else ""
        found = f"playbooks/{name}.yml" in tree.files or any(
            f.startswith("plugins/") and Path(f).stem == name for f in tree.files
        )
        return None if found else f"the collection has no playbook or plugin '{name}'"
    for n in range(len(parts), 0, -1):
        base = "python/" + "/".join(parts[:n])
        mod = next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in tree.files), None)
        if mod is None and n == len(parts) and any(f.startswith(base + ".") for f in tree.files):
            return None  # a native module (its source under that name)
        if mod is None:
            continue
        rest = parts[n:]
        if not rest:
            return None
        src = (tree.root / mod).read_text()
        if len(rest) == 1 and re.search(rf"^\s*(?:def|class|async def)\s+{rest[0]}\b|^{rest[0]}\s*[:=]", src, re.M):
            return None
        return f"{mod} defines no '{'.'.join(rest)}'"
    return f"no module {dotted}"


def token_errors(token: str, tree: TreeIndex) -> list[str]:
    """Why one backticked token of the prose names nothing in the tree (empty when it does)."""
    t = token.strip()
    if not t or t in EXTERNAL or t.startswith(("ansible.builtin.", "dsv41: error:")):
        return []
    fixed = PLACEHOLDER.split(t)[0].strip()
    words = t.split()
    if words[0] == "make":
        return [] if len(words) == 1 or words[1] in tree.targets else [f"no make target '{words[1]}'"]
    if words[0] == "ansible-playbook":
        name = words[1] if len(words) > 1 else ""
        ok = PLACEHOLDER.search(name) or name.startswith("dsv41.") or name in tree.files
        return [] if ok else [f"no playbook '{name}'"]
    if words[0] == "dsv41" and len(words) > 1:
        err = command_error(PLACEHOLDER.split(t)[0].split()[1:], tree)
        return [err] if err else []
    if len(words) > 1 and words[0] in tree.commands and re.fullmatch(r"[a-z][\w-]*", words[1]):
        err = command_error(words, tree)  # a command written without the `dsv41` prefix
        return [err] if err else []
    if t.startswith("-"):
        opt = re.split(r"[ =]", t.lstrip("-e ").strip() if t.startswith("-e ") else t)[0]
        return [] if opt in tree.text else [f"no option or variable '{opt}' in the code"]
    if t.startswith("/"):
        return [] if PLACEHOLDER.split(t)[0] in tree.text else [f"'{t}' appears nowhere in the code"]
    head = re.split(r"[ (]", fixed)[0] if fixed else ""
    if head.startswith("dsv41.") or (
        head.split(".")[0]
        in {f.split("/")[2] for f in tree.files if f.startswith("python/dsv41/") and f.count("/") > 2}
        and "." in head
        and not head.endswith(FILE_EXT)
    ):
        err = module_error(head if head.startswith("dsv41.") else "dsv41." + head, tree)
        return [err] if err else []
    if "/" in head or head.endswith(FILE_EXT):
        if PLACEHOLDER.search(t.split()[0]):
            return []
        paths = brace_expand(head)
        return [f"no path {p}" for p in paths if not tree.path_exists(p)]
    if re.fullmatch(r"_[a-z]\w*", t):  # a suffix (`<role>_install`, `_configure`): some name ends so
        return [] if any(w.endswith(t) for w in tree.words) else [f"no name of the code ends in '{t}'"]
    if ":" in t:  # `key: value`: the key is a name of the code
        key = t.split(":")[0].strip()
        return [] if key in tree.words else [f"'{key}' appears nowhere in the code"]
    names = (
        [
            w
            for w in re.findall(r"[A-Za-z_][\w]*", fixed)
            if "_" in w.strip("_") or re.search(r"[a-z][A-Z]|^[A-Z]{2,}", w)
        ]
        if " " in fixed
        else ([fixed] if re.fullmatch(r"[A-Za-z_]\w*", fixed) else [])
    )
    return [
        f"'{w}' appears nowhere in the code"
        for w in names
        if w not in tree.words and w not in EXTERNAL and w not in tree.entry
    ]


def brace_expand(path: str) -> list[str]:
    """``a/{b,c}/`` -> ``["a/b/", "a/c/"]`` (one brace group)."""
    m = re.search(r"\{([^}]*)\}", path)
    return [path[: m.start()] + alt + path[m.end() :] for alt in m.group(1).split(",")] if m else [path]


def role_entry_errors(text: str, tree: TreeIndex) -> list[str]:
    """Entry points the prose gives a role that its argument_specs does not declare: "role `r`
    `e`", "`r` `tasks_from: e`", "`r` `a`/`b`", and in a "## Roles" row, "entry point(s) `e`..."
    and "`tasks_from: e`" of the row's own role."""
    errors = []
    for m in ROLE_ENTRY.finditer(text):
        role, first, more = m.group(1), m.group(2), m.group(3)
        if role not in tree.entry or first in tree.entry:
            continue
        for name in [first, *re.findall(r"`(\w+)`", more)]:
            name = re.sub(r"^tasks/|\.yml$", "", name)
            if name not in tree.entry[role]:
                errors.append(f"role {role} has no entry point '{name}'")
    for row in doc_table(text, "Roles"):
        role = first_column([row])[0]
        if role not in tree.entry:
            continue
        cell = " ".join(row[1:])
        named = re.findall(r"`tasks_from: (\w+)`", cell)
        for span in re.findall(r"entry points? ((?:`\w+`(?:, |: [^`;)]*)?)+)", cell):
            named += re.findall(r"`(\w+)`", span)
        errors += [f"role {role} has no entry point '{n}'" for n in dict.fromkeys(named) if n not in tree.entry[role]]
    return errors


def prose_errors(text: str, tree: TreeIndex) -> list[str]:
    """Every backticked name of the doc (outside code blocks) that the tree does not have, as
    lines naming the token; plus role entry points the prose names that a role does not declare."""
    body = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    layout = re.search(r"^```\n(.*?)^```", text, re.M | re.S)
    errors = []
    for token in dict.fromkeys(re.findall(r"`([^`\n]+)`", body)):
        errors += [f"{DOC}: `{token}`: {e}" for e in token_errors(token, tree)]
    if layout:  # the layout block's first column: folders and files at the root
        for line in layout.group(1).splitlines():
            for name in re.findall(r"^(\S+/|\S+\.\w+)(?=\s)", line) + re.findall(r"^\S+\s+(meta/)", line):
                if not tree.path_exists(name):
                    errors.append(f"{DOC} layout: no path {name}")
            for path in re.findall(r"\b((?:tests|tools|plugins|roles|python|inventories)/[\w{},./*-]*[\w/}])", line):
                errors += [f"{DOC} layout: no path {p}" for p in brace_expand(path) if not tree.path_exists(p)]
    return errors + [f"{DOC}: {e}" for e in role_entry_errors(text, tree)]
