"""Before/after comparison of two graphs: a unified diff of the printed forms and a node summary.

Nodes are matched by name (passes keep the names of what they do not touch):
a name only in ``after`` is *added*, only in ``before`` *removed*, and in both
with a different op, operands, attributes or type *changed*.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass

from .graph import Graph

LISTED = 12  # node names listed per category before "+N more"


@dataclass(frozen=True)
class GraphDiff:
    """What differs between ``before`` and ``after``; names are in each graph's topological order."""

    before: Graph
    after: Graph
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]

    @property
    def identical(self) -> bool:
        return self.before == self.after

    def unified(self, labels: tuple[str, str] = ("before", "after"), context: int = 3) -> str:
        """A unified diff of the printed forms (empty when they print the same)."""
        lines = difflib.unified_diff(
            str(self.before).splitlines(), str(self.after).splitlines(), *labels, n=context, lineterm=""
        )
        return "\n".join(lines)

    def summary(self) -> str:
        """Counts, bytes per call, fingerprints, then the added/removed/changed nodes grouped by op."""
        b, a = self.before, self.after
        fb, fa = b.fingerprint(), a.fingerprint()
        same = " (structurally equal)" if fb == fa else ""
        lines = [
            f"// {len(self.added)} added, {len(self.removed)} removed, {len(self.changed)} changed "
            f"(nodes {len(b)} -> {len(a)}, inputs {len(b.inputs)} -> {len(a.inputs)})",
            f"// streamed bytes per call {b.input_nbytes():,} -> {a.input_nbytes():,}; "
            f"fingerprint {fb[:8]} -> {fa[:8]}{same}",
        ]
        categories = (("added", self.added, a), ("removed", self.removed, b), ("changed", self.changed, a))
        for label, names, graph in categories:
            if names:
                ops = Counter(graph.node(n).op for n in names)
                by_op = ", ".join(f"{count} {op}" for op, count in ops.most_common())
                more = f", ... (+{len(names) - LISTED} more)" if len(names) > LISTED else ""
                lines.append(f"{label} ({by_op}): {', '.join(names[:LISTED])}{more}")
        return "\n".join(lines)


def diff_graphs(before: Graph, after: Graph) -> GraphDiff:
    """Compare two graphs node by node (matched by name)."""
    old = {n.name: n for n in before.nodes()}
    new = {n.name: n for n in after.nodes()}
    return GraphDiff(
        before,
        after,
        added=tuple(n for n in new if n not in old),
        removed=tuple(n for n in old if n not in new),
        changed=tuple(n for n in new if n in old and new[n] != old[n]),
    )


__all__ = ["GraphDiff", "diff_graphs"]
