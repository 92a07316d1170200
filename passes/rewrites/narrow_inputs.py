"""Narrow graph inputs that are read only through one fixed static slice.

A graph input whose every reader is a ``slice`` with the same
``start/stop/step`` is replaced by a new input of the slice's type, with the
same name, role and place in the signature; the slices disappear and their
readers read the new input. The caller then passes only the slice (e.g. one
row of a padded ``[B, 64, T]`` mask instead of all 64), and
:meth:`Graph.input_nbytes` drops accordingly. Run :class:`DeadCodeElimination`
first: a dead reader that is not a slice blocks the narrowing.

One rule on the shared layer (:mod:`attnpass.passes.infra.rewrite`), anchored at
graph inputs: one remark per input, in signature order, ``applied`` with the
bytes before and after (per call when streamed, of device memory when resident),
or ``declined`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import Graph, Node, TensorType, format_slice

from ..infra.base import Pass, Remarks
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules
from .dce import UNITS


@dataclass(frozen=True)
class _Narrowing:
    name: str
    before: TensorType
    after: TensorType
    role: str
    window: str
    bounds: tuple[tuple[int, int, int], ...]  # (start, stop, step) per axis


def _bounds(node: Node) -> tuple:
    return node.attrs["start"], node.attrs["stop"], node.attrs["step"]


def _match(graph: Graph, node: Node) -> _Narrowing | Decline:
    """The narrowing of input ``node``, or why it keeps its type."""
    name, readers = node.name, graph.users(node.name)
    if name in graph.outputs:
        return Decline("interface", "it is a graph output")
    if graph.is_state(name):
        return Decline("interface", "it is state: its type must stay that of its next value")
    if not readers:
        return Decline("unused", "it is never read (dead-code elimination removes it)")
    others = sorted({n.op for n in readers if n.op != "slice"})
    if others:
        return Decline(
            "read_whole", f"it is read by {', '.join(others)}, not only through slices", data={"ops": others}
        )
    bounds = {_bounds(n) for n in readers}
    if len(bounds) > 1:
        figures = {"slices": len(readers), "distinct": len(bounds)}
        return Decline(
            "slices_differ", f"its {len(readers)} slices differ in bounds ({len(bounds)} distinct)", data=figures
        )
    if readers[0].type == node.type:
        return Decline("read_whole", "its slice covers the whole input", data={"ops": []})
    window = tuple(zip(*_bounds(readers[0])))
    return _Narrowing(name, node.type, readers[0].type, node.attrs["role"], f"[{format_slice(readers[0])}]", window)


def _rewrite(rw: Rewriter, m: _Narrowing) -> None:
    """Retype the input to its slices' type, then let their readers read the input directly."""
    slices = rw.graph.users(m.name)
    rw.retype_matched(m.after)
    for s in slices:
        rw.graph.replace_with(s.name, m.name)


def _describe(m: _Narrowing) -> tuple[str, dict]:
    figures = {
        "slice": m.bounds, "before": str(m.before), "after": str(m.after), "role": m.role,
        "bytes_before": m.before.nbytes, "bytes_after": m.after.nbytes,
    }  # fmt: skip
    return (
        f"read only through the slice {m.window}: input {m.name}:{m.before} narrowed to {m.after} "
        f"({m.role}), {m.before.nbytes} -> {m.after.nbytes} {UNITS[m.role]}"
    ), figures


RULES = [Rule("narrow-inputs", "input", _match, _rewrite, _describe)]


@register_pass
@dataclass(frozen=True)
class NarrowInputs(Pass):
    """Replace inputs read only by identical static slices with inputs of the slice's shape."""

    name: ClassVar[str] = "narrow-inputs"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        return bool(apply_rules(graph, RULES, remarks))


__all__ = ["NarrowInputs"]
