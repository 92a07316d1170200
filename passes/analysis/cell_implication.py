"""Cellwise implication: a bool mask is false at every cell where a bool selection is false.

:func:`implies_cellwise` proves ``mask[..., t] => selected[..., t]`` for every cell, every input, in two
steps, or says why not with a :class:`~..infra.rewrite.Decline` (``mask_not_implied``) naming the node:

1. **Alignment.** Every node between ``selected`` and ``mask`` (every node that reads ``selected``) maps
   its key index ``t`` (the last axis) to ``selected``'s ``t + offset``: elementwise ops (their other
   operands broadcast by numpy's rules, which keep the last axis), ``reshape`` that only adds or drops unit
   axes and keeps the last one, ``slice`` of the last axis (``offset -= start``), and ``concat`` along the
   last axis whose parts sit where they came from (each part's offset is its start in the concat); each keeps
   the selection's rows (its axes but the last, unit axes aside), so no op mixes rows either. Any
   other reader (a reduction over the keys, a transpose, a gather) could move a selected cell's value to an
   unselected one: declined.
2. **Values.** With ``selected`` false at the cell, every node on that path is evaluated over intervals
   (``[lo, hi]`` and "may be NaN"; bools as ``[False, True]``); nodes that do not read ``selected`` are
   evaluated over the same intervals from their own inputs (constants exactly; graph inputs and ops
   without a rule: anything). Rules: ``where`` takes the branch its condition decides, else the hull;
   ``add``/``sub`` round their bounds in the node's dtype (rounding is monotone), ``-inf + inf`` may be
   NaN; ``maximum``/``minimum``/``neg``/``cast`` are monotone; comparisons are decided when the intervals
   do not overlap (a NaN compares false, except ``!=``); ``and``/``or``/``not`` on decided bools; layout
   ops (reshape, broadcast, slice, transpose, concat) keep the hull. The proof holds when ``mask``'s
   interval is exactly ``False``.

MaxText's DSA mask is ``where(sel, 0, -0.7 max) + where(valid, 0, -0.7 max) >= -0.35 max`` (per cache
half, and-ed with the segment masks, concatenated): with ``sel`` false the sum is at most ``-0.7 max``,
below ``-0.35 max``, so the mask is false there whatever ``valid`` is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attnpass.ir import Graph, Node

from ..infra.rewrite import Decline

ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "neg", "maximum", "minimum", "where", "cast", "greater", "less",
     "greater_equal", "less_equal", "equal", "not_equal", "logical_and", "logical_or", "logical_not", "abs"}
)  # fmt: skip
LAYOUT = frozenset({"reshape", "broadcast_to", "slice", "transpose", "concat"})


@dataclass(frozen=True)
class Interval:
    """Every value a node may hold at the cell: ``[lo, hi]`` and whether it may be NaN (bools: 0 or 1)."""

    lo: float
    hi: float
    nan: bool = False

    @property
    def true(self) -> bool:
        """Definitely true (a bool interval ``[1, 1]``)."""
        return self.lo == 1 and not self.nan

    @property
    def false(self) -> bool:
        """Definitely false (``[0, 0]``)."""
        return self.hi == 0 and not self.nan


ANY = Interval(-math.inf, math.inf, True)
MAYBE = Interval(0, 1)
FALSE, TRUE = Interval(0, 0), Interval(1, 1)


def _hull(*xs: Interval) -> Interval:
    return Interval(min(x.lo for x in xs), max(x.hi for x in xs), any(x.nan for x in xs))


def _bool(decided_true: bool, decided_false: bool) -> Interval:
    return TRUE if decided_true else FALSE if decided_false else MAYBE


def _rounded(node: Node, lo: float, hi: float, nan: bool) -> Interval:
    """``[lo, hi]`` rounded in the node's dtype (an integer result outside its range: anything)."""
    dtype = node.type.dtype
    if dtype.is_float:
        with np.errstate(over="ignore", invalid="ignore"):
            lo_r, hi_r = float(np.asarray(lo).astype(dtype.numpy)), float(np.asarray(hi).astype(dtype.numpy))
        return Interval(lo_r, hi_r, nan or math.isnan(lo_r) or math.isnan(hi_r))
    info = np.iinfo(dtype.numpy) if dtype.value != "bool" else None
    if info is None or not (info.min <= lo and hi <= info.max):
        return ANY if info is not None else MAYBE
    return Interval(lo, hi)


