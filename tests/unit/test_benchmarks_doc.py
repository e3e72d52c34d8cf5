"""docs/benchmarks.md leads with one table of current results, and this test keeps it usable: the
table starts on the first screen, every row fills every column (quantity, current number, the
baseline of the same run, machine, date, what ran, the command that reproduces it, the record),
every row's record link names a file under docs/records/ and a heading in it, every path and
``make`` target a row's command names exists, and every benchmark record under docs/records/ is
linked from the page (history is never orphaned)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
COLUMNS = ["quantity", "current", "baseline, same run", "machine", "date (UTC)", "what ran", "reproduce", "record"]
#: The first screen: the table's header must start within it and the table must end within it.
FIRST_SCREEN = 45
#: A reproduce cell that points at another row's command instead of repeating it.
SAME_AS = re.compile(r"^(the same|as row \d+|as the row above|the deploy above)$")
PATH_LIKE = re.compile(r"(?:^|[\s=\"'])((?:tools|tests|inventories|playbooks)/[\w./-]+|[\w-]+\.yml)")


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of the ``#``..``####`` headings of a markdown file."""
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,4} (.+)$", path.read_text(), re.M)}


def current_table(text: str) -> tuple[int, int, list[list[str]]]:
    """(first line, last line, body rows) of the first markdown table of ``text`` (1-based lines)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = start
    while end + 1 < len(lines) and lines[end + 1].startswith("|"):
        end += 1
    rows = [split_row(ln) for ln in lines[start : end + 1]]
    return start + 1, end + 1, [rows[0]] + rows[2:]


def split_row(line: str) -> list[str]:
    """The cells of a table line; a ``|`` inside backticks is part of its cell."""
    cells, cur, code = [], "", False
    for ch in line.strip()[1:-1]:
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return cells + [cur.strip()]


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def row_errors(row: list[str]) -> list[str]:
    """What is wrong with one body row of the current table."""
    name = row[0] if row else "?"
    if len(row) != len(COLUMNS):
        return [f"row '{name}': {len(row)} cells, the header has {len(COLUMNS)}"]
    errors = [f"row '{name}': empty '{col}'" for col, cell in zip(COLUMNS, row, strict=True) if not cell]
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[4]):
        errors.append(f"row '{name}': date '{row[4]}' is not YYYY-MM-DD")
    links = re.findall(r"\]\((records/[^)#]+)#([^)]+)\)", row[7])
    if not links:
        errors.append(f"row '{name}': the record cell links no section of docs/records/")
    for rel, anchor in links:
        path = ROOT / "docs" / rel
        if not path.is_file():
            errors.append(f"row '{name}': record {rel} does not exist")
        elif anchor not in anchors(path):
            errors.append(f"row '{name}': {rel} has no heading with anchor #{anchor}")
    commands = re.findall(r"`([^`]+)`", row[6])
    if not commands and not SAME_AS.match(row[6]):
        errors.append(f"row '{name}': reproduce names no command (backticked) and no other row")
    for cmd in commands:
        for path in PATH_LIKE.findall(cmd):
            if not (ROOT / path).exists():
                errors.append(f"row '{name}': command names {path}, which does not exist")
        for target in re.findall(r"\bmake ([\w-]+)", cmd):
            if target not in make_targets():
                errors.append(f"row '{name}': no make target '{target}'")
    return errors


def test_the_current_table_leads_the_page():
    first, last, rows = current_table(DOC.read_text())
    assert rows[0] == COLUMNS
    assert first <= 10 and last <= FIRST_SCREEN, (
        f"docs/benchmarks.md: the current table spans lines {first}-{last}; it must end by line {FIRST_SCREEN}"
    )


def test_every_row_is_complete_and_reproducible():
    _, _, rows = current_table(DOC.read_text())
    errors = [e for row in rows[1:] for e in row_errors(row)]
    assert not errors, "\n".join(errors)


def test_every_benchmark_record_is_linked():
    text = DOC.read_text()
    records = sorted((ROOT / "docs" / "records").glob("benchmarks-*.md"))
    assert records
    orphans = [p.name for p in records if f"records/{p.name}" not in text]
    assert not orphans, f"docs/benchmarks.md links no row or index entry to {', '.join(orphans)}"


def test_a_broken_row_is_named():
    row = [
        "q",
        "1 ms",
        "2 ms",
        "H100",
        "2026-12-07",
        "bench",
        "`make nosuch tools/nosuch.sh`",
        "[r](records/nosuch.md#x)",
    ]
    assert row_errors(row) == [
        "row 'q': record records/nosuch.md does not exist",
        "row 'q': command names tools/nosuch.sh, which does not exist",
        "row 'q': no make target 'nosuch'",
    ]
    assert row_errors(["q", ""]) == ["row 'q': 2 cells, the header has 8"]
