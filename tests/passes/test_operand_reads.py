"""Passes and emitters read optional operands by name, never by position (issue 42 item 6).

An optional operand sits in ``node.inputs`` after the required ones, and only when the node has it
(``Node.optionals``), so ``sdpa.inputs[3]`` is the mask on one node and the sinks on another. Every module
of passes/ and lowering/ is read with :mod:`ast`: a read of ``<x>.inputs`` that can reach an input position
where some op keeps an optional operand (the first such slot: the fewest required operands of an op that
declares optional ones, 3 for sdpa's q, k, v) fails. That is a constant index at or past it or negative, a
slice open at the end or ending past it, and unpacking ``node.inputs`` into more names than that. An index
computed at run time (``node.inputs[1 - i]``, a binary op's other side) is not judged.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from attnpass.ir import registered_ops

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("passes", "lowering")


def first_optional_slot() -> int:
    """The first input position that may hold an optional operand, over every registered op."""
    return min(len(op.required) for op in registered_ops().values() if op.optional)


def _constants(expr: ast.expr | None) -> list[int] | None:
    """The int values ``expr`` can take when it is a constant or a conditional between constants, else None."""
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return [expr.value]
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        inner = _constants(expr.operand)
        return None if inner is None else [-v for v in inner]
    if isinstance(expr, ast.IfExp):
        body, orelse = _constants(expr.body), _constants(expr.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def _reaches(index: ast.expr, slot: int) -> bool:
    """Whether subscript ``index`` of an inputs tuple can read position ``slot`` or later."""
    if isinstance(index, ast.Slice):
        if index.upper is None:
            return True
        upper = _constants(index.upper)
        return upper is not None and any(u > slot or u < 0 for u in upper)
    values = _constants(index)
    return values is not None and any(v >= slot or v < 0 for v in values)


def positional_reads(source: str, slot: int) -> list[str]:
    """``line: code`` for each read of ``<x>.inputs`` in ``source`` that can reach input position ``slot``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "inputs":
            if _reaches(node.slice, slot):
                found.append(node)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "inputs":
            targets = [t for t in node.targets if isinstance(t, (ast.Tuple, ast.List))]
            if any(len(t.elts) > slot or any(isinstance(e, ast.Starred) for e in t.elts) for t in targets):
                found.append(node)
    return [f"{n.lineno}: {ast.get_source_segment(source, n)}" for n in sorted(found, key=lambda n: n.lineno)]


def _modules() -> list[Path]:
    return sorted(p for package in SCANNED for p in (ROOT / package).rglob("*.py"))


def test_the_first_optional_slot_is_sdpas_mask():
    assert first_optional_slot() == 3


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pass_or_emitter_reads_an_optional_operand_by_position(path):
    reads = positional_reads(path.read_text(), first_optional_slot())
    assert not reads, (
        f"{path.relative_to(ROOT)} reads inputs by position where an optional operand may sit; read it by name "
        "(node.mask, node.operand('sinks'), node.operands):\n" + "\n".join(reads)
    )


def test_the_scan_finds_each_kind_of_positional_read():
    planted = """
mask = node.inputs[3]
last = node.inputs[-1]
extra = node.inputs[3:]
rest = node.inputs[1:]
head = node.inputs[:4]
either = node.inputs[3 if flag else 0]
q, k, v, m = node.inputs
q, *rest = node.inputs
"""
    assert [r.split(":")[0] for r in positional_reads(planted, 3)] == [str(i) for i in range(2, 10)]
    allowed = (
        "a = node.inputs[2]\nb = node.inputs[:3]\nc = node.inputs[1:3]\nd = node.inputs[1 - i]\nq, k, v = node.inputs\n"
    )
    assert positional_reads(allowed, 3) == []
