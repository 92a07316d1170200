"""The shared rewrite layer: rules as data, one walker, one rewriter; no pass writes remark plumbing.

A :class:`Rule` is an anchor op (or :data:`ANY`) plus ``match(graph, node) -> M | Decline | None`` (``None``:
not a candidate; :class:`Decline`: a candidate whose precondition failed, with a reason code of
:data:`~.base.REASONS`, the words, their figures and the failing node) and ``rewrite(rw, match)``, which builds
the replacement with the :class:`Rewriter` and ends with ``rw.replace_matched(value)``. ``describe(match)`` words
the applied remark. Rules compose as lists.

Driver order (:func:`apply_rules`): a sweep visits a snapshot of the nodes in topological order; at each node the
rules anchored at its op are tried in list order and the first match rewrites; sweeps repeat until one changes
nothing, at most ``max_sweeps`` times. Remarks: exactly one per (rule, candidate still in the graph), applied or
declined, plus one ``rule_hits`` analysis remark for multi-rule sets. In full: docs/passes.md, "The rewrite
layer".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar, Union

from attnpass.ir import Graph, Node, TensorType
from attnpass.ir.core.builder import Builder

from .base import Figures, Remarks

M = TypeVar("M")


@dataclass(frozen=True)
class Decline:
    """Why a candidate is not rewritten: the reason code (a key of :data:`~.base.REASONS`), the message with
    the names and numbers, the node where the precondition failed (``None``: the anchor itself),
    ``stage``, how far a matcher that tries several readings got (the furthest failure is the telling one),
    and ``data``, the message's figures by name (the remark's ``data``)."""

    reason: str
    message: str
    node: str | None = None
    stage: int = 0
    data: Figures = field(default_factory=dict, hash=False)


Described = Union[str, "tuple[str, Figures]"]  # what a rule's describe returns: the message (and its figures)


@dataclass(frozen=True)
class Rule(Generic[M]):
    """``op`` anchors the rule; ``match`` -> match | :class:`Decline` | None; ``rewrite(rw, match)``."""

    name: str
    op: str
    match: Callable[[Graph, Node], "M | Decline | None"]
    rewrite: Callable[["Rewriter", M], None]
    describe: Callable[[M], Described]

    @property
    def location(self) -> str:
        """``file.py:line`` of the rule's ``match`` (where its preconditions are written)."""
        code = self.match.__code__
        return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"


class Rewriter(Builder):
    """A :class:`~attnpass.ir.core.builder.Builder` bound to the matched anchor node.

    New nodes get the anchor's source location; :meth:`replace_matched` makes
    the anchor's readers read the replacement and removes the anchor.
    """

    def __init__(self, graph: Graph, anchor: Node) -> None:
        super().__init__(graph, anchor.loc)
        self.anchor = anchor
        self.done = False

    def replace_matched(self, value: str, *, prune: bool = False) -> None:
        """Replace the anchor by ``value``; ``prune`` also removes what only the anchor read."""
        self.graph.replace_with(self.anchor.name, value)
        if prune:
            self.graph.prune(self.anchor.inputs)
        self.done = True

    def annotate_matched(self, sharding: Sequence[str | None]) -> None:
        """Keep the anchor and give it a sharding annotation (a rewrite that only places values)."""
        self.graph.set_sharding(self.anchor.name, sharding)
        self.done = True

    def relayout(self, x: str, split: Sequence[int], perm: Sequence[int], shape: Sequence[int], hint: str) -> str:
        """``x`` reshaped to ``split``, transposed by ``perm``, reshaped to ``shape`` (one reshape when
        ``perm`` keeps the order; identities skipped): how :func:`.layout_algebra.view_plan` lays a value out."""
        if list(perm) == sorted(perm):
            return self.reshape(x, shape, hint)
        return self.reshape(self.transpose(self.reshape(x, split, hint), perm, hint), shape, hint)

    def retype_matched(self, type: TensorType) -> None:
        """Give the anchor, a graph input, a new type in place; rewire its readers to match."""
        self.graph.retype_input(self.anchor.name, type)
        self.done = True


ANY = "*"  # the anchor of a rule that looks at every node except the graph inputs


def _anchors(rule: Rule[Any], node: Node) -> bool:
    return rule.op == node.op or (rule.op == ANY and node.op != "input")


def _candidates(graph: Graph, op: str) -> list[str]:
    if op == "input":
        return list(graph.inputs)
    return [n.name for n in graph.nodes() if n.op == op or (op == ANY and n.op != "input")]


def apply_rules(
    graph: Graph,
    rules: Sequence[Rule[Any]],
    remarks: Remarks,
    *,
    max_sweeps: int = 1,
    decline_all: str | None = None,
) -> Counter:
    """Apply ``rules`` to ``graph`` in the driver order above; returns the hits per rule name.

    ``decline_all``: the message of a switched-off policy; every candidate is declined with it."""
    several = len(rules) > 1
    ops = list(dict.fromkeys(r.op for r in rules))
    decisions: dict[tuple[str, str], tuple[str, str, str, Any, Figures]] = {}  # (rule, node) -> (kind, reason,
    # message, loc, data)
    hits: Counter = Counter()
    for _sweep in range(max_sweeps):
        changed = False
        snapshot = [name for op in ops for name in _candidates(graph, op)] if len(ops) == 1 else None
        for name in snapshot if snapshot is not None else [n.name for n in graph.nodes()]:
            if name not in graph:
                continue
            node = graph.node(name)  # re-read: an earlier rewrite may have renamed its operands
            for rule in rules:
                if not _anchors(rule, node):
                    continue
                found = Decline("disabled", decline_all) if decline_all is not None else rule.match(graph, node)
                if found is None:
                    continue
                if isinstance(found, Decline):
                    at = f" [at {found.node}]" if found.node not in (None, name) else ""
                    decisions[(rule.name, name)] = ("declined", found.reason, found.message + at, node.loc, found.data)
                    continue
                rw = Rewriter(graph, node)
                rule.rewrite(rw, found)
                if not rw.done:
                    raise AssertionError(f"rule {rule.name} ({rule.location}) rewrote {name} without replace_matched")
                decisions.pop((rule.name, name), None)
                described = rule.describe(found)
                message, data = (described, {}) if isinstance(described, str) else described
                decisions[(rule.name, name)] = ("applied", "applied", message, node.loc, data)
                hits[rule.name] += 1
                changed = True
                break
        if not changed:
            break
    for (rule_name, name), (kind, reason, message, loc, data) in decisions.items():
        if kind == "applied" or name in graph:
            getattr(remarks, kind)(name, message, loc, rule_name, reason=reason, data=data)
    if not decisions and not several:
        what = "no nodes" if rules[0].op == ANY else f"no {rules[0].op} nodes"
        remarks.declined(None, what, rule=rules[0].name, reason="no_candidates")
    if several:
        declined = sum(1 for (_r, n), (kind, *_rest) in decisions.items() if kind == "declined" and n in graph)
        counts = ", ".join(f"{r.name} {hits[r.name]}" for r in rules)
        figures = {"rules": [r.name for r in rules], "hits": [hits[r.name] for r in rules], "declined": declined}
        remarks.analysis(
            None, f"rule hits: {counts}; {declined} candidate(s) declined", reason="rule_hits", data=figures
        )
    return hits


__all__ = ["ANY", "Decline", "Rewriter", "Rule", "apply_rules"]
