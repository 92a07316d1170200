"""Proving that ``exp(x - max(x)) / sum(exp(...))`` is ``softmax(x, axis)``, on coordinates.

The max and the sum may be taken of a transposed, reshaped or cast view of
``x`` (JAX reduces before it transposes), clamped by ``maximum(-inf, .)``,
cast (JAX sums half floats in float32: cast up, sum, cast down) and laid out
again before they broadcast back. :func:`reduced_axis` proves with
:mod:`.layout_algebra` that the value subtracted (divided by) holds, at every
coordinate of ``x``, the max (sum) over exactly one axis of ``x`` at the same
other coordinates; which ops spell it does not matter.

Casts between float dtypes are roundings: the softmax they spell is the same
function, and the applied remark states where the source rounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnpass.ir import DType, Graph, Node

from ..infra.rewrite import Decline
from . import layout_algebra as la
from .chains import is_float_cast, is_transparent, replay, scalar_constant, walk
from .layout_algebra import Atom


@dataclass(frozen=True)
class Softmax:
    """``div`` is ``softmax(x, axis)`` (cast to ``div``'s dtype); ``rounding`` states the source's roundings."""

    div: Node
    x: str
    axis: int
    precise: bool
    rounding: str


def _lineage(graph: Graph, value: str) -> list[Node]:
    """``value``'s node and its producers through transparent ops, value side first."""
    chain = walk(graph, value)
    return [*reversed(chain.nodes), graph.node(chain.root)]


def _sorted_atoms(atoms: tuple[Atom, ...]) -> list[Atom]:
    return sorted(la.normalize(atoms), key=lambda a: (a.axis is None, a.axis or 0, a.stride))


def reduced_axis(graph: Graph, value: str, kind: str, source: str) -> int | Decline:
    """The axis of ``source`` whose ``kind`` ("max" or "sum") ``value`` holds, broadcast back; else why not."""
    outer: list[Node] = []
    node = graph.node(value)
    while True:
        if is_transparent(graph, node):
            outer.append(node)
            node = graph.node(node.inputs[0])
        elif kind == "max" and node.op == "maximum":
            clamp = [i for i in (0, 1) if scalar_constant(graph, node.inputs[i]) == -math.inf]
            if not clamp:
                return Decline(
                    "not_softmax", f"{node.name} clamps the max with {list(node.inputs)}, not with -inf", node.name
                )
            node = graph.node(node.inputs[1 - clamp[0]])
        else:
            break
    if node.op != kind:
        return Decline(
            "not_softmax", f"{value} comes from {node.op} {node.name}, not from the {kind} of {source}", node.name
        )
    y = node.inputs[0]
    source_line, y_line = _lineage(graph, source), _lineage(graph, y)
    source_names = [n.name for n in source_line]
    common = next((n for n in y_line if n.name in source_names), None)
    if common is None:
        return Decline(
            "not_softmax", f"{kind} {node.name} reduces {y}, which is not {source} up to layout and rounding", node.name
        )
    base = la.root_layout(common.type.shape)
    lx = replay(source_line[: source_names.index(common.name)][::-1], base)
    ly = replay(y_line[: [n.name for n in y_line].index(common.name)][::-1], base)
    axes = sorted({a % graph.node(y).type.rank for a in node.attrs["axes"]})
    if lx is None or ly is None:
        return Decline(
            "uneven_reshape", f"a reshape between {common.name} and {kind} {node.name} mixes axes unevenly", node.name
        )
    reduced = tuple(a for i in axes for a in ly[i])
    kept = (
        tuple(() if i in axes else atoms for i, atoms in enumerate(ly))
        if node.attrs["keepdims"]
        else tuple(atoms for i, atoms in enumerate(ly) if i not in axes)
    )
    lm = replay(outer[::-1], kept)
    shape = graph.node(source).type.shape
    if lm is None or len(lm) > len(shape):
        return Decline(
            "not_softmax", f"the layout ops after {kind} {node.name} do not broadcast it back onto {source}", node.name
        )
    lm = la.broadcast(lm, shape)
    for axis in range(len(shape)):
        if _sorted_atoms(lx[axis]) != _sorted_atoms(reduced) or any(a.axis is not None for a in lm[axis]):
            continue
        if all(la.normalize(lm[i]) == la.normalize(lx[i]) for i in range(len(shape)) if i != axis):
            return axis
    return Decline(
        "not_softmax",
        f"{kind} {node.name} over axes {axes} of {y}, broadcast back, is not the {kind} of {source} "
        "along one of its axes",
        node.name,
    )


def _through_casts(graph: Graph, value: str) -> tuple[Node, list[Node]]:
    casts, node = [], graph.node(value)
    while is_float_cast(graph, node):
        casts.append(node)
        node = graph.node(node.inputs[0])
    return node, casts


def match_softmax(graph: Graph, div: Node) -> Softmax | Decline | None:
    """``div`` as ``exp(x - max_a(x)) / sum_a(exp(...))``; None when it is not an exp over a difference."""
    exp, num_casts = _through_casts(graph, div.inputs[0])
    if exp.op != "exp":
        return None
    sub, exp_casts = _through_casts(graph, exp.inputs[0])
    if sub.op != "sub":
        return None
    x = sub.inputs[0]
    x_type = graph.node(x).type
    if not x_type.dtype.is_float or sub.type.shape != x_type.shape:
        return Decline(
            "not_softmax",
            f"exp({sub.name}) subtracts {sub.inputs[1]} from {x} : {x_type}, which is not a float tensor it reduces",
            sub.name,
        )
    max_axis = reduced_axis(graph, sub.inputs[1], "max", x)
    if isinstance(max_axis, Decline):
        return Decline(
            max_axis.reason, f"exp({sub.name}) does not subtract the max of {x}: {max_axis.message}", max_axis.node
        )
    sum_axis = reduced_axis(graph, div.inputs[1], "sum", div.inputs[0])
    if isinstance(sum_axis, Decline):
        return Decline(
            sum_axis.reason, f"{div.name} does not divide by the sum of {exp.name}: {sum_axis.message}", sum_axis.node
        )
    if max_axis != sum_axis:
        return Decline(
            "not_softmax",
            f"the max reduces axes [{max_axis}] and the sum axes [{sum_axis}]; softmax needs one shared axis",
            div.name,
        )
    if div.type.shape != x_type.shape:
        return Decline("not_softmax", f"{div.name} is {div.type}, {x} is {x_type}: the division broadcasts", div.name)
    summed = _lineage(graph, div.inputs[1])[-1]
    sum_dtype = graph.node(summed.inputs[0]).type.dtype if summed.op == "sum" else exp.type.dtype
    steps = {"exp": exp.type.dtype, "the sum": sum_dtype, "the division": div.type.dtype}
    rounding = ""
    if num_casts or exp_casts or len(set(steps.values()) | {x_type.dtype}) > 1:
        shown = ", ".join(f"{what} in {dtype.short}" for what, dtype in steps.items())
        rounding = f"; rounding: the source computes {shown} ({x_type.dtype.short} input), softmax rounds once"
    half = x_type.dtype is not DType.float32
    precise = half and DType.float32 in steps.values()
    return Softmax(div, x, max_axis, precise, rounding)


__all__ = ["Softmax", "match_softmax", "reduced_axis"]
