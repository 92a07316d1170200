"""A small FileCheck: ordered substring checks of text, written as ``// CHECK:`` lines next to the input.

- ``CHECK: s``       the first line at or after the current one that contains ``s``; the search goes on after it;
- ``CHECK-NEXT: s``  the line right after the previous match contains ``s``;
- ``CHECK-NOT: s``   no line between the previous match and the next match (or the end) contains ``s``.

A golden case file (tests/passes/golden/*.mlir) holds cases separated by ``// -----``; a case is a
``// RUN: <pipeline>`` line, the input graph in the text form, the CHECK lines for the printed result and
``// REMARK: <kind> <node> <rule> <reason>`` lines, one per remark in order (``-`` for no node or rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DIRECTIVE = re.compile(r"//\s*(CHECK(?:-NEXT|-NOT)?|RUN|REMARK):\s?(.*)\Z")
SPLIT = "// -----"


class CheckError(AssertionError):
    """A CHECK line that the text does not satisfy, with the line it failed at."""


def check(text: str, checks: list[tuple[str, str]]) -> None:
    """Raise :class:`CheckError` unless ``text`` satisfies ``checks`` (``(kind, substring)`` in order)."""
    lines = text.splitlines()
    at = 0  # where the next search starts
    last = -1  # the line of the previous match
    nots: list[str] = []

    def refuse(start: int, stop: int) -> None:
        for pattern in nots:
            hit = next((i for i in range(start, stop) if pattern in lines[i]), None)
            if hit is not None:
                raise CheckError(f"CHECK-NOT: {pattern!r} found at line {hit + 1}: {lines[hit]!r}")
        nots.clear()

    for kind, pattern in checks:
        if kind == "CHECK-NOT":
            nots.append(pattern)
            continue
        if kind == "CHECK-NEXT":
            if last + 1 >= len(lines) or pattern not in lines[last + 1]:
                shown = lines[last + 1] if last + 1 < len(lines) else "<end of text>"
                raise CheckError(f"CHECK-NEXT: {pattern!r} not on the line after line {last + 1}: {shown!r}")
            found = last + 1
        else:
            found = next((i for i in range(at, len(lines)) if pattern in lines[i]), None)
            if found is None:
                raise CheckError(f"CHECK: {pattern!r} not found after line {at}")
        refuse(at, found)
        last, at = found, found + 1
    refuse(at, len(lines))


@dataclass(frozen=True)
class Case:
    """One golden case: where it is, the pipeline, the input graph text, its CHECK lines and expected remarks."""

    name: str
    pipeline: str
    graph: str
    checks: tuple[tuple[str, str], ...]
    remarks: tuple[str, ...]


def cases(path: Path) -> list[Case]:
    """The cases of one golden file."""
    out = []
    for i, chunk in enumerate(path.read_text().split(SPLIT)):
        graph, checks, remarks, pipeline = [], [], [], None
        for line in chunk.splitlines():
            m = DIRECTIVE.match(line.strip())
            if m is None:
                if not line.strip().startswith("//"):
                    graph.append(line)
                continue
            kind, body = m.groups()
            if kind == "RUN":
                pipeline = body.strip()
            elif kind == "REMARK":
                remarks.append(" ".join(body.split()))
            else:
                checks.append((kind, body.rstrip()))
        assert pipeline is not None, f"{path.name} case {i}: no // RUN: line"
        out.append(Case(f"{path.stem}#{i}", pipeline, "\n".join(graph), tuple(checks), tuple(remarks)))
    return out
