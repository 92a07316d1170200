"""Canonicalization: raise decomposed attention (as MLX, JAX and hand-written code spell it) to ``sdpa``.

Rules are data (:data:`RULES`, composable with ``+``): an anchor op, a
``pattern`` that picks candidates cheaply, a ``check`` that proves the rewrite
exact or answers :class:`~attnpass.passes.attention_match.Fail` with the
reason and node, and a ``rewrite``. In order:

- ``and-true``   ``logical_and(x, True) -> x`` (JAX's masks carry one);
- ``softmax``    ``exp(x - max(x, a)) / sum(exp(...), a) -> softmax(x, a)`` (the
  max may be clamped by ``maximum(-inf, .)`` and pass ``stop_gradient``);
- ``attention``  ``softmax(q·kᵀ·scale + mask)·v -> sdpa`` with GQA, proven on
  coordinates by :func:`~attnpass.passes.attention_match.match_attention`.

Driver: top-down sweeps in topological order; at each node the rules of its
op are tried in list order and the first that applies rewrites; sweeps repeat
until one changes nothing (at most :data:`MAX_SWEEPS`). Values left dead by a
rewrite are removed at once (graph inputs are kept, and so is what was dead before). Remarks: one ``applied`` per
rewrite, one ``declined`` per candidate that failed its check (the reason names
what did not match), one ``analysis`` with the per-rule hit counts.

Exactness: the raised ``sdpa`` computes the same function. Rounding may
differ where the source scaled q or k instead of the scores (exact for a
power-of-two scale), and a bool mask filled with a large finite negative
(MLX uses the dtype's min) becomes sdpa's ``-inf``: identical except on rows
that attend no key at all, where MLX's own fast sdpa behaves as the source.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from attnpass.ir import Graph, Node

from . import layout_algebra as la
from .attention_match import Attention, Fail, match_attention, scalar_constant, walk
from .base import Pass, Remarks

MAX_SWEEPS = 4


@dataclass(frozen=True)
class Rule:
    """``pattern(graph, node) -> captures | None``, ``check(graph, captures) -> match | Fail``, ``rewrite``."""

    name: str
    op: str
    pattern: Callable[[Graph, Node], Any]
    check: Callable[[Graph, Any], Any]
    rewrite: Callable[[Graph, Any], str]
    describe: Callable[[Any], str]

    @property
    def location(self) -> str:
        code = self.check.__code__
        return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"


# ----------------------------------------------------------------------------- and-true


def _and_true_pattern(graph: Graph, node: Node) -> tuple[Node, str] | None:
    for i in (0, 1):
        if scalar_constant(graph, node.inputs[i]) == 1.0 and graph.node(node.inputs[i]).type.dtype.value == "bool":
            return node, node.inputs[1 - i]
    return None


def _and_true_check(graph: Graph, found: tuple[Node, str]) -> tuple[Node, str]:
    return found


def _and_true_rewrite(graph: Graph, found: tuple[Node, str]) -> str:
    node, x = found
    if graph.node(x).type.shape == node.type.shape:
        return x
    return graph.add_node("broadcast_to", [x], {"shape": node.type.shape}, name=graph.fresh_name(f"{node.name}_b"), loc=node.loc)


# ----------------------------------------------------------------------------- softmax


@dataclass(frozen=True)
class _Softmax:
    div: Node
    x: str
    axis: int


def _through(graph: Graph, value: str, ops: frozenset[str]) -> tuple[Node, list[Node]]:
    nodes, node = [], graph.node(value)
    while node.op in ops:
        nodes.append(node)
        node = graph.node(node.inputs[0])
    return node, nodes


def _softmax_pattern(graph: Graph, node: Node) -> tuple[Node, Node, Node] | None:
    e = graph.node(node.inputs[0])
    if e.op != "exp" or graph.node(e.inputs[0]).op != "sub":
        return None
    return node, e, graph.node(e.inputs[0])


def _keepdims_chain(graph: Graph, nodes: list[Node], reduced: Node, x_shape: tuple[int, ...], axis: int) -> str | None:
    """Why the layout ops after a reduction do anything but re-insert the reduced axis (None: they don't)."""
    keep = tuple(1 if a == axis else n for a, n in enumerate(x_shape))
    shape = reduced.type.shape
    for n in reversed(nodes):
        if n.op == "reshape" and n.type.shape == keep and shape in (keep, keep[:axis] + keep[axis + 1 :]):
            shape = keep
        elif n.op == "broadcast_to" and shape == keep and n.type.shape == x_shape:
            shape = x_shape
        else:
            return f"{n.op} {n.name} turns {list(shape)} into {list(n.type.shape)}, not the reduction with axis {axis} kept"
    if shape not in (keep, x_shape):
        return f"the reduction {reduced.name} gives {list(shape)}, which does not broadcast back along axis {axis}"
    return None


def _softmax_check(graph: Graph, found: tuple[Node, Node, Node]) -> _Softmax | Fail:
    div, e, sub = found
    x = sub.inputs[0]
    x_type = graph.node(x).type
    layout_ops = frozenset({"reshape", "broadcast_to"})
    m, m_chain = _through(graph, sub.inputs[1], layout_ops)
    if m.op == "maximum":
        clamp = [i for i in (0, 1) if scalar_constant(graph, m.inputs[i]) == -math.inf]
        if not clamp:
            return Fail(f"{m.name} clamps the max with {m.inputs}, not with -inf", m.name)
        m = graph.node(m.inputs[1 - clamp[0]])
    if m.op != "max" or m.inputs[0] != x:
        return Fail(f"exp({sub.name}) subtracts {m.op} {m.name}, not the max of {x}", sub.name)
    s, s_chain = _through(graph, div.inputs[1], layout_ops)
    if s.op != "sum" or s.inputs[0] != e.name:
        return Fail(f"{div.name} divides by {s.op} {s.name}, not by the sum of {e.name}", div.name)
    axes_m = tuple(sorted(a % x_type.rank for a in m.attrs["axes"]))
    axes_s = tuple(sorted(a % x_type.rank for a in s.attrs["axes"]))
    if len(axes_m) != 1 or axes_m != axes_s:
        return Fail(f"the max reduces axes {list(axes_m)} and the sum axes {list(axes_s)}; softmax needs one shared axis", div.name)
    if div.type != x_type or not x_type.dtype.is_float:
        return Fail(f"{div.name} is {div.type}, {x} is {x_type}", div.name)
    for reduced, chain in ((m, m_chain), (s, s_chain)):
        bad = _keepdims_chain(graph, chain, reduced, x_type.shape, axes_m[0])
        if bad:
            return Fail(bad, div.name)
    return _Softmax(div, x, axes_m[0])


def _softmax_rewrite(graph: Graph, m: _Softmax) -> str:
    attrs = {"axis": m.axis, "precise": False}
    return graph.add_node("softmax", [m.x], attrs, name=graph.fresh_name(f"{m.div.name}_softmax"), loc=m.div.loc)


# ----------------------------------------------------------------------------- attention


def _attention_pattern(graph: Graph, node: Node) -> Node | None:
    """A matmul with a softmax (through layout ops and scales) on either side."""
    roots = (graph.node(walk(graph, x, scales=True)[0].root).op for x in node.inputs)
    return node if "softmax" in roots else None


def _attention_check(graph: Graph, node: Node) -> Attention | Fail:
    found = match_attention(graph, node)
    return found if found is not None else Fail("P is not a softmax", node.name)


def _view(graph: Graph, src: str, layout: la.Layout, shape: tuple[int, ...], hint: str, loc) -> str:
    """Lay ``src`` (a canonical [B, H, S, D] value) out as ``layout`` of shape ``shape``: reshape, transpose, reshape."""
    src_shape = graph.node(src).type.shape
    factors = [(axis, a) for axis, atoms in enumerate(layout) for a in atoms]
    split = []
    for role, size in enumerate(src_shape):
        mine = sorted((a for _axis, a in factors if a.axis == role), key=lambda a: -a.stride)
        split += [(role, a) for a in mine] if size > 1 else []
    order = [split.index((a.axis, a)) for _axis, a in factors]
    value = src
    split_shape = tuple(a.size for _r, a in split)
    if split_shape != src_shape:
        value = graph.add_node("reshape", [value], {"shape": split_shape}, name=graph.fresh_name(hint), loc=loc)
    if order != sorted(order):
        value = graph.add_node("transpose", [value], {"perm": tuple(order)}, name=graph.fresh_name(hint), loc=loc)
    if graph.node(value).type.shape != shape:
        value = graph.add_node("reshape", [value], {"shape": shape}, name=graph.fresh_name(hint), loc=loc)
    return value


def _attention_rewrite(graph: Graph, m: Attention) -> str:
    loc, name = m.pv.loc, m.pv.name

    def arrange(value: str, perm: tuple[int, ...], hint: str) -> str:
        if perm == (0, 1, 2, 3):
            return value
        return graph.add_node("transpose", [value], {"perm": perm}, name=graph.fresh_name(f"{name}_{hint}"), loc=loc)

    operands = [arrange(m.q, m.q_perm, "q"), arrange(m.k, m.kv_perm, "k"), arrange(m.v, m.kv_perm, "v")]
    if m.mask is not None:
        mask = m.mask
        shape = graph.node(mask).type.shape
        if (1,) * (4 - len(shape)) + shape != m.mask_shape:
            mask = graph.add_node("reshape", [mask], {"shape": m.mask_shape}, name=graph.fresh_name(f"{name}_mask"), loc=loc)
        operands.append(mask)
    out = graph.add_node("sdpa", operands, {"scale": m.scale, "causal": "none"}, name=graph.fresh_name(f"{name}_sdpa"), loc=loc)
    return _view(graph, out, m.out_layout, m.pv.type.shape, f"{name}_out", loc)


RULES: list[Rule] = [
    Rule("and-true", "logical_and", _and_true_pattern, _and_true_check, _and_true_rewrite,
         lambda f: f"logical_and({f[1]}, True) -> {f[1]}"),  # logical_and(x, True) -> x
    Rule("softmax", "div", _softmax_pattern, _softmax_check, _softmax_rewrite,
         lambda m: f"exp({m.x} - max) / sum -> softmax({m.x}, axis={m.axis})"),  # exp(x-max)/sum -> softmax
    Rule("attention", "matmul", _attention_pattern, _attention_check, _attention_rewrite,
         lambda m: f"softmax(q·kᵀ·scale + mask)·v -> sdpa: {m.summary}"),  # softmax(qk^T s + m) v -> sdpa
]  # fmt: skip


@dataclass(frozen=True)
class RaiseAttention(Pass):
    """Raise decomposed softmax and attention to ``softmax`` and ``sdpa`` (see the module docstring)."""

    name: ClassVar[str] = "raise-attention"
    rules: tuple[Rule, ...] = tuple(RULES)

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        dead_before = {n.name for n in graph.nodes()} - graph.ancestors(graph.outputs)
        hits: Counter = Counter()
        declined: dict[tuple[str, str], tuple[Fail, Rule]] = {}
        for _sweep in range(MAX_SWEEPS):
            changed = False
            for name in [n.name for n in graph.nodes()]:
                if name not in graph:
                    continue
                node = graph.node(name)  # re-read: a rewrite may have renamed its operands
                for rule in self.rules:
                    if rule.op != node.op:
                        continue
                    found = rule.pattern(graph, node)
                    if found is None:
                        continue
                    match = rule.check(graph, found)
                    if isinstance(match, Fail):
                        declined[(rule.name, node.name)] = (match, rule)
                        continue
                    declined.pop((rule.name, node.name), None)
                    new = rule.rewrite(graph, match)
                    remarks.applied(node.name, f"{rule.name}: {rule.describe(match)}", node.loc)
                    graph.replace_all_uses(node.name, new)
                    graph.remove_dead(keep=dead_before, keep_inputs=True)
                    hits[rule.name] += 1
                    changed = True
                    break
            if not changed:
                break
        for (rule_name, node_name), (fail, rule) in declined.items():
            if node_name in graph:
                loc = graph.node(node_name).loc
                remarks.declined(node_name, f"{rule_name} (rule at {rule.location}): {fail.reason} [at {fail.node}]", loc)
        counts = ", ".join(f"{r.name} {hits[r.name]}" for r in self.rules)
        remarks.analysis(None, f"rule hits: {counts}; {sum(1 for k in declined if k[1] in graph)} candidate(s) declined")
        return bool(hits)


__all__ = ["RULES", "RaiseAttention", "Rule"]
