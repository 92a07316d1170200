"""Narrow graph inputs that are read only through one fixed static slice.

A graph input whose every reader is a ``slice`` with the same
``start/stop/step`` is replaced by a new input of the slice's type, with the
same name, role and place in the signature; the slices disappear and their
readers read the new input. The caller then passes only the slice (e.g. one
row of a padded ``[B, 64, T]`` mask instead of all 64), and
:meth:`Graph.input_nbytes` drops accordingly. Run :class:`DeadCodeElimination`
first: a dead reader that is not a slice blocks the narrowing.

One remark per graph input, in signature order: ``applied`` with the bytes
per call before and after, or ``declined`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import Graph, Node, TensorType, format_slice

from .base import Pass, Remarks


def _bounds(node: Node) -> tuple:
    return node.attrs["start"], node.attrs["stop"], node.attrs["step"]


@dataclass(frozen=True)
class NarrowInputs(Pass):
    """Replace inputs read only by identical static slices with inputs of the slice's shape."""

    name: ClassVar[str] = "narrow-inputs"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        changed = False
        for name in graph.inputs:
            reason = self._decline_reason(graph, name)
            if reason is not None:
                remarks.declined(name, reason, graph.node(name).loc)
                continue
            before = graph.node(name).type
            window = f"[{format_slice(graph.users(name)[0])}]"
            after = _narrow(graph, name)
            remarks.applied(
                name,
                f"read only through the slice {window}: input {name}:{before} narrowed to {after} "
                f"({graph.input_role(name)}), {before.nbytes} -> {after.nbytes} bytes per call",
                graph.node(name).loc,
            )
            changed = True
        return changed

    @staticmethod
    def _decline_reason(graph: Graph, name: str) -> str | None:
        readers = graph.users(name)
        if name in graph.outputs:
            return "it is a graph output"
        if not readers:
            return "it is never read (dead-code elimination removes it)"
        others = sorted({n.op for n in readers if n.op != "slice"})
        if others:
            return f"it is read by {', '.join(others)}, not only through slices"
        bounds = {_bounds(n) for n in readers}
        if len(bounds) > 1:
            return f"its {len(readers)} slices differ in bounds ({len(bounds)} distinct)"
        if readers[0].type == graph.node(name).type:
            return "its slice covers the whole input"
        return None


def _narrow(graph: Graph, name: str) -> TensorType:
    """Swap input ``name`` for an input of its slices' type (same name, role, position)."""
    old = graph.node(name)
    slices = graph.users(name)
    order, role, new_type = list(graph.inputs), old.attrs["role"], slices[0].type
    temp = graph.add_input(graph.fresh_name(f"{name}_narrow"), new_type, role, old.loc)
    for s in slices:
        graph.replace_all_uses(s.name, temp)
        graph.remove_node(s.name)
    graph.remove_node(name)
    graph.add_input(name, new_type, role, old.loc)
    graph.replace_all_uses(temp, name)
    graph.remove_node(temp)
    graph.set_inputs(order)
    return new_type


__all__ = ["NarrowInputs"]