def _add(node: Node, a: Interval, b: Interval) -> Interval:
    nan = a.nan or b.nan or (a.lo == -math.inf and b.hi == math.inf) or (a.hi == math.inf and b.lo == -math.inf)
    if node.type.dtype.is_float:
        f = node.type.dtype.numpy
        with np.errstate(over="ignore", invalid="ignore"):
            lo = float(np.asarray(a.lo, f) + np.asarray(b.lo, f))
            hi = float(np.asarray(a.hi, f) + np.asarray(b.hi, f))
        return Interval(-math.inf if math.isnan(lo) else lo, math.inf if math.isnan(hi) else hi, nan)
    return _rounded(node, a.lo + b.lo, a.hi + b.hi, nan)


def _compare(op: str, a: Interval, b: Interval) -> Interval:
    """A comparison of two intervals (``a op b``); a NaN operand compares false (true for ``not_equal``)."""
    nan = a.nan or b.nan
    if op in ("less", "less_equal"):
        op, a, b = {"less": "greater", "less_equal": "greater_equal"}[op], b, a
    if op == "greater":
        return _bool(a.lo > b.hi and not nan, a.hi <= b.lo)
    if op == "greater_equal":
        return _bool(a.lo >= b.hi and not nan, a.hi < b.lo)
    same = a.lo == a.hi == b.lo == b.hi and not nan
    apart = a.hi < b.lo or b.hi < a.lo
    return _bool(same, apart) if op == "equal" else _bool(apart, same)


def _constant(node: Node) -> Interval:
    values = np.asarray(node.attrs["value"], np.float64)
    real = values[~np.isnan(values)]
    if real.size == 0:
        return Interval(0, 0, True)
    return Interval(float(real.min()), float(real.max()), bool(real.size < values.size))


