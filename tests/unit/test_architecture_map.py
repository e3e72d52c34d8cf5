"""docs/architecture.md is the map of the tree, and this test keeps it true: the first column of
the table under each of its headings "Roles", "Modules", "Playbooks", "Command-line groups",
"Import floors" and "Native extensions" names exactly the roles (``roles/*/``), the modules
(``library/*.py``), the playbooks (at the root and in ``playbooks/``: YAML files whose every item
is a play or an ``import_playbook``), the ``dsv41 --help`` commands (the click command tree of
``dsv41.cli``), the floors of ``FLOORS`` in tests/unit/test_import_floors.py and the C++
extensions of ``NATIVE`` in setup.py with their files (both read with ``ast``, not imported: a
test file or setup.py is never imported). The playbooks' "run by" column is checked against who
does run them. galaxy.yml and the changelog name every module. Each failure names the missing
and the extra rows. Granularity: roles, modules, playbooks, command groups and subpackages, never
single Python files or task files, so moving code inside them does not touch the map.

The prose is held to the tree too (the check: tests/unit/mapproseutil.py): every name it writes in
backticks (a path or folder, a ``make`` target, an ``ansible-playbook`` argument, a ``dsv41``
command, a ``dsv41.`` module or a name defined in it, a role's entry point, a variable or option
of the code) and every path of the layout block must exist; ``EXTERNAL`` lists the few names from other projects, each with why."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest
import yaml

from mapproseutil import DOC, ROOT, TreeIndex, doc_table, first_column, prose_errors, ticked, tree_roles

RUNNERS = ("operator", "import", "dsv41 window run")


# ---- a table against the tree ----------------------------------------------------------------


def compare(what: str, doc: list[str], tree: set[str]) -> list[str]:
    """Lines naming the rows missing from the doc, the extra ones and the duplicates."""
    out = []
    missing, extra = sorted(tree - set(doc)), sorted(set(doc) - tree)
    dup = sorted({n for n in doc if doc.count(n) > 1})
    if missing:
        out.append(f"{DOC} '## {what}': no row for {', '.join(missing)}")
    if extra:
        out.append(f"{DOC} '## {what}': rows for what the tree does not have: {', '.join(extra)}")
    if dup:
        out.append(f"{DOC} '## {what}': more than one row for {', '.join(dup)}")
    return out


# ---- reading the tree ------------------------------------------------------------------------


def tree_modules(root: Path) -> set[str]:
    return {p.stem for p in (root / "library").glob("*.py")}


def is_playbook(path: Path) -> bool:
    """A playbook: a non-empty YAML list whose every item is a play (``hosts``) or an import."""
    doc = yaml.safe_load(path.read_text())
    return (
        isinstance(doc, list)
        and bool(doc)
        and all(
            isinstance(p, dict) and ("hosts" in p or "import_playbook" in p or "ansible.builtin.import_playbook" in p)
            for p in doc
        )
    )


def tree_playbooks(root: Path) -> set[str]:
    """Relative paths of the playbooks at the root and directly in playbooks/ (task files are not)."""
    files = sorted(root.glob("*.yml")) + sorted((root / "playbooks").glob("*.yml"))
    return {str(p.relative_to(root)) for p in files if is_playbook(p)}


def runners(root: Path, playbooks: set[str]) -> dict[str, set[str]]:
    """Who runs each playbook, as far as the tree says: "import" when some playbook imports it,
    "dsv41 window run" when a command line (not a comment, not an import) of a playbook or of a role's
    task file (a play's body) names it, "operator" for the root ones."""
    out: dict[str, set[str]] = {p: {"operator"} if "/" not in p else set() for p in playbooks}
    for src in playbooks:
        for play in yaml.safe_load((root / src).read_text()):
            target = play.get("import_playbook") or play.get("ansible.builtin.import_playbook")
            if target:
                name = str((root / src).parent.joinpath(target).resolve().relative_to(root.resolve()))
                if name in out:
                    out[name].add("import")
    for src in sorted(playbooks) + sorted(str(p.relative_to(root)) for p in root.glob("roles/*/tasks/*.yml")):
        body = "\n".join(
            ln
            for ln in (root / src).read_text().splitlines()
            if not ln.lstrip().startswith("#") and "import_playbook" not in ln
        )
        for p in playbooks:
            if "/" in p and f"/{p}" in body:
                out[p].add("dsv41 window run")
    return out


def operator_documented(root: Path, playbook: str) -> bool:
    """``ansible-playbook PLAYBOOK`` appears in the Makefile, README.md or docs/ (an operator's way)."""
    texts = [root / "Makefile", root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return any(f"ansible-playbook {playbook}" in t.read_text() for t in texts if t.is_file())


def tree_commands() -> set[str]:
    """The commands `dsv41 --help` lists (groups and top-level commands), from the click tree."""
    import click
    import typer

    from dsv41 import cli

    cmd = typer.main.get_command(cli.app)
    return set(cmd.list_commands(click.Context(cmd)))


def tree_floors(root: Path) -> list[tuple[str, ...]]:
    """``FLOORS`` of tests/unit/test_import_floors.py, read as a literal (never imported)."""
    path = root / "tests" / "unit" / "test_import_floors.py"
    for node in ast.parse(path.read_text()).body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "FLOORS":
            return [tuple(f) for f in ast.literal_eval(node.value)]
    raise AssertionError(f"{path}: no FLOORS")


def tree_native(root: Path) -> dict[str, list[str]]:
    """``NATIVE`` of setup.py (C++ extension module -> its files, relative to the root), read as a
    literal (never imported)."""
    path = root / "setup.py"
    for node in ast.parse(path.read_text()).body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "NATIVE":
            return {k: list(v) for k, v in ast.literal_eval(node.value).items()}
    raise AssertionError(f"{path}: no NATIVE")


# ---- the comparisons -------------------------------------------------------------------------


def map_errors(root: Path, commands: set[str] | None = None) -> list[str]:
    """Every disagreement between ``root``/docs/architecture.md and the tree under ``root``, as
    lines (empty: the map is true). ``commands``: the `dsv41 --help` commands (default: this
    checkout's ``dsv41.cli``)."""
    text = (root / DOC).read_text()
    errors = compare("Roles", first_column(doc_table(text, "Roles")), tree_roles(root))
    errors += compare("Modules", first_column(doc_table(text, "Modules")), tree_modules(root))
    rows = doc_table(text, "Playbooks")
    books = tree_playbooks(root)
    errors += compare("Playbooks", first_column(rows), books)
    found = runners(root, books)
    for row in rows:
        name = first_column([row])[0]
        if name not in found:
            continue
        said = {r.strip().strip("`") for r in row[1].split(",")} if len(row) > 1 else set()
        if not said or not said <= set(RUNNERS):
            errors.append(f"{DOC} '## Playbooks' {name}: run by {row[1:2]}: expected some of {', '.join(RUNNERS)}")
            continue
        for who in ("import", "dsv41 window run"):
            if (who in said) != (who in found[name]):
                errors.append(
                    f"{DOC} '## Playbooks' {name}: run by {who}? the tree says "
                    f"{'yes' if who in found[name] else 'no'}, the row {'yes' if who in said else 'no'}"
                )
        if "/" not in name and "operator" not in said:
            errors.append(f"{DOC} '## Playbooks' {name}: a root playbook is run by an operator")
        if "/" in name and "operator" in said and not operator_documented(root, name):
            errors.append(
                f"{DOC} '## Playbooks' {name}: says operator, but no `ansible-playbook {name}` "
                "in the Makefile, README.md or docs/"
            )
        if "/" in name and not found[name] and "operator" not in said:
            errors.append(f"{DOC} '## Playbooks' {name}: nothing imports or runs it, so an operator does")
    cmds = tree_commands() if commands is None else commands
    errors += compare("Command-line groups", first_column(doc_table(text, "Command-line groups")), cmds)
    rows = doc_table(text, "Import floors")
    floors = tree_floors(root)
    numbers = [r[0] for r in rows]
    if numbers != [str(i) for i in range(len(floors))]:
        errors.append(f"{DOC} '## Import floors': floors {numbers}, FLOORS has 0..{len(floors) - 1}")
    for i, row in enumerate(rows[: len(floors)]):
        errors += compare(f"Import floors' floor {i}", ticked(row[1]) if len(row) > 1 else [], set(floors[i]))
    rows = doc_table(text, "Native extensions")
    native = tree_native(root)
    errors += compare("Native extensions", first_column(rows), set(native))
    for row in rows:
        name = first_column([row])[0]
        if name in native:  # the files column: python/dsv41/-relative paths, exactly setup.py's list
            errors += compare(
                f"Native extensions' {name} files",
                ticked(row[1]) if len(row) > 1 else [],
                {f.removeprefix("python/dsv41/") for f in native[name]},
            )
    return errors


def collection_errors(root: Path) -> list[str]:
    """Modules of library/ that galaxy.yml's description or changelogs/changelog.yaml do not name
    (and changelog modules that do not exist)."""
    mods = tree_modules(root)
    errors = []
    desc = yaml.safe_load((root / "galaxy.yml").read_text())["description"]
    missing = sorted(m for m in mods if not re.search(rf"\b{m}\b", desc))
    if missing:
        errors.append(f"galaxy.yml description: does not name {', '.join(missing)}")
    log = yaml.safe_load((root / "changelogs" / "changelog.yaml").read_text())
    named = [m["name"] for rel in log["releases"].values() for m in rel.get("modules", [])]
    errors += [
        e.replace(f"{DOC} '## changelog'", "changelogs/changelog.yaml") for e in compare("changelog", named, mods)
    ]
    return errors


# ---- the prose: every name it writes in backticks exists -------------------------------------


def test_the_prose_names_only_what_exists():
    errors = prose_errors((ROOT / DOC).read_text(), TreeIndex(ROOT))
    assert not errors, "\n".join(errors)


def test_wrong_prose_is_named():
    tree = TreeIndex(ROOT)
    text = (ROOT / DOC).read_text() + (
        "\nThe plugin tests are in `tests/unit/plugins/{modules,connection}/`; `make nosuch`, "
        "`dsv41 window nosuch`, `dsv41.errors.no_such`, role `promotion` `restart`, "
        "`python/dsv41/nowhere/`, `no_such_name_anywhere`.\n"
    )
    assert prose_errors(text, tree) == [
        f"{DOC}: `tests/unit/plugins/{{modules,connection}}/`: no path tests/unit/plugins/connection/",
        f"{DOC}: `make nosuch`: no make target 'nosuch'",
        f"{DOC}: `dsv41 window nosuch`: no command 'dsv41 window nosuch'",
        f"{DOC}: `dsv41.errors.no_such`: python/dsv41/errors.py defines no 'no_such'",
        f"{DOC}: `python/dsv41/nowhere/`: no path python/dsv41/nowhere/",
        f"{DOC}: `no_such_name_anywhere`: 'no_such_name_anywhere' appears nowhere in the code",
        f"{DOC}: role promotion has no entry point 'restart'",
    ]


def test_the_map_is_the_tree():
    errors = map_errors(ROOT)
    assert not errors, "\n".join(errors)


def test_galaxy_and_changelog_name_every_module():
    errors = collection_errors(ROOT)
    assert not errors, "\n".join(errors)


def test_every_module_and_library_link_agree():
    """library/ links every module of plugins/modules (the two lists the map and galaxy.yml use)."""
    assert tree_modules(ROOT) == {p.stem for p in (ROOT / "plugins" / "modules").glob("*.py")}


# ---- the check itself, on a copy of the tree ---------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """A copy of what the map reads: docs/, roles/ (directories and task files), library/, the playbooks,
    the Makefile, README.md, galaxy.yml, setup.py, changelogs/ and test_import_floors.py."""
    t = tmp_path / "repo"
    (t / "docs").mkdir(parents=True)
    shutil.copy(ROOT / DOC, t / DOC)
    for name in ("Makefile", "README.md", "galaxy.yml", "setup.py"):
        shutil.copy(ROOT / name, t / name)
    for p in (ROOT / "docs").glob("*.md"):
        shutil.copy(p, t / "docs" / p.name)
    shutil.copytree(ROOT / "changelogs", t / "changelogs")
    for r in tree_roles(ROOT):
        (t / "roles" / r).mkdir(parents=True)
    for f in ROOT.glob("roles/*/tasks/*.yml"):
        (t / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, t / f.relative_to(ROOT))
    (t / "library").mkdir()
    for m in tree_modules(ROOT):
        (t / "library" / f"{m}.py").write_text("")
    (t / "playbooks").mkdir()
    for p in list(ROOT.glob("*.yml")) + list((ROOT / "playbooks").glob("*.yml")):
        shutil.copy(p, t / p.relative_to(ROOT))
    (t / "tests" / "unit").mkdir(parents=True)
    shutil.copy(ROOT / "tests/unit/test_import_floors.py", t / "tests/unit/test_import_floors.py")
    return t


def test_the_copy_passes(tree):
    assert map_errors(tree, tree_commands()) == [] and collection_errors(tree) == []


def test_a_role_without_a_row_fails_naming_it(tree):
    (tree / "roles" / "new_role").mkdir()
    assert map_errors(tree, tree_commands()) == [f"{DOC} '## Roles': no row for new_role"]


def test_a_row_without_a_role_fails_naming_it(tree):
    # a role whose task files name no playbook (window's name the arm switch and fault playbooks)
    shutil.rmtree(tree / "roles" / "admission")
    assert map_errors(tree, tree_commands()) == [f"{DOC} '## Roles': rows for what the tree does not have: admission"]


def test_a_module_without_a_row_or_changelog_entry_fails(tree):
    (tree / "library" / "new_module.py").write_text("")
    assert map_errors(tree, tree_commands()) == [f"{DOC} '## Modules': no row for new_module"]
    assert collection_errors(tree) == [
        "galaxy.yml description: does not name new_module",
        "changelogs/changelog.yaml: no row for new_module",
    ]


def test_playbooks_task_files_commands_and_floors(tree):
    # a task file in playbooks/ is not a playbook; a new play is
    (tree / "playbooks" / "journal_append.yml").write_text("- name: A task\n  ansible.builtin.debug:\n    msg: x\n")
    (tree / "playbooks" / "new_play.yml").write_text("- name: A play\n  hosts: localhost\n  tasks: []\n")
    # a second import of a playbook the doc says only an operator runs
    (tree / "extra.yml").write_text("- ansible.builtin.import_playbook: playbooks/drill.yml\n")
    floors = tree / "tests/unit/test_import_floors.py"
    floors.write_text(floors.read_text().replace('("cli",),', '("cli",),\n    ("newpkg",),'))
    errors = map_errors(tree, tree_commands() | {"newgroup"})
    assert errors == [
        f"{DOC} '## Playbooks': no row for extra.yml, playbooks/new_play.yml",
        f"{DOC} '## Playbooks' playbooks/drill.yml: run by import? the tree says yes, the row no",
        f"{DOC} '## Command-line groups': no row for newgroup",
        f"{DOC} '## Import floors': floors {[str(i) for i in range(9)]}, FLOORS has 0..9",
    ]


def test_a_native_extension_or_file_without_its_row_fails_naming_it(tree):
    setup = tree / "setup.py"
    setup.write_text(
        setup.read_text()
        .replace(
            '"python/dsv41/overlay/core_driver.h",',
            '"python/dsv41/overlay/core_driver.h", "python/dsv41/overlay/core_new.h",',
        )
        .replace("NATIVE = {", 'NATIVE = {\n    "dsv41.engram._new": ["python/dsv41/engram/_new.cpp"],')
    )
    assert map_errors(tree, tree_commands()) == [
        f"{DOC} '## Native extensions': no row for dsv41.engram._new",
        f"{DOC} '## Native extensions' dsv41.overlay._core files': no row for overlay/core_new.h",
    ]


def test_the_readme_points_at_the_one_map():
    """README.md's Layout section links docs/architecture.md and is no second map (no table)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    assert "(docs/architecture.md)" in section
    assert not any(line.startswith("|") for line in section.splitlines()), "README.md '## Layout' holds a table"
