"""Golden text tests, FileCheck-style: IR text in (tests/passes/golden/*.mlir), the pass, the printed IR checked
against the case's CHECK lines and the remarks against its REMARK lines (kind, node, rule, reason code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnpass.ir import format_graph, parse_graph
from attnpass.passes import REASONS, PassManager, Remark, parse_pipeline
from tests.passes.filecheck import Case, CheckError, cases, check

GOLDEN = Path(__file__).parent / "golden"
CASES = [case for path in sorted(GOLDEN.glob("*.mlir")) for case in cases(path)]
REWRITES = (
    "canonicalize", "raise-attention", "head-chunk", "qsa-gather", "qsa-pool-cache", "split-kv", "decompose-sdpa",
    "shard-attention", "block-sparse", "narrow-inputs", "dce", "mla-absorb", "dsa-gather",
)  # fmt: skip


def remark_line(r: Remark) -> str:
    """``pass kind node rule reason`` (``-`` for no node, and for a rule that is the pass itself or none)."""
    rule = r.rule if r.rule not in (None, r.pass_name) else "-"
    return f"{r.pass_name} {r.kind} {r.node or '-'} {rule} {r.reason}"


def run_case(case: Case) -> tuple[str, list[str]]:
    result = PassManager(parse_pipeline(case.pipeline)).run(parse_graph(case.graph))
    text = format_graph(result.graph)
    assert parse_graph(text) == result.graph  # what is checked is the graph, read back whole
    return text, [remark_line(r) for r in result.remarks]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden(case: Case):
    text, remarks = run_case(case)
    check(text, list(case.checks))
    assert remarks == list(case.remarks), "\n".join(remarks)
    assert {line.rsplit(" ", 1)[1] for line in remarks} <= set(REASONS)


def test_every_rewrite_pass_has_golden_cases_that_apply_it():
    applied = {c.pipeline.split("{")[0].split(",")[0] for c in CASES if any(" applied " in r for r in c.remarks)}
    assert sorted(set(REWRITES) - applied) == []
    assert all(c.checks for c in CASES)


# ----------------------------------------------------------------------------- the checker itself


TEXT = "graph g(x) {\n  a = exp x\n  b = neg a\n  c = exp b\n  return c\n}"


@pytest.mark.parametrize(
    "checks",
    [
        [("CHECK", "a = exp"), ("CHECK-NEXT", "b = neg"), ("CHECK", "return c")],
        [("CHECK", "graph"), ("CHECK-NOT", "neg"), ("CHECK", "a = exp")],
        [("CHECK", "b = neg"), ("CHECK-NOT", "neg")],  # a CHECK-NOT at the end covers the rest of the text
        [("CHECK", "exp"), ("CHECK", "exp")],  # two matches: the second search starts after the first
    ],
)
def test_the_checker_accepts_what_holds(checks):
    check(TEXT, checks)


@pytest.mark.parametrize(
    "checks, says",
    [
        ([("CHECK", "mul")], "CHECK: 'mul' not found"),
        ([("CHECK", "c = exp"), ("CHECK", "a = exp")], "CHECK: 'a = exp' not found after line 4"),  # order
        ([("CHECK", "a = exp"), ("CHECK-NEXT", "c = exp")], "CHECK-NEXT: 'c = exp' not on the line after line 2"),
        ([("CHECK", "return"), ("CHECK-NEXT", "}"), ("CHECK-NEXT", "x")], "'<end of text>'"),
        ([("CHECK-NOT", "neg"), ("CHECK", "c = exp")], "CHECK-NOT: 'neg' found at line 3"),
        ([("CHECK", "a = exp"), ("CHECK-NOT", "exp")], "CHECK-NOT: 'exp' found at line 4"),
        ([("CHECK", "exp"), ("CHECK", "exp"), ("CHECK", "exp")], "CHECK: 'exp' not found after line 4"),
    ],
)
def test_the_checker_reports_a_mismatch(checks, says):
    with pytest.raises(CheckError) as info:
        check(TEXT, checks)
    assert says in str(info.value)


@pytest.mark.parametrize("case", [c for c in CASES if "applied" in " ".join(c.remarks)], ids=lambda c: c.name)
def test_the_checks_of_a_rewrite_reject_its_input(case: Case):
    """The CHECK lines tell the rewritten graph from the one the pass received: a pass that changed nothing fails."""
    with pytest.raises(CheckError):
        check(format_graph(parse_graph(case.graph)), list(case.checks))