def _evaluate(node: Node, x: list[Interval]) -> Interval:
    """One node's interval from its inputs' (see the module docstring)."""
    op, is_bool = node.op, node.type.dtype.value == "bool"
    if op == "constant":
        return _constant(node)
    if op in LAYOUT:
        return _hull(*x)
    if op == "where":
        c, a, b = x
        return a if c.true else b if c.false else _hull(a, b)
    if op in ("greater", "less", "greater_equal", "less_equal", "equal", "not_equal"):
        return _compare(op, *x)
    if op == "logical_and":
        return _bool(all(v.true for v in x), any(v.false for v in x))
    if op == "logical_or":
        return _bool(any(v.true for v in x), all(v.false for v in x))
    if op == "logical_not":
        return _bool(x[0].false, x[0].true)
    if op == "add":
        return _add(node, *x)
    if op == "sub":
        return _add(node, x[0], Interval(-x[1].hi, -x[1].lo, x[1].nan))
    if op == "neg":
        return _rounded(node, -x[0].hi, -x[0].lo, x[0].nan)
    if op in ("maximum", "minimum"):
        if any(v.nan for v in x):  # a target may return either operand beside a NaN
            return _hull(*x, Interval(0, 0, True))
        pick = max if op == "maximum" else min
        return Interval(pick(v.lo for v in x), pick(v.hi for v in x))
    if op == "cast":
        (a,) = x
        if is_bool:  # nonzero (NaN included) is true
            return _bool(a.lo > 0 or a.hi < 0, a.lo == a.hi == 0 and not a.nan)
        if node.type.dtype.is_float:
            return _rounded(node, a.lo, a.hi, a.nan)
        if a.nan or not (math.isfinite(a.lo) and math.isfinite(a.hi)):
            return ANY
        return _rounded(node, math.trunc(a.lo), math.trunc(a.hi), False)  # truncation toward 0 is monotone
    return MAYBE if is_bool else ANY


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _align(graph: Graph, mask: str, selected: str, reads: set[str]) -> dict[str, int] | Decline:
    """The key offset of every node in ``reads`` (the nodes reading ``selected`` on the way to ``mask``)."""
    offsets: dict[str, int] = {}
    lead = _squeezed(graph.node(selected).type.shape[:-1])
    stack = [(mask, 0)]
    while stack:
        name, off = stack.pop()
        if name in offsets:
            if offsets[name] != off:
                return Decline("mask_not_implied", f"{name} is read at key offsets {offsets[name]} and {off}", name)
            continue
        offsets[name] = off
        if name == selected:
            continue
        node = graph.node(name)
        if _squeezed(node.type.shape[:-1]) != lead:
            return Decline(
                "mask_not_implied",
                f"{node.op} {name} is {node.type}: its rows are not {selected}'s {graph.node(selected).type} rows",
                name,
            )
        last = node.type.rank - 1
        parts = [i for i in node.inputs if i in reads]
        if node.op in ELEMENTWISE:
            for i in parts:
                if graph.node(i).type.shape[-1:] != node.type.shape[-1:]:
                    return Decline(
                        "mask_not_implied", f"{node.op} {name} broadcasts {i} along the keys: not cell by cell", name
                    )
                stack.append((i, off))
        elif node.op == "reshape":
            src = graph.node(node.inputs[0]).type.shape
            if src[-1:] != node.type.shape[-1:] or _squeezed(src) != _squeezed(node.type.shape):
                return Decline("mask_not_implied", f"reshape {name} {src} -> {node.type.shape} moves cells", name)
            stack.append((node.inputs[0], off))
        elif node.op == "slice":
            src = graph.node(node.inputs[0]).type.shape
            starts, stops, steps = (node.attrs[k] for k in ("start", "stop", "step"))
            if any((starts[a], stops[a], steps[a]) != (0, src[a], 1) for a in range(last)) or steps[last] != 1:
                return Decline("mask_not_implied", f"slice {name} cuts other axes than the keys, or strides", name)
            stack.append((node.inputs[0], off - starts[last]))
        elif node.op == "concat" and node.attrs["axis"] % node.type.rank == last:
            start = 0
            for i in node.inputs:
                if i in reads:
                    stack.append((i, off + start))
                start += graph.node(i).type.shape[-1]
        else:
            return Decline(
                "mask_not_implied",
                f"{node.op} {name} reads the selection {selected} other than cell by cell along the keys",
                name,
            )
    return offsets if offsets.get(selected) == 0 else Decline(
        "mask_not_implied", f"the mask's key t reads {selected}'s key t + {offsets.get(selected)}", selected
    )  # fmt: skip


def implies_cellwise(graph: Graph, mask: str, selected: str) -> Decline | None:
    """None when bool ``mask`` is false at every cell where bool ``selected`` is (same key index, for every
    input; module docstring), else the Decline saying where the proof stops."""
    if graph.node(mask).type.dtype.value != "bool":
        return Decline("mask_form", f"mask {mask} is {graph.node(mask).type}, not bool", mask)
    scope = graph.ancestors([mask]) | {mask}
    if selected not in scope:
        return Decline("mask_not_implied", f"mask {mask} does not read the selection {selected}", mask)
    reads = {selected}
    order = [n for n in graph.nodes() if n.name in scope]
    for node in order:
        if any(i in reads for i in node.inputs):
            reads.add(node.name)
    aligned = _align(graph, mask, selected, reads)
    if isinstance(aligned, Decline):
        return aligned
    values: dict[str, Interval] = {}
    for node in order:
        if node.name == selected:
            values[node.name] = FALSE
        elif node.op == "input":
            values[node.name] = MAYBE if node.type.dtype.value == "bool" else ANY
        else:
            values[node.name] = _evaluate(node, [values[i] for i in node.inputs])
    if values[mask].false:
        return None
    found = values[mask]
    return Decline(
        "mask_not_implied",
        f"where {selected} is false, mask {mask} may still be true (its interval [{found.lo:g}, {found.hi:g}]"
        f"{', or NaN' if found.nan else ''}): a gathered row could miss one of its keys",
        mask,
    )


__all__ = ["Interval", "implies_cellwise"]
