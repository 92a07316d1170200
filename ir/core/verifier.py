"""The verifier, in two layers run at every pass boundary.

1. Structure: names are identifiers, every operand is defined, the graph is
   acyclic, inputs are ``input`` nodes and vice versa, outputs exist; each state
   pair joins a resident input to an output of the same type, and neither is
   in two pairs.
2. Types: every node's shape rule is re-run on its operand types and must
   reproduce the annotated type; a sharding annotation fits the value and the
   graph's mesh (:func:`attnpass.ir.core.sharding.sharding_problem`).

A node object the verifier accepted, or that ``Graph.add_node`` built by running
its shape rule, is remembered with the operand nodes it read
(``Graph._accepted``, carried by copies); while the graph still holds exactly
those objects, its per-node checks are not repeated (nodes are immutable, so
they would pass again).

Errors follow JAX's shape: the reason, the offending node printed with the
normal printer, its source location, then a window of nearby nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .printer import format_node
from .registry import get_op
from .sharding import sharding_problem
from .types import AttnpassError, TensorType, VerifyError, check_identifier

if TYPE_CHECKING:
    from .graph import Graph, Node

WINDOW = 10


def verify(graph: "Graph") -> None:
    """Raise VerifyError describing the first violated invariant."""
    fresh = _not_accepted_before(graph)
    _check_structure(graph, fresh)
    _check_types(graph, fresh)


def node_error(graph: "Graph", node: "Node", reason: str) -> VerifyError:
    """A VerifyError for ``node``: reason, the node, its location and a bounded context window."""
    lines = [reason, f"  at: {format_node(node)}"]
    if node.loc is not None:
        lines.append(f"  from: {node.loc}")
    try:
        order = [n.name for n in graph.nodes()]
    except VerifyError:
        order = []
    if node.name in order:
        i = order.index(node.name)
        lo, hi = max(0, i - WINDOW), min(len(order), i + WINDOW + 1)
        lines.append(f"  context (nodes {lo}..{hi - 1} of {len(order)}):")
        for name in order[lo:hi]:
            mark = ">>" if name == node.name else "  "
            lines.append(f"  {mark} {format_node(graph.node(name))}")
    return VerifyError("\n".join(lines))


def _check_structure(graph: "Graph", fresh: set[str]) -> None:
    """The graph's structure; the per-node checks only for the ``fresh`` nodes (not accepted before)."""
    try:
        check_identifier(graph.name, "graph name")
    except AttnpassError as exc:
        raise VerifyError(str(exc)) from None
    nodes = graph._nodes
    signature = set(graph.inputs)
    for n in nodes.values():
        if n.name in fresh:
            try:
                check_identifier(n.name, "value name")
            except AttnpassError as exc:
                raise VerifyError(str(exc)) from None
            for i in n.inputs:
                if i not in nodes:
                    raise node_error(graph, n, f"{n.op} {n.name}: operand {i!r} is not defined (dangling value)")
        if n.op == "input" and n.name not in signature:
            raise node_error(graph, n, f"input node {n.name} is not in the graph signature")
    seen = set()
    for name in graph.inputs:
        if name not in nodes or nodes[name].op != "input":
            raise VerifyError(f"graph {graph.name}: signature entry {name!r} is not an input node")
        if name in seen:
            raise VerifyError(f"graph {graph.name}: input {name!r} listed twice in the signature")
        seen.add(name)
    if not graph.outputs:
        raise VerifyError(f"graph {graph.name}: has no outputs")
    for o in graph.outputs:
        if o not in nodes:
            raise VerifyError(f"graph {graph.name}: output {o!r} is not defined")
    graph._topological_order()  # raises VerifyError naming a cycle
    _check_state(graph)


def _not_accepted_before(graph: "Graph") -> set[str]:
    """The nodes the per-node checks must see: all but the very node objects that passed them before, reading the
    very same operand nodes.

    Nodes are immutable, so such a node's name, attributes, type and operand types are what was checked then; only
    the checks that depend on the rest of the graph (the signature, the mesh, cycles) must run again. One loop
    without calls: it runs over every node at every pass boundary.
    """
    nodes, accepted = graph._nodes, graph._accepted
    fresh = set()
    for name, node in nodes.items():
        memo = accepted.get(name)
        if memo is None or memo[0] is not node:
            fresh.add(name)
            continue
        for operand, seen in zip(node.inputs, memo[1]):
            if nodes.get(operand) is not seen:
                fresh.add(name)
                break
    return fresh


