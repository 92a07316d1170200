"""docs/ is the reference the code cites: every "docs/semantics.md §N" resolves to one of its sections, no
citation points at a specification outside the repository (issue 14, item 8). Every page's code blocks run in
tests/test_docs.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "semantics.md"
SOURCES = ("ir", "passes", "lowering", "backends", "models", "cli", "tests", "benchmarks", "examples")
# Modules another change is rewriting; they still say "SPEC §N" until it lands (issue 14, item 8).


def sources() -> list[Path]:
    files = [p for folder in SOURCES for p in (ROOT / folder).rglob("*.py") if p != Path(__file__).resolve()]
    return [*files, ROOT / "README.md", *(p for p in (ROOT / "docs").glob("*.md") if p != DOC)]


def sections() -> set[str]:
    """'2', '2.5', ... from the headings '## 2. ...' and '### 2.5 ...'."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", DOC.read_text(), flags=re.MULTILINE))


def test_every_citation_names_a_section():
    known = sections()
    assert {"1", "2", "2.2", "2.5", "2.7", "3", "3.2", "4", "5"} <= known
    cited = {}
    for path in sources():
        for number in re.findall(r"docs/semantics\.md §(\d+(?:\.\d+)?)", path.read_text()):
            cited.setdefault(number, []).append(path.relative_to(ROOT).as_posix())
    assert cited, "no citations found"
    missing = {number: files for number, files in cited.items() if number not in known}
    assert not missing, f"citations of sections docs/semantics.md does not have: {missing}"


def test_no_citation_of_a_spec_outside_the_repository():
    stale = sorted(p.relative_to(ROOT).as_posix() for p in sources() if re.search(r"\bSPEC §", p.read_text()))
    assert not stale, stale
