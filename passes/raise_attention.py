"""Canonicalization: raise decomposed attention (as MLX, JAX and hand-written code spell it) to ``sdpa``.

Three rules on the shared layer (:mod:`attnpass.passes.rewrite`; :data:`RULES`
composes with ``+``), each a ``match`` that proves the rewrite exact or
declines with the reason and node, and a ``rewrite``. In order:

- ``and-true``   ``logical_and(x, True) -> x`` (JAX's masks carry one);
- ``softmax``    ``exp(x - max(x, a)) / sum(exp(...), a) -> softmax(x, a)`` (the
  max may be clamped by ``maximum(-inf, .)`` and pass ``stop_gradient``);
- ``attention``  ``softmax(q·kᵀ·scale + mask)·v -> sdpa`` with GQA, proven on
  coordinates by :func:`~attnpass.passes.attention_match.match_attention`.

Driver: the shared walker with up to :data:`MAX_SWEEPS` sweeps (a bounded
fixed point). Values left dead by a rewrite are pruned at once (graph inputs
are kept). Remarks: one ``applied`` per rewrite, one ``declined`` per
candidate that failed (the reason names what did not match), one
``analysis`` with the per-rule hit counts.

Exactness: the raised ``sdpa`` computes the same function. Rounding may
differ where the source scaled q or k instead of the scores (exact for a
power-of-two scale). A bool mask filled with a large finite negative (MLX
and JAX use the dtype's min) stays a bool mask: on a row that attends no key
both weigh every key equally (sdpa's pinned fully-masked row). A bool mask
filled with ``-inf`` makes such a row NaN in the source, so it becomes the
additive mask ``where(mask, 0, -inf)``, NaN there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import DType, Graph, Node

from . import layout_algebra as la
from .attention_match import Attention, Fail, match_attention, scalar_constant, walk
from .base import Pass, Remarks
from .registry import register_pass
from .rewrite import Decline, Rewriter, Rule, apply_rules

MAX_SWEEPS = 4


# ----------------------------------------------------------------------------- and-true


def _and_true_match(graph: Graph, node: Node) -> str | None:
    """The other operand of ``logical_and(x, True)``."""
    for i in (0, 1):
        if scalar_constant(graph, node.inputs[i]) == 1.0 and graph.node(node.inputs[i]).type.dtype is DType.bool:
            return node.inputs[1 - i]
    return None


def _and_true_rewrite(rw: Rewriter, x: str) -> None:
    rw.replace_matched(rw.broadcast(x, rw.anchor.type.shape, f"{rw.anchor.name}_b"), prune=True)


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


def _softmax_match(graph: Graph, div: Node) -> _Softmax | Decline | None:
    """``exp(x - max(x)) / sum(exp(...))`` over one shared axis, reductions broadcast back."""
    e = graph.node(div.inputs[0])
    if e.op != "exp" or graph.node(e.inputs[0]).op != "sub":
        return None
    sub = graph.node(e.inputs[0])
    x = sub.inputs[0]
    x_type = graph.node(x).type
    layout_ops = frozenset({"reshape", "broadcast_to"})
    m, m_chain = _through(graph, sub.inputs[1], layout_ops)
    if m.op == "maximum":
        clamp = [i for i in (0, 1) if scalar_constant(graph, m.inputs[i]) == -math.inf]
        if not clamp:
            return Decline(f"{m.name} clamps the max with {m.inputs}, not with -inf", m.name)
        m = graph.node(m.inputs[1 - clamp[0]])
    if m.op != "max" or m.inputs[0] != x:
        return Decline(f"exp({sub.name}) subtracts {m.op} {m.name}, not the max of {x}", sub.name)
    s, s_chain = _through(graph, div.inputs[1], layout_ops)
    if s.op != "sum" or s.inputs[0] != e.name:
        return Decline(f"{div.name} divides by {s.op} {s.name}, not by the sum of {e.name}", div.name)
    axes_m = tuple(sorted(a % x_type.rank for a in m.attrs["axes"]))
    axes_s = tuple(sorted(a % x_type.rank for a in s.attrs["axes"]))
    if len(axes_m) != 1 or axes_m != axes_s:
        return Decline(f"the max reduces axes {list(axes_m)} and the sum axes {list(axes_s)}; softmax needs one shared axis", div.name)
    if div.type != x_type or not x_type.dtype.is_float:
        return Decline(f"{div.name} is {div.type}, {x} is {x_type}", div.name)
    for reduced, chain in ((m, m_chain), (s, s_chain)):
        bad = _keepdims_chain(graph, chain, reduced, x_type.shape, axes_m[0])
        if bad:
            return Decline(bad, div.name)
    return _Softmax(div, x, axes_m[0])


def _softmax_rewrite(rw: Rewriter, m: _Softmax) -> None:
    rw.replace_matched(rw.op("softmax", [m.x], {"axis": m.axis, "precise": False}, f"{m.div.name}_softmax"), prune=True)


# ----------------------------------------------------------------------------- attention


def _attention_match(graph: Graph, node: Node) -> Attention | Decline | None:
    """A matmul with a softmax (through layout ops and scales) on either side, proven an sdpa on coordinates."""
    roots = (graph.node(walk(graph, x, scales=True)[0].root).op for x in node.inputs)
    if "softmax" not in roots:
        return None
    found = match_attention(graph, node)
    if found is None:
        return Decline("P is not a softmax")
    return Decline(found.reason, found.node) if isinstance(found, Fail) else found


def _view(rw: Rewriter, src: str, layout: la.Layout, shape: tuple[int, ...], hint: str) -> str:
    """Lay ``src`` (a canonical [B, H, S, D] value) out as ``layout`` of shape ``shape``: reshape, transpose, reshape."""
    src_shape = rw.type(src).shape
    factors = [(axis, a) for axis, atoms in enumerate(layout) for a in atoms]
    split = []
    for role, size in enumerate(src_shape):
        mine = sorted((a for _axis, a in factors if a.axis == role), key=lambda a: -a.stride)
        split += [(role, a) for a in mine] if size > 1 else []
    order = [split.index((a.axis, a)) for _axis, a in factors]
    value = rw.reshape(src, tuple(a.size for _r, a in split), hint)
    if order != sorted(order):
        value = rw.transpose(value, order, hint)
    return rw.reshape(value, shape, hint)


def _attention_rewrite(rw: Rewriter, m: Attention) -> None:
    name = m.pv.name
    operands = [
        rw.transpose(m.q, m.q_perm, f"{name}_q"),
        rw.transpose(m.k, m.kv_perm, f"{name}_k"),
        rw.transpose(m.v, m.kv_perm, f"{name}_v"),
    ]
    if m.mask is not None:
        mask = rw.reshape(m.mask, m.mask_shape, f"{name}_mask") if _needs_reshape(rw, m) else m.mask
        if m.mask_fill == -math.inf:  # the source's rows with no key are 0/0: keep them NaN
            dtype = rw.type(m.pv.name).dtype
            fills = [rw.scalar(0.0, dtype, "zero"), rw.scalar(-math.inf, dtype, "neg_inf")]
            mask = rw.op("where", [mask, *fills], hint=f"{name}_bias")
        operands.append(mask)
    out = rw.op("sdpa", operands, {"scale": m.scale, "causal": "none"}, f"{name}_sdpa")
    rw.replace_matched(_view(rw, out, m.out_layout, m.pv.type.shape, f"{name}_out"), prune=True)


def _needs_reshape(rw: Rewriter, m: Attention) -> bool:
    shape = rw.type(m.mask).shape
    return (1,) * (4 - len(shape)) + shape != m.mask_shape


RULES: list[Rule] = [
    Rule("and-true", "logical_and", _and_true_match, _and_true_rewrite,
         lambda x: f"logical_and({x}, True) -> {x}"),  # logical_and(x, True) -> x
    Rule("softmax", "div", _softmax_match, _softmax_rewrite,
         lambda m: f"exp({m.x} - max) / sum -> softmax({m.x}, axis={m.axis})"),  # exp(x-max)/sum -> softmax
    Rule("attention", "matmul", _attention_match, _attention_rewrite,
         lambda m: f"softmax(q·kᵀ·scale + mask)·v -> sdpa: {m.summary}"),  # softmax(qk^T s + m) v -> sdpa
]  # fmt: skip


@register_pass
@dataclass(frozen=True)
class RaiseAttention(Pass):
    """Raise decomposed softmax and attention to ``softmax`` and ``sdpa`` (see the module docstring)."""

    name: ClassVar[str] = "raise-attention"
    rules: tuple[Rule, ...] = tuple(RULES)

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        return bool(apply_rules(graph, self.rules, remarks, max_sweeps=MAX_SWEEPS))


__all__ = ["RULES", "RaiseAttention", "Rule"]
