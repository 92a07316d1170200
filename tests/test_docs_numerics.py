"""docs/numerics.md: every row of the numerics table names the test that measures it, and that test exists
(issue 32, item 4): a row without a measurement, or one whose test was renamed away, fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "numerics.md"


def rows() -> list[list[str]]:
    """The table's data rows, as cells (the header and its rule left out)."""
    lines = [line for line in DOC.read_text().splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_every_row_names_an_existing_test():
    table = rows()
    assert len(table) >= 15 and all(len(row) == 5 for row in table)
    for route, *_claims, measured in table:
        found = re.fullmatch(r"`(tests/[\w/]+\.py)::(test_\w+)`", measured)
        assert found, f"{route}: measured by {measured!r}, not `tests/...py::test_name`"
        path, name = ROOT / found.group(1), found.group(2)
        assert path.is_file(), f"{route}: {path} does not exist"
        assert re.search(rf"^def {name}\(", path.read_text(), flags=re.MULTILINE), f"{route}: no {name} in {path}"


def test_the_pages_link_it():
    for page in ("README.md", "docs/semantics.md"):
        assert "numerics.md" in (ROOT / page).read_text(), page
