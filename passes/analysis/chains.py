"""Producer chains: following a value back through ops that keep its coordinates.

A *transparent* op keeps every element where it is up to a layout change
(``transpose``/``reshape``/``broadcast_to``) or a rounding (a float-to-float
``cast``). A *scale* multiplies or divides by a splatted constant.
:func:`walk` follows a value back through transparent ops (and scales, when
asked) to the first other producer, the chain's *root*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from attnpass.ir import DType, Graph, Node
from attnpass.ir.dialects.evaluate import constant

from . import layout_algebra as la
from .layout_algebra import LAYOUT_OPS

_HOLDS = {  # dtype -> the dtypes that hold every one of its values
    DType.bool: frozenset(DType),
    DType.float16: frozenset({DType.float16, DType.float32}),
    DType.bfloat16: frozenset({DType.bfloat16, DType.float32}),
    DType.float32: frozenset({DType.float32}),
    DType.int32: frozenset({DType.int32}),
}


def exact_cast(source: DType, target: DType) -> bool:
    """Does casting ``source`` to ``target`` keep every value (bool to anything, a half float to float32)?"""
    return target in _HOLDS[source]


@dataclass(frozen=True)
class Chain:
    """A value traced back to its root: the nodes in between (root side first) and their scale."""

    root: str
    nodes: tuple[Node, ...]
    scale: float

    def casts(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.op == "cast")


def is_float_cast(graph: Graph, node: Node) -> bool:
    """A cast between float dtypes: a rounding (or nothing), never a change of meaning."""
    return node.op == "cast" and node.type.dtype.is_float and graph.node(node.inputs[0]).type.dtype.is_float


def is_transparent(graph: Graph, node: Node) -> bool:
    return node.op in LAYOUT_OPS or is_float_cast(graph, node)


def splat(graph: Graph, value: str) -> np.ndarray | None:
    """The one value (0-d, in its dtype) of a constant whose elements all share their bits, reached
    through layout ops; else None."""
    node = graph.node(value)
    while node.op in LAYOUT_OPS:
        node = graph.node(node.inputs[0])
    if node.op != "constant":
        return None
    values = constant(node.attrs["value"], (len(node.attrs["value"]),), node.type.dtype)
    raw = values.view(np.uint8).reshape(len(values), -1)
    return values[0] if len(values) and (raw == raw[:1]).all() else None


def scalar_constant(graph: Graph, value: str) -> float | None:
    """:func:`splat` as a Python float (bools and ints too), else None."""
    found = splat(graph, value)
    return None if found is None else float(found)


def scale_operand(graph: Graph, node: Node) -> tuple[str, float] | None:
    """``(other operand, factor)`` when ``node`` multiplies or divides by a finite, non-zero splat."""
    if node.op not in ("mul", "div"):
        return None
    for i in (0, 1) if node.op == "mul" else (1,):
        c = scalar_constant(graph, node.inputs[i])
        other = node.inputs[1 - i]
        if c is not None and c != 0 and math.isfinite(c) and graph.node(other).type == node.type:
            return other, (c if node.op == "mul" else 1.0 / c)
    return None


def walk(graph: Graph, value: str, *, scales: bool = False) -> Chain:
    """Follow transparent ops (and scalar scales when ``scales``) back to the first other producer."""
    nodes: list[Node] = []
    factor = 1.0
    node = graph.node(value)
    while True:
        if is_transparent(graph, node):
            nodes.append(node)
            node = graph.node(node.inputs[0])
            continue
        scaled = scale_operand(graph, node) if scales else None
        if scaled is None:
            return Chain(node.name, tuple(reversed(nodes)), factor)
        nodes.append(node)
        factor *= scaled[1]
        node = graph.node(scaled[0])


def replay(nodes: Sequence[Node], layout: la.Layout | None) -> la.Layout | None:
    """Push ``layout`` through the layout ops among ``nodes`` (root side first); casts and scales keep it.

    None when a reshape is not a regrouping of the atoms (or ``layout`` is None).
    """
    for node in nodes:
        if layout is None:
            return None
        if node.op == "transpose":
            layout = la.transpose(layout, node.attrs["perm"])
        elif node.op == "reshape":
            layout = la.reshape(layout, node.type.shape)
        elif node.op == "broadcast_to":
            layout = la.broadcast(layout, node.type.shape)
    return layout


def elementwise_steps(graph: Graph, nodes: tuple[Node, ...], *, scales: bool) -> tuple[tuple[str, Any], ...]:
    """The casts (and, with ``scales``, the scales) among ``nodes`` as ``(op, dtype or constant)``, in order:
    replayed on the root laid out differently, they give the same values (layout ops move, they compute)."""
    steps: list[tuple[str, Any]] = []
    for node in nodes:
        if node.op == "cast":
            steps.append(("cast", node.type.dtype))
        elif scales and scale_operand(graph, node) is not None:
            other = scale_operand(graph, node)[0]
            steps.append(
                (node.op, scalar_constant(graph, node.inputs[1] if node.inputs[0] == other else node.inputs[0]))
            )
    return tuple(steps)


def chain_scale(graph: Graph, nodes: tuple[Node, ...]) -> float:
    """The product of the scales among ``nodes``."""
    return math.prod(scale_operand(graph, n)[1] for n in nodes if n.op in ("mul", "div"))


__all__ = [
    "Chain", "chain_scale", "elementwise_steps", "exact_cast", "is_float_cast", "is_transparent", "replay",
    "scalar_constant", "scale_operand", "splat", "walk",
]  # fmt: skip
