"""Dead-code elimination, including dead graph inputs (they leave the program signature)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import Graph

from ..infra.base import Pass, Remarks
from ..infra.registry import register_pass

MAX_LISTED = 8  # dead internal node names listed in the summary remark before truncating
# What an input's bytes are: the host sends a streamed input every call; a resident one stays on the device.
UNITS = {"streamed": "bytes per call", "resident": "bytes of device memory"}


@register_pass
@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    """Remove every value the outputs do not (transitively) read.

    Liveness is one backward reachability query from the outputs; dead nodes
    are removed in reverse topological order (readers before what they read).
    A graph input nobody live reads is removed too, so it leaves the signature;
    the remaining inputs keep their order. Remarks: one ``applied`` per removed
    input (its role and bytes: per call when streamed, of device memory when
    resident), one ``applied`` summary of removed internal nodes, or a single
    ``declined`` "no dead values".
    """

    name: ClassVar[str] = "dce"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        dead = graph.remove_dead()
        if not dead:
            remarks.declined(None, "no dead values", reason="no_candidates")
            return False
        for node in dead:
            if node.op == "input":
                role = node.attrs["role"]
                remarks.applied(
                    node.name,
                    f"graph input {node.name}:{node.type} ({role}) is never read: it leaves the signature, "
                    f"saving {node.type.nbytes} {UNITS[role]}",
                    node.loc,
                    data={"type": str(node.type), "role": role, "bytes": node.type.nbytes},
                )
        internal = [n.name for n in dead if n.op != "input"]
        if internal:
            listed = ", ".join(internal[:MAX_LISTED])
            more = f", ... (+{len(internal) - MAX_LISTED} more)" if len(internal) > MAX_LISTED else ""
            figures = {"count": len(internal), "listed": internal[:MAX_LISTED]}
            remarks.applied(None, f"removed {len(internal)} dead node(s): {listed}{more}", data=figures)
        return True


__all__ = ["DeadCodeElimination"]