def _check_state(graph: "Graph") -> None:
    updated_by: dict[int, str] = {}
    for name, out in graph._state.items():
        where = f"graph {graph.name}: state {name} <- output #{out}"
        if name not in graph.inputs:
            raise VerifyError(f"{where}: {name} is not a graph input")
        if graph.input_role(name) != "resident":
            raise VerifyError(f"{where}: state must be a resident input, {name} is {graph.input_role(name)}")
        if not 0 <= out < len(graph.outputs):
            raise VerifyError(f"{where}: the graph has {len(graph.outputs)} output(s)")
        if out in updated_by:
            raise VerifyError(f"{where}: that output already updates {updated_by[out]}")
        updated_by[out] = name
        have, want = graph.node(graph.outputs[out]).type, graph.node(name).type
        if have != want:
            raise VerifyError(f"{where}: next value {graph.outputs[out]}:{have} differs in type from {name}:{want}")


def _check_types(graph: "Graph", fresh: set[str]) -> None:
    # The shape rules are pure: nodes alike in op, attributes and operand types (a model's layers) are inferred once,
    # and a node accepted before with the same operands (a pass's copy of the graph it started from) is not re-inferred.
    # Only the fresh nodes and the annotated ones are looked at, in topological order (the first error is the
    # earliest node's): on a pass's copy that is a few nodes of thousands.
    inferred_for: dict[tuple, tuple[dict, TensorType]] = {}
    mesh, nodes = graph.mesh_axes, graph._nodes
    graph._topological_order()  # _position (cached: _check_structure computed it)
    looked_at = fresh | {name for name, n in nodes.items() if n.sharding is not None}
    for n in [nodes[name] for name in sorted(looked_at, key=graph._position.__getitem__)]:
        if n.name in fresh:
            operand_nodes = tuple(graph.node(i) for i in n.inputs)
            operands = tuple(o.type for o in operand_nodes)
            key = _inference_key(n, operands)
            found = inferred_for.get(key) if key is not None else None
            if found is None:
                try:
                    opdef = get_op(n.op)
                    attrs = opdef.normalize_attrs(n.attrs)
                    found = attrs, opdef.result_type(operands, attrs, optionals=n.optionals, normalized=True)
                except AttnpassError as exc:
                    raise node_error(graph, n, f"{n.op} {n.name}: {exc}") from None
                if key is not None:
                    inferred_for[key] = found
            attrs, inferred = found
            if attrs != dict(n.attrs):
                raise node_error(graph, n, f"{n.op} {n.name}: attributes {dict(n.attrs)} are not normalized ({attrs})")
            if inferred != n.type:
                raise node_error(
                    graph, n, f"{n.op} {n.name}: annotated type {n.type} but the shape rule gives {inferred}"
                )
            graph._accepted[n.name] = (n, operand_nodes)
        problem = sharding_problem(n, mesh)  # None for an unannotated (fresh) node
        if problem:
            raise node_error(graph, n, f"{n.op} {n.name}: {problem}")


def _inference_key(node: "Node", operands: tuple[TensorType, ...]) -> tuple | None:
    """What a node's inferred type depends on, or None when an attribute value is unhashable (not normalized).

    Attribute values are keyed with their types (inside tuples too): ``1``, ``1.0`` and ``True`` are equal in
    Python, but only the first is a normalized int, so a node holding another must not reuse its verdict.
    """
    key = (node.op, tuple((name, _typed(value)) for name, value in node.attrs.items()), operands, node.optionals)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _typed(value: object) -> object:
    """``value`` with the type of every scalar in it, so that equal values of different types key apart."""
    if isinstance(value, tuple):
        return tuple, tuple(_typed(v) for v in value)
    return type(value), value
