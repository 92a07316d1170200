"""Attention normalised after P·V, or combined from partial attentions: read as algebra, proven one ``sdpa``.

docs/semantics.md §1.6. Two forms that have no softmax before P·V, so the ``attention`` rule does not see them:

- **deferred normalisation**: ``(exp(s - m)·v) / sum(exp(s - m), keys)`` (MaxText's local attention,
  flash-style code), the row max ``m`` subtracted or not;
- the **log-sum-exp combine** of partial attentions over disjoint key sets (MaxText combines a prefill-cache
  and a decode-cache attention): ``o = Σ_i exp(lse_i - lse)·o_i`` with ``lse = log Σ_i exp(lse_i)``; from each
  part's max and sum, ``o = Σ_i exp(m_i - M)/S · u_i`` with ``S = Σ_i exp(m_i - M)·l_i`` and ``u_i`` not
  normalised; split-kv's ``Σ_i w_i·o_i / Σ_i w_i``; each spelled with any row constant for the max.

One algebra reads both. Per query row ``r`` (the sdpa's ``(b, h, s)``) every value between the exps and the
output is one of

- ``log f``: a row scalar equal to the linear form ``f`` over symbols: ``L_S(r) = log Σ_{p∈S} Σ_t
  exp(s_p[r, t])`` (the log-sum-exp of the scores of the parts ``S`` over their keys) and opaque row scalars (a
  row max, a ``maximum`` of row scalars: named by their node, never expanded);
- ``pos f``: the positive row scalar ``exp(f(r))``;
- ``exps(p, c)``: part ``p``'s matrix ``exp(s_p[r, t] - c(r))`` (``c = L_p``: its softmax);
- ``vec(S, f)``: ``exp(f(r))·o_S[r, :]``, ``o_S`` the attention over the keys of the parts ``S`` together.

``P·V`` of ``exps(p, c)`` is ``vec({p}, L_p - c)``; the sum of ``exps(p, c)`` over the keys is ``pos(L_p - c)``;
products and quotients add and subtract forms; ``pos(L_S + c) + pos(L_T + c)`` (and two vecs weighed so) with
``S`` and ``T`` disjoint is ``pos(L_{S∪T} + c)``. Each rule is an identity of real numbers for any finite values
of the opaque symbols, so a value read as ``vec(S, 0)`` is the attention over the keys of ``S``; anything else
the algebra cannot read makes the value opaque (not a candidate) or a failure naming the op.

A part ``p`` is proven an attention by :func:`~.attention_match.match_attention` run on its ``P·V`` with the
part's exps read as ``softmax(s_p)`` (an overlay: the graph is not copied), which gives its q, k, v, mask,
scale and the roles of its axes. Then the algebra runs again with layouts (:mod:`.layout_algebra`) in those
roles: a row scalar must walk the query rows exactly as the values it meets, a sum must add exactly the
keys. Where the source's finite arithmetic differs from the function (rows without keys, overflow without the
max, fills that only mask below a bound) the match says so or declines: docs/semantics.md §1.6.

Candidates: a deferred normalisation is decided at its last div (or mul), a combine at its last step (the
value read as the attention over two or more parts, or the sum of weights or attentions where their algebra
fails). A combine's parts are left to it (:func:`feeds_combine`): one remark, the combine's, says what became of
them. ``jnp.logaddexp`` as JAX traces it (a ``where`` around ``max + log1p(exp(-|d|))``) is read as
``logaddexp``; ``split-kv``'s own output (``sdpa`` and ``sdpa_lse``) is not read back.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from attnpass.ir import DType, Graph, Node, TensorType
from attnpass.ir.dialects.evaluate import rounded

from ..infra.rewrite import Decline
from . import layout_algebra as la
from .attention_match import Attention, MaskPlan, match_attention
from .chains import is_float_cast, is_transparent, replay, scalar_constant, walk
from .layout_algebra import Atom, Layout
from .score_path import UNDERFLOW, _ScorePath
from .softmax_match import reduced_axis

DV, KEYS = 3, 4  # roles of an exps or vec layout beyond the query row's b, h, s (0, 1, 2)
MAX_DEPTH = 48  # how far back from a candidate the algebra reads (a combine is a few dozen ops)
MAX_NODES = 2000  # values read per candidate, at most
MAX_FORWARD = 256  # values the search for a combine visits after a part's product

Symbol = tuple  # ("L", parts) for L_S, ("n", node) for an opaque row scalar


@dataclass(frozen=True)
class Form:
    """``Σ coeff·symbol + const``: the log of a row scalar (sorted terms, no zero coefficient)."""

    terms: tuple[tuple[Symbol, float], ...] = ()
    const: float = 0.0

    @staticmethod
    def of(symbol: Symbol) -> Form:
        return Form(((symbol, 1.0),))

    @staticmethod
    def lse(parts: Sequence[str] | frozenset[str]) -> Form:
        return Form.of(("L", tuple(sorted(parts))))

    def __add__(self, other: Form) -> Form:
        coeffs = dict(self.terms)
        for s, c in other.terms:
            coeffs[s] = coeffs.get(s, 0.0) + c
        return Form(tuple(sorted((s, c) for s, c in coeffs.items() if c != 0.0)), self.const + other.const)

    def __neg__(self) -> Form:
        return Form(tuple((s, -c) for s, c in self.terms), -self.const)

    def __sub__(self, other: Form) -> Form:
        return self + -other

    def __bool__(self) -> bool:
        return bool(self.terms) or self.const != 0.0

    def split_lse(self) -> tuple[frozenset[str], Form] | None:
        """``(S, rest)`` when the form is ``L_S + rest`` and ``rest`` holds no log-sum-exp."""
        found = [(s, c) for s, c in self.terms if s[0] == "L"]
        if len(found) != 1 or found[0][1] != 1.0:
            return None
        return frozenset(found[0][0][1]), self - Form.of(found[0][0])

    def __str__(self) -> str:
        parts = []
        for (kind, name), c in self.terms:
            shown = f"lse({'+'.join(name)})" if kind == "L" else name
            parts.append(("- " if c < 0 else "+ ") + (shown if abs(c) == 1 else f"{abs(c):g}·{shown}"))
        if self.const or not parts:
            parts.append(("- " if self.const < 0 else "+ ") + f"{abs(self.const):g}")
        text = " ".join(parts)
        return text[2:] if text.startswith("+ ") else "-" + text[2:]


@dataclass(frozen=True)
class Val:
    """A value the algebra reads: ``kind`` const, log, pos, exps or vec (module docstring); ``layout`` its axes as
    roles (None while discovering, and for constants); ``leaves`` the exps it reads."""

    kind: str
    form: Form = Form()
    parts: frozenset[str] = frozenset()
    layout: Layout | None = None
    leaves: frozenset[str] = frozenset()
    value: float = 0.0  # a constant's
    logged: bool = False  # a part's log-sum-exp was formed in floating point (log of its sum, added to its max)


@dataclass(frozen=True)
class Fail:
    """Why a value that reads exps is not one the algebra can read (a decline's reason code and words)."""

    reason: str
    message: str
    node: str
    parts: frozenset[str] = frozenset()
    leaves: frozenset[str] = frozenset()
    vec: bool = False  # a P·V of exps is below it
    combine: bool = False  # it failed adding weights or attentions of parts (a combine's step), or reads such a step


Read = Val | Fail | None  # None: opaque, no exps of scores below it


@dataclass
class Part:
    """One partial attention: its scores (the softmax input), the exps of them, the key axis, its P·V."""

    scores: str
    leaves: set[str] = field(default_factory=set)
    axis: int | None = None
    max_subtracted: bool = True  # every exp of it subtracts its row max
    pv: str | None = None
    p_root: str | None = None  # the P operand's producer (through layout ops and casts)
    attention: Attention | None = None
    layout: Layout | None = None  # the scores' axes as roles (keys: KEYS)


@dataclass(frozen=True)
class PartialAttention:
    """A proven deferred normalisation (one part) or combine (several): ``root`` becomes one sdpa over the parts'
    keys, laid out as ``out_layout``; ``masks`` are the parts' masks as the sdpa must apply them."""

    root: Node
    parts: tuple[Attention, ...]
    masks: tuple[MaskPlan, ...]
    out_layout: Layout
    summary: str
    figures: Mapping[str, Any]

    @property
    def combine(self) -> bool:
        return len(self.parts) > 1


class _Overlay:
    """``graph`` with some nodes read as others (a part's exps as the softmax of its scores); nothing is copied."""

    def __init__(self, graph: Graph, nodes: Mapping[str, Node]) -> None:
        self.graph, self.nodes_ = graph, nodes

    def node(self, name: str) -> Node:
        return self.nodes_.get(name) or self.graph.node(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)


def _merge(shape: Sequence[int], layouts: Sequence[Layout]) -> Layout | str:
    """The layout of an elementwise op's result: where two operands walk one factor they walk the same query rows;
    one may be broadcast only where the other walks keys or the value dim (a row scalar meeting a matrix)."""
    lays = [la.broadcast(lay, shape) for lay in layouts]
    out = []
    for axis in range(len(shape)):
        merged = list(lays[0][axis])
        for other in lays[1:]:
            pairs = la.common_factors(merged, other[axis])
            if pairs is None:
                return f"axis {axis} splits into factors differently on its operands"
            merged = []
            for a, b in pairs:
                if a.axis is not None and b.axis is not None and a != b:
                    return f"axis {axis} walks {_role(a)} on one operand and {_role(b)} on the other"
                real = a if a.axis is not None else b
                if (a.axis is None) != (b.axis is None) and real.axis not in (DV, KEYS):
                    return f"axis {axis}: one operand is broadcast over {_role(real)}, which the other walks"
                merged.append(real)
        out.append(la.normalize(merged))
    return tuple(out)


def _role(atom: Atom) -> str:
    return f"{('b', 'h', 's', 'dv', 't')[atom.axis]}:{atom.size}" + (f"/{atom.stride}" if atom.stride != 1 else "")


def _reduce(layout: Layout, axes: Sequence[int], keepdims: bool, role: int, size: int) -> Layout | None:
    """``layout`` reduced over ``axes``, which must walk exactly the whole ``role`` (of ``size``) and nothing else."""
    reduced = [a for ax in axes for a in layout[ax]]
    rest = [a for i, atoms in enumerate(layout) if i not in axes for a in atoms]
    if any(a.axis != role for a in reduced) or any(a.axis == role for a in rest):
        return None
    if not la.covers(reduced, size):
        return None
    if keepdims:
        return tuple(() if i in axes else atoms for i, atoms in enumerate(layout))
    return tuple(atoms for i, atoms in enumerate(layout) if i not in axes)


def _whole_axis(layout: Layout, axes: Sequence[int], shape: Sequence[int]) -> int | None:
    """The one axis of the scores (atoms named by their axes) that ``axes`` of ``layout`` walk whole, if any (a sum
    over one size-1 axis of the scores as they are: that axis)."""
    reduced = [a for ax in axes for a in layout[ax] if a.size > 1]
    if not reduced and len(axes) == 1 and layout == la.root_layout(shape):
        return axes[0]
    names = {a.axis for a in reduced}
    if len(names) != 1 or None in names:
        return None
    (axis,) = names
    if any(a.axis == axis for i, atoms in enumerate(layout) if i not in axes for a in atoms):
        return None
    return axis if la.covers(reduced, shape[axis]) else None


def _jax_logaddexp(graph: Graph, node: Node) -> tuple[str, str] | None:
    """``(x, y)`` when ``node`` is ``jnp.logaddexp(x, y)`` as JAX traces it: ``where(isnan(x - y), x + y,
    maximum(x, y) + log1p(exp(-|x - y|)))`` (``isnan(d)`` as ``not (d == d)``); the NaN branch is taken only where
    the sum is NaN or infinite anyway."""
    if node.op != "where" or graph.node(node.cond).op != "logical_not":
        return None
    same = graph.node(graph.node(node.cond).inputs[0])
    if same.op != "equal" or same.inputs[0] != same.inputs[1] or graph.node(same.inputs[0]).op != "sub":
        return None
    d = graph.node(same.inputs[0])
    x, y = d.inputs
    total, main = graph.node(node.x), graph.node(node.y)
    if total.op != "add" or set(total.inputs) != {x, y} or main.op != "add":
        return None
    tops = [graph.node(i) for i in main.inputs]
    top = next((t for t in tops if t.op == "maximum" and set(t.inputs) == {x, y}), None)
    rest = next((t for t in tops if t is not top), None)
    chain = ["log1p", "exp", "neg", "abs"]
    while rest is not None and chain and rest.op == chain[0]:
        chain.pop(0)
        rest = graph.node(rest.inputs[0]) if chain else rest
    if top is None or chain or rest is None or rest.op != "abs" or rest.inputs[0] != d.name:
        return None
    return x, y


def _same_axis(shape: Sequence[int], a: int, b: int) -> bool:
    """Axes ``a`` and ``b`` of the scores reduce alike: the same axis, or both of size 1 (one key: the identity)."""
    return a == b or shape[a] == shape[b] == 1


def _same(a: Layout | None, b: Layout | None) -> bool:
    return a is not None and b is not None and [la.normalize(x) for x in a] == [la.normalize(x) for x in b]


def _roles(attention: Attention) -> Layout:
    """The matcher's scores layout ([B, Hq, S, T] roles 0..3) with the keys renamed :data:`KEYS`."""
    assert attention.scores_layout is not None
    return tuple(
        tuple(Atom(KEYS, a.size, a.stride) if a.axis == 3 else a for a in atoms) for atoms in attention.scores_layout
    )


class _Algebra:
    """Reads values as :class:`Val`; with ``parts`` (proven), with layouts in roles, else discovering the parts."""

    def __init__(self, graph: Graph, parts: dict[str, Part] | None = None) -> None:
        self.g = graph
        self.proof = parts is not None
        self.parts: dict[str, Part] = parts if parts is not None else {}
        self.memo: dict[str, Read] = {}
        self.path = _ScorePath(graph)
        self.visits = 0

    # ------------------------------------------------------------------ helpers

    def value(self, name: str, depth: int = 0) -> Read:
        if name in self.memo:
            return self.memo[name]
        if depth > MAX_DEPTH or self.visits > MAX_NODES:
            return None  # read no further back: opaque (not memoized)
        self.visits += 1
        found = self._value(self.g.node(name), depth + 1)
        self.memo[name] = found
        return found

    def is_scores(self, value: str) -> bool:
        """Does ``value`` come from a q·kᵀ matmul through the steps a scores path may hold (score_path)?"""
        return self.path.reaches_matmul(value)

    def fail(self, node: Node, reason: str, message: str, operands: Sequence[Read]) -> Fail | None:
        """A failure at ``node`` when its operands read exps (a candidate's); else None (opaque, not a candidate)."""
        known = [o for o in operands if o is not None]
        if not any(o.leaves for o in known):
            return None
        return Fail(
            reason,
            message,
            node.name,
            frozenset().union(*(o.parts for o in known)),
            frozenset().union(*(o.leaves for o in known)),
            any(o.vec if isinstance(o, Fail) else o.kind == "vec" for o in known),
            any(isinstance(o, Fail) and o.combine for o in known),
        )

    def passed_on(self, node: Node, failed: Fail, operands: Sequence[Read]) -> Fail:
        """An operand's failure, with every operand's parts and leaves (the candidate it belongs to)."""
        merged = self.fail(node, failed.reason, failed.message, operands)
        assert merged is not None
        return replace(merged, node=failed.node, combine=merged.combine or failed.combine)

    def layout_of(self, node: Node, operands: Sequence[Val]) -> Layout | str | None:
        if not self.proof:
            return None
        lays = [o.layout for o in operands if o.layout is not None]
        return _merge(node.type.shape, lays) if lays else None

    # ------------------------------------------------------------------ reading one value

    def _value(self, node: Node, depth: int) -> Read:
        g = self.g
        if node.type.dtype.is_float:
            c = scalar_constant(g, node.name)
            if c is not None:
                return Val("const", value=c)
        if is_transparent(g, node):
            x = self.value(node.inputs[0], depth)
            if isinstance(x, Val) and x.kind == "const":
                return replace(x, value=float(rounded(x.value, node.type.dtype))) if node.op == "cast" else x
            if not isinstance(x, Val) or x.layout is None or node.op == "cast":
                return x
            layout = replay([node], x.layout)
            if layout is None:
                return self.fail(node, "uneven_reshape", f"reshape {node.name} mixes axes unevenly", [x])
            return replace(x, layout=layout)
        if node.op in ("exp", "softmax"):
            return self._exp(node, depth)
        if node.op == "sum":
            return self._sum(node, depth)
        if node.op == "max":
            return self._max(node)
        if node.op == "matmul":
            return self._matmul(node, depth)
        if node.op in ("neg", "log"):
            return self._unary(node, depth)
        if node.op in ("add", "sub", "mul", "div", "maximum", "minimum", "logaddexp"):
            return self._binary(node, depth)
        spelled = _jax_logaddexp(g, node)
        if spelled is not None:
            return self._binary(node, depth, spelled, "logaddexp")
        return None  # any other op: opaque (its readers that meet exps fail)

    def _exp(self, node: Node, depth: int) -> Read:
        """A leaf (exps of a part's scores: ``exp(s - row max)``, ``exp(s)``, ``softmax(s)``) or ``exp`` of a
        row scalar."""
        g = self.g
        if node.op == "softmax":
            if not self.is_scores(node.x):
                return None
            return self._leaf(node, node.x, Form.lse([node.x]), node.attrs["axis"] % node.type.rank, True)
        y = g.node(node.inputs[0])
        while is_float_cast(g, y):
            y = g.node(y.inputs[0])
        if y.op == "sub" and self.is_scores(y.x) and not self.is_scores(y.y):
            axis = reduced_axis(g, y.y, "max", y.x)
            if isinstance(axis, int) and y.type.shape == g.node(y.x).type.shape:
                shift = self.value(y.y, depth)
                if isinstance(shift, Val) and shift.kind == "log":
                    return self._leaf(node, y.x, shift.form, axis, True)
        if self.is_scores(y.name):  # exp(s) without a max (or minus what is not its row max: part of the scores)
            return self._leaf(node, y.name, Form(), None, False)
        x = self.value(node.inputs[0], depth)
        if isinstance(x, Val) and x.kind == "const":
            return Val("const", value=math.exp(x.value))
        if isinstance(x, Val) and x.kind == "log":
            return replace(x, kind="pos")
        if x is None or isinstance(x, Fail):
            return x
        return self.fail(node, "normalizer_mismatch", f"exp {node.name} of {x.kind} {node.inputs[0]}", [x])

    def _leaf(self, node: Node, scores: str, shift: Form, axis: int | None, max_subtracted: bool) -> Read:
        g = self.g
        part = self.parts.get(scores)
        if part is None:
            if self.proof:
                why = f"{node.name} exponentiates {scores}, not a part's scores"
                return Fail("normalizer_mismatch", why, node.name, leaves=frozenset({node.name}))
            part = self.parts[scores] = Part(scores)
        if node.type.shape != g.node(scores).type.shape:
            why = f"{node.name} broadcasts the scores {scores}"
            return Fail("not_softmax", why, node.name, frozenset({scores}), frozenset({node.name}))
        if not self.proof:
            part.leaves.add(node.name)
            part.max_subtracted = part.max_subtracted and max_subtracted
        if axis is not None:
            if part.axis is not None and not _same_axis(g.node(scores).type.shape, part.axis, axis):
                return Fail(
                    "normalizer_mismatch",
                    f"{node.name} normalises {scores} over its axis {axis}, another of its exps over axis {part.axis}",
                    node.name, frozenset({scores}), frozenset({node.name}),
                )  # fmt: skip
            part.axis = axis
        layout = part.layout if self.proof else la.root_layout(g.node(scores).type.shape)
        return Val("exps", shift, frozenset({scores}), layout, frozenset({node.name}))

    def _sum(self, node: Node, depth: int) -> Read:
        x = self.value(node.inputs[0], depth)
        if not isinstance(x, Val):
            return x
        axes = sorted({a % self.g.node(node.inputs[0]).type.rank for a in node.attrs["axes"]})
        if x.kind != "exps":
            return self.fail(
                node,
                "normalizer_mismatch",
                f"sum {node.name} adds up a {x.kind} value ({node.inputs[0]}), not a part's exps over its keys",
                [x],
            )
        (p,) = x.parts
        part = self.parts[p]
        kept: Layout | None = None
        if self.proof:
            assert part.attention is not None and x.layout is not None
            kept = _reduce(x.layout, axes, node.attrs["keepdims"], KEYS, part.attention.figures["kv_len"])
            if kept is None:
                return self.fail(
                    node,
                    "normalizer_mismatch",
                    f"sum {node.name} over axes {axes} does not add the exps of {p} over exactly its keys "
                    f"(the axes walk {', '.join(_role(a) for ax in axes for a in x.layout[ax]) or 'nothing'})",
                    [x],
                )
        else:
            shape = self.g.node(p).type.shape
            axis = _whole_axis(x.layout, axes, shape) if x.layout is not None else None
            if axis is None or (part.axis is not None and not _same_axis(shape, part.axis, axis)):
                what = "no one whole axis" if axis is None else f"axis {axis}, not the keys' axis {part.axis}"
                return self.fail(node, "normalizer_mismatch", f"sum {node.name} adds the exps of {p} over {what}", [x])
            part.axis = axis
        return Val("pos", Form.lse([p]) - x.form, x.parts, kept, x.leaves)

    def _max(self, node: Node) -> Read:
        """A row max of a part's scores: an opaque row scalar (the shift its exps subtract)."""
        g = self.g
        chain, n = [], g.node(node.inputs[0])
        while n.name not in self.parts and is_transparent(g, n):
            chain.append(n)
            n = g.node(n.inputs[0])
        if not self.proof:
            return Val("log", Form.of(("n", node.name))) if self.is_scores(node.inputs[0]) else None
        if n.name not in self.parts:
            return None
        part = self.parts[n.name]
        assert part.attention is not None and part.layout is not None
        layout = replay(chain[::-1], part.layout)
        axes = sorted({a % g.node(node.inputs[0]).type.rank for a in node.attrs["axes"]})
        kept = (
            None
            if layout is None
            else _reduce(layout, axes, node.attrs["keepdims"], KEYS, part.attention.figures["kv_len"])
        )
        if kept is None:
            return None  # not a row max of a part: opaque (its readers that meet exps fail)
        return Val("log", Form.of(("n", node.name)), layout=kept)

    def _matmul(self, node: Node, depth: int) -> Read:
        """P·V: one side (through layout ops, casts, scales by row scalars) reads a part's exps."""
        failed: Read = None
        for side in (0, 1):
            if self.g.node(walk(self.g, node.inputs[side]).root).op not in ("exp", "softmax", "div", "mul"):
                continue
            x = self.value(node.inputs[side], depth)
            if isinstance(x, Val) and x.kind == "exps":
                return self._pv(node, side, x)
            if isinstance(x, Fail):
                failed = replace(x, vec=True)
            elif isinstance(x, Val):
                failed = self.fail(node, "normalizer_mismatch", f"matmul {node.name} reads a {x.kind} value", [x])
        return failed

    def _pv(self, node: Node, side: int, x: Val) -> Read:
        g = self.g
        (p,) = x.parts
        part = self.parts[p]
        root = walk(g, node.inputs[side]).root
        if part.pv not in (None, node.name):
            return self.fail(
                node, "normalizer_mismatch", f"the exps of {p} reach two products, {part.pv} and {node.name}", [x]
            )
        layout = None
        if self.proof:
            assert part.attention is not None
            at_root = self.value(root)
            if part.p_root != root or not (isinstance(at_root, Val) and _same(at_root.layout, part.layout)):
                return self.fail(node, "normalizer_mismatch", f"{root} is not the exps of {p} as proven", [x])
            layout = part.attention.out_layout
        else:
            part.pv, part.p_root = node.name, root
        return Val("vec", Form.lse([p]) - x.form, x.parts, layout, x.leaves)

    def _unary(self, node: Node, depth: int) -> Read:
        x = self.value(node.inputs[0], depth)
        if not isinstance(x, Val):
            return x
        if node.op == "neg" and x.kind in ("log", "const"):
            return replace(x, form=-x.form, value=-x.value)
        if node.op == "log" and x.kind == "pos":
            return replace(x, kind="log", logged=x.logged or any(sym[0] == "L" for sym, _c in x.form.terms))
        if node.op == "log" and x.kind == "const" and x.value > 0:
            return replace(x, value=math.log(x.value))
        return self.fail(node, "normalizer_mismatch", f"{node.op} {node.name} of a {x.kind} value", [x])

    def _binary(self, node: Node, depth: int, operands: Sequence[str] | None = None, op: str | None = None) -> Read:
        """``node`` (or ``op`` of ``operands``: a spelled-out logaddexp) on two values."""
        a, b = (self.value(i, depth) for i in operands or node.inputs)
        if a is None and b is None:
            return None
        failed = next((x for x in (a, b) if isinstance(x, Fail)), None)
        if failed is not None:
            return self.passed_on(node, failed, [a, b])
        if a is None or b is None:
            known, other = (a, node.y) if b is None else (b, node.x)
            return self.fail(
                node,
                "normalizer_mismatch",
                f"{node.op} {node.name} combines a {known.kind} value with {other}, which is not a row scalar "
                "of the parts (an extra term or factor)",
                [a, b],
            )
        assert isinstance(a, Val) and isinstance(b, Val)
        if a.kind == b.kind == "const":
            return self._constant(node, a.value, b.value)
        op = op or node.op
        found = self._combined(node, op, a, b)
        if isinstance(found, str):
            failed = self.fail(node, "normalizer_mismatch", f"{op} {node.name}: {found}", [a, b])
            steps = op in ("add", "logaddexp") and {a.kind, b.kind} & {"pos", "vec"}  # a combine's sum failed
            return None if failed is None else replace(failed, combine=failed.combine or bool(steps))
        if isinstance(found, Fail):
            return found
        layout = self.layout_of(node, [a, b])
        if isinstance(layout, str):
            return self.fail(node, "normalizer_mismatch", f"{op} {node.name}: {layout}", [a, b])
        if not self.proof and found.kind == "exps":  # discovering: an exps keeps the scores' own axes
            layout = (a if a.kind == "exps" else b).layout
            layout = None if layout is None else la.broadcast(layout, node.type.shape)
        leaves, parts = a.leaves | b.leaves, a.parts | b.parts if found.kind in ("log", "pos") else found.parts
        return replace(found, layout=layout, leaves=leaves, parts=parts, logged=a.logged or b.logged)

    def _constant(self, node: Node, x: float, y: float) -> Read:
        ops = {"add": x + y, "sub": x - y, "mul": x * y, "maximum": max(x, y), "minimum": min(x, y)}
        if node.op == "div" and y != 0:
            ops["div"] = x / y
        if node.op not in ops:
            return None
        return Val("const", value=float(rounded(ops[node.op], node.type.dtype)))

    def _combined(self, node: Node, op: str, a: Val, b: Val) -> Val | Fail | str:
        """The rules of the module docstring for ``a op b`` (each a non-const or a constant)."""
        kinds = {a.kind, b.kind}
        logs = {"log", "const"}
        zero = next((x for x in (a, b) if x.kind == "const" and x.value == 0), None)
        if op == "add" and zero is not None and kinds != {"log", "const"}:
            return b if a is zero else a  # 0 + x: a running sum's start (MaxText's, Python's sum)
        if op in ("maximum", "minimum") and kinds <= logs:
            c = next((x for x in (a, b) if x.kind == "const"), None)
            if op == "maximum" and c is not None and c.value == -math.inf:  # a clamp: the identity on numbers
                return b if a is c else a
            return Val("log", Form.of(("n", node.name)))  # another row scalar, opaque
        if op in ("add", "sub") and kinds <= logs:
            fa, fb = (x.form if x.kind == "log" else Form(const=x.value) for x in (a, b))
            return Val("log", fa + fb if op == "add" else fa - fb)
        if op == "logaddexp" and kinds <= logs:
            return (
                self._sum_of_exps(
                    a.form if a.kind == "log" else Form(const=a.value),
                    b.form if b.kind == "log" else Form(const=b.value),
                )
                or "log(exp(x) + exp(y)) of row scalars that are not two parts' log-sum-exps shifted alike"
            )
        pos = {"pos", "const"}
        if kinds <= pos and op in ("mul", "div", "add"):
            fa, fb = (self._as_pos(x) for x in (a, b))
            if fa is None or fb is None:
                return "a constant that is not positive and finite used as a weight"
            if op == "add":
                found = self._sum_of_exps(fa, fb)
                if found is None:
                    return (
                        f"adds exp({fa}) and exp({fb}): not the sums of disjoint parts' exps weighed alike "
                        "(exp(lse_i + c))"
                    )
                return Val("pos", found.form)
            return Val("pos", fa + fb if op == "mul" else fa - fb)
        for mat, row, first in ((a, b, True), (b, a, False)):
            if mat.kind not in ("exps", "vec") or row.kind not in pos or op not in ("mul", "div"):
                continue
            f = self._as_pos(row)
            if f is None:
                return "a constant that is not positive and finite used as a weight"
            if op == "mul":
                return replace(mat, form=mat.form - f if mat.kind == "exps" else mat.form + f)
            if op == "div" and first:
                return replace(mat, form=mat.form + f if mat.kind == "exps" else mat.form - f)
        if op == "add" and a.kind == b.kind == "vec":
            sa, ra = a.parts, a.form - Form.lse(a.parts)
            sb, rb = b.parts, b.form - Form.lse(b.parts)
            if sa & sb or ra != rb:
                why = "parts in common" if sa & sb else f"weights exp({a.form}) and exp({b.form})"
                return (
                    f"adds attentions over {'+'.join(sorted(sa))} and {'+'.join(sorted(sb))} with {why}: not a combine"
                )
            return Val("vec", Form.lse(sa | sb) + ra, sa | sb)
        return f"{a.kind} {op} {b.kind} is not a step of a normalisation or a combine"

    @staticmethod
    def _as_pos(x: Val) -> Form | None:
        if x.kind == "pos":
            return x.form
        if x.kind == "const" and 0 < x.value < math.inf:
            return Form(const=math.log(x.value))
        return None

    @staticmethod
    def _sum_of_exps(fa: Form, fb: Form) -> Val | None:
        """``log(exp(fa) + exp(fb))`` when ``fa = L_S + c`` and ``fb = L_T + c``, S and T disjoint: ``L_{S∪T} + c``."""
        sa, sb = fa.split_lse(), fb.split_lse()
        if sa is None or sb is None or sa[0] & sb[0] or sa[1] != sb[1]:
            return None
        return Val("log", Form.lse(sa[0] | sb[0]) + sa[1])


# ---------------------------------------------------------------------- proving a candidate


def _prove(graph: Graph, root: Node, found: _Algebra, value: Val) -> PartialAttention | Decline:
    """``root`` (read as ``vec(S, 0)`` by ``found``) as one sdpa over the parts ``S``, or why not."""
    parts: dict[str, Part] = {}
    order = {n.name: i for i, n in enumerate(graph.nodes())}
    for p in sorted(value.parts, key=order.__getitem__):  # the keys concatenated in the source's order
        seen = found.parts[p]
        if seen.axis is None or seen.pv is None or seen.p_root is None:
            return Decline("normalizer_mismatch", f"the exps of {p} are never summed over one axis", root.name)
        x, r = graph.node(p), graph.node(seen.p_root)
        if r.type.shape != x.type.shape:
            return Decline("normalizer_mismatch", f"P·V reads {r.name} : {r.type}, not exps of {p}", r.name)
        softmax = Node(
            r.name, "softmax", (p,), {"axis": seen.axis, "precise": False}, TensorType(x.type.shape, r.type.dtype)
        )
        attention = match_attention(_Overlay(graph, {r.name: softmax}), graph.node(seen.pv))  # type: ignore[arg-type]
        if not isinstance(attention, Attention):
            why = attention or Decline("not_attention", f"{seen.pv} is not P·V of {p}", seen.pv)
            return replace(why, message=f"part {p} (the scores of {seen.pv}): {why.message}")
        parts[p] = Part(p, set(seen.leaves), seen.axis, seen.max_subtracted, seen.pv, seen.p_root, attention)
        parts[p].layout = _roles(attention)
    proof = _Algebra(graph, parts)
    final = proof.value(root.name)
    if isinstance(final, Fail):
        return Decline(final.reason, final.message, final.node)
    if not (isinstance(final, Val) and final.kind == "vec" and final.parts == value.parts and not final.form):
        return Decline("normalizer_mismatch", f"{root.name} is not the attention over {sorted(value.parts)}", root.name)
    attentions = [parts[p].attention for p in parts]
    first = attentions[0]
    assert first is not None and final.layout is not None
    atoms = [a for axis in final.layout for a in axis]
    if any(a.axis is None or a.axis > DV for a in atoms) or any(
        not la.covers([a for a in atoms if a.axis == role], n) for role, n in enumerate(_out_sizes(first))
    ):
        return Decline("normalizer_mismatch", f"{root.name} does not hold every output row and value once", root.name)
    checked = _check_parts(graph, root, [(p, parts[p]) for p in parts], final.logged)
    if isinstance(checked, Decline):
        return checked
    masks, notes = checked
    return _result(graph, root, [(p, parts[p]) for p in parts], masks, notes, final.layout)


def _out_sizes(attention: Attention) -> tuple[int, int, int, int]:
    """[B, Hq, S, Dv] of the attention's output (P·V's roles)."""
    sizes = [1, 1, 1, 1]
    for axis in attention.out_layout:
        for a in axis:
            sizes[a.axis] *= a.size
    return tuple(sizes)  # type: ignore[return-value]


def _check_parts(
    graph: Graph, root: Node, parts: list[tuple[str, Part]], logged: bool
) -> tuple[tuple[MaskPlan, ...], list[str]] | Decline:
    """What the one sdpa needs of the parts (one part: its own; a combine: the same queries, scale, ...), and the
    parts' masks as the sdpa applies them."""
    notes: list[str] = []
    atts = [part.attention for _p, part in parts]
    assert all(a is not None for a in atts)
    if len(parts) == 1:
        (p, part), (a,) = parts[0], atts
        assert a is not None
        mask = a.mask
        if not part.max_subtracted:
            dtypes = {graph.node(n).type.dtype for n in part.leaves}
            exp_dtype = DType.float16 if DType.float16 in dtypes else min(dtypes, key=lambda d: d.value)
            lo, hi = math.log(float(exp_dtype.finfo.tiny)), math.log(float(exp_dtype.finfo.max))
            if exp_dtype is DType.float16:
                return Decline(
                    "inexact",
                    f"exp({p}) without subtracting its row max in float16 overflows for scores above {hi:.4g} "
                    "(and loses all precision below -9.7): declined, sdpa would be finite where the source is not",
                    min(part.leaves),
                )
            notes.append(
                f"exp({p}) without its row max: the same function while every row's highest score lies in "
                f"[{lo:.4g}, {hi:.4g}) ({exp_dtype.short}); beyond it the source overflows or underflows (inf, "
                "0/0) where sdpa is finite; a row without keys stays NaN (0/0 in the source)"
            )
            if mask.bools:
                mask = replace(mask, nan_rows=True)
        return (mask,), notes
    first = atts[0]
    assert first is not None
    for (p, part), a in zip(parts[1:], atts[1:]):
        assert a is not None
        what = f"part {p} ({part.pv}) and part {parts[0][0]} ({parts[0][1].pv})"
        heads = [(x.figures["kv_heads"], x.figures["head_dim"], _out_sizes(x)[3]) for x in (a, first)]
        checks = [
            (a.q != first.q, f"read different queries ({a.q.root} and {first.q.root}, or other layouts or casts)"),
            (a.scale != first.scale, f"have scales {a.scale:g} and {first.scale:g}"),
            (a.softcap != first.softcap, f"have soft-caps {a.softcap} and {first.softcap}"),
            (a.dtype != first.dtype, f"compute P·V in {a.dtype.short} and {first.dtype.short}"),
            (heads[0] != heads[1], f"have (KV heads, head dim, value dim) {heads[0]} and {heads[1]}"),
        ]
        mismatch = next((why for differ, why in checks if differ), None)
        if mismatch:
            return Decline("combine_mismatch", f"{what} {mismatch}: not one attention's parts", root.name)
    for (p, part), a in zip(parts, atts):
        assert a is not None
        if not part.max_subtracted:
            return Decline(
                "combine_mismatch",
                f"part {p} computes exp(s) without subtracting its row max: its rows without keys are 0/0",
                root.name,
            )
        if a.sinks is not None:
            return Decline(
                "combine_mismatch", f"part {p} has sinks: a combine would count them once per part", root.name
            )
        if a.mask.additive is not None or a.mask.nan_rows:
            kind = "an additive mask" if a.mask.additive is not None else "a bool mask filled with -inf"
            return Decline(
                "rows_without_keys",
                f"part {p} has {kind}: a row it leaves without a key (all -inf) is NaN in the source, while one "
                "sdpa over all the parts' keys attends the other parts' keys there",
                root.name,
            )
    if logged and all(a.mask.bools for a in atts if a is not None):
        return Decline(
            "rows_without_keys",
            "the combine weighs the parts by log-sum-exps computed as max + log(sum), and every part has a bool mask "
            "with a finite fill: a row every part leaves without a key has max = fill, which absorbs log(sum) = "
            "ln T_i, so the source weighs the parts' means of V equally, where one sdpa takes the mean of all the "
            "values",
            root.name,
        )
    fills = {repr(f) for a in atts if a is not None for f in a.mask.finite_fills}
    if len(fills) > 1:
        return Decline(
            "combine_mismatch",
            f"the parts fill masked scores with {', '.join(sorted(fills))}: a row every part leaves without a key "
            "then weighs only the keys of the larger fill, where one sdpa gives it the mean of V",
            root.name,
        )
    overlap = _overlap(graph, [(p, a) for (p, _part), a in zip(parts, atts) if a is not None])
    if overlap:
        return Decline("keys_overlap", overlap, root.name)
    return tuple(a.mask for a in atts if a is not None), notes


def _cells(graph: Graph, value: str) -> tuple[str, list[tuple[int, int]]] | None:
    """``value`` as ``(source, [start, stop) per axis)``: a chain of unit-step slices of ``source`` (or itself);
    None for a slice with steps (not compared)."""
    node = graph.node(value)
    bounds = [(0, n) for n in node.type.shape]
    while node.op == "slice":
        if set(node.attrs["step"]) != {1}:
            return None
        bounds = [(s + lo, s + hi) for (lo, hi), s in zip(bounds, node.attrs["start"])]
        node = graph.node(node.inputs[0])
    return node.name, bounds


def _overlap(graph: Graph, parts: list[tuple[str, Attention]]) -> str | None:
    """Why two parts' keys are not provably disjoint: the same tensor, or slices of one that intersect."""
    for i, (p, a) in enumerate(parts):
        for q, b in parts[i + 1 :]:
            ca, cb = _cells(graph, a.k.root), _cells(graph, b.k.root)
            if ca is None or cb is None:
                return f"parts {p} and {q} read keys {a.k.root} and {b.k.root} through strided slices: not compared"
            if (
                ca[0] == cb[0]
                and len(ca[1]) == len(cb[1])
                and all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(ca[1], cb[1]))
            ):
                return (
                    f"parts {p} and {q} read keys {a.k.root} and {b.k.root} that share cells of {ca[0]}: the "
                    "combine weighs those keys twice (an attention over the concatenation, not over disjoint "
                    "key sets)"
                )
    return None


def _result(
    graph: Graph,
    root: Node,
    parts: list[tuple[str, Part]],
    masks: tuple[MaskPlan, ...],
    notes: list[str],
    layout: Layout,
) -> PartialAttention:
    atts = tuple(part.attention for _p, part in parts)
    assert all(a is not None for a in atts)
    first = atts[0]
    assert first is not None
    lens = [a.figures["kv_len"] for a in atts]  # type: ignore[union-attr]
    if len(parts) == 1:
        form = (
            "deferred normalisation ((exp(s - m)·v) / sum(exp(s - m)))"
            if parts[0][1].max_subtracted
            else ("deferred normalisation without the row max ((exp(s)·v) / sum(exp(s)))")
        )
        summary = f"{form}: {first.summary}; the source normalises after P·V, sdpa before it (rounding only)"
    else:
        shown = ", ".join(f"{a.k.root}/{a.v.root} ({t} keys)" for a, t in zip(atts, lens))  # type: ignore[union-attr]
        summary = (
            f"log-sum-exp combine of {len(parts)} attentions over disjoint keys {shown} -> one sdpa over their "
            f"{sum(lens)} keys concatenated; q {first.q.root}, scale {first.scale:g}; "
            f"mask {_masks_shown(atts)}{_fill_note(atts)}; the source combines rounded partials, sdpa "
            "attends once (rounding only)"
        )
        if any(a.figures["rounding"] for a in atts):  # type: ignore[union-attr]
            steps = ", ".join(
                f"{a.figures['qk_dtype']}/{a.figures['softmax_dtype']}/{a.figures['dtype']}" for a in atts
            )  # type: ignore[union-attr]
            summary += f"; rounding: the parts compute q·kᵀ/exp/P·V in {steps}; sdpa({first.dtype.short}) rounds as its target does"
    summary += "".join(f"; {n}" for n in notes)
    figures = {
        **first.figures,
        "parts": len(parts),
        "kv_lens": lens,
        "kv_len": sum(lens),
        "k": [a.k.root for a in atts],  # type: ignore[union-attr]
        "v": [a.v.root for a in atts],  # type: ignore[union-attr]
        "max_subtracted": all(part.max_subtracted for _p, part in parts),
        "root": root.name,
    }
    return PartialAttention(root, atts, masks, layout, summary, figures)  # type: ignore[arg-type]


def _masks_shown(atts: Sequence[Attention]) -> str:
    shown = [" and ".join(f"{r} (bool)" for r, _s in a.mask.bools) or "none" for a in atts]
    return ", ".join(shown) if any(s != "none" for s in shown) else "none"


def _fill_note(atts: Sequence[Attention]) -> str:
    fills = sorted({f for a in atts for f in a.mask.finite_fills})
    return "".join(
        f"; fill {f!r} masks exactly while every row's highest unmasked score is >= {f + UNDERFLOW!r}" for f in fills
    )


# ---------------------------------------------------------------------- the candidates
#
# A deferred normalisation is decided at its last div (or mul); a combine at its last step (the value read as
# the attention over two or more parts, or the step where their algebra fails). A part of a combine is left to
# the combine: neither it nor its P·V is raised alone (the parts' exps and sums feed the combine's weights too,
# so raising one part alone would save nothing), and one remark, the combine's, says what became of them.

STEPS = frozenset({"add", "sub", "mul", "div"})  # between the products of a combine and its last step


def _reads_exp(graph: Graph, value: str, depth: int) -> bool:
    node = graph.node(walk(graph, value).root)
    if node.op in ("exp", "softmax"):
        return True
    return depth > 0 and node.op in ("div", "mul") and any(_reads_exp(graph, x, depth - 1) for x in node.inputs)


def _products(graph: Graph, value: str, budget: int = 48) -> set[str]:
    """Cheap filter: the matmuls with an exp or softmax on one side that ``value`` reads through layout ops, casts
    and arithmetic steps (at most ``budget`` values looked at)."""
    found: set[str] = set()
    seen, stack = set(), [value]
    while stack and len(seen) < budget:
        name = walk(graph, stack.pop()).root
        if name in seen:
            continue
        seen.add(name)
        node = graph.node(name)
        if node.op == "matmul":
            if any(_reads_exp(graph, x, 2) for x in node.inputs):
                found.add(name)
        elif node.op in STEPS:
            stack.extend(node.inputs)
    return found


def _single(found: Read) -> bool:
    return (isinstance(found, Val) and found.kind == "vec" and len(found.parts) == 1) or (
        isinstance(found, Fail) and found.vec and len(found.parts) <= 1
    )


def _several(found: Read) -> bool:
    """A combine: the attention over two or more parts, or a combine's step that the algebra cannot read."""
    return (isinstance(found, Val) and found.kind == "vec" and len(found.parts) > 1) or (
        isinstance(found, Fail) and found.vec and found.combine and len(found.parts) > 1
    )


def _feeds_combine(graph: Graph, node: Node, algebra: _Algebra, *, or_division: bool = False) -> bool:
    """Does ``node``'s value reach, through the algebra's steps, one that reads two or more parts' products (or,
    with ``or_division``, a div or mul of one part's product: a deferred normalisation's candidate)?"""
    seen, queue = {node.name}, deque([node.name])
    while queue and len(seen) < MAX_FORWARD:
        for user in graph.users(queue.popleft()):
            if user.name in seen:
                continue
            seen.add(user.name)
            found = algebra.value(user.name)
            if _several(found) or (or_division and user.op in ("div", "mul") and _single(found)):
                return True
            if found is not None:
                queue.append(user.name)
    return False


def feeds_combine(graph: Graph, node: Node) -> bool:
    """Whether ``node`` (an attention's P·V, say) is a part of a log-sum-exp combine, which raises it with the others."""
    return _feeds_combine(graph, node, _Algebra(graph))


def _readers(graph: Graph, node: Node) -> list[Node]:
    """The readers of ``node``, through layout ops and casts."""
    out, queue = [], deque(graph.users(node.name))
    while queue:
        user = queue.popleft()
        if is_transparent(graph, user):
            queue.extend(graph.users(user.name))
        else:
            out.append(user)
    return out


def match_deferred(graph: Graph, node: Node) -> PartialAttention | Decline | None:
    """``node`` (a div or mul) as the deferred normalisation of one attention; None when it is not one's last step
    (or the attention is a part of a combine)."""
    if node.op not in ("div", "mul") or not any(_reads_exp(graph, x, 0) or _products(graph, x, 8) for x in node.inputs):
        return None
    algebra = _Algebra(graph)
    found = algebra.value(node.name)
    if not _single(found) or _feeds_combine(graph, node, algebra):
        return None
    if isinstance(found, Val) and not found.form:
        return _prove(graph, node, algebra, found)
    for user in _readers(graph, node):  # a later step may still normalise it: the last one declines
        if user.op in ("div", "mul") and _single(algebra.value(user.name)):
            return None
    if isinstance(found, Fail):
        return Decline(found.reason, found.message, found.node)
    assert isinstance(found, Val)
    (p,) = found.parts
    return Decline(
        "normalizer_mismatch",
        f"{node.name} is exp({found.form}) times the attention over the keys of {p}: P·V of the exps of {p} is "
        "divided by something other than the sum of the same exps over the keys",
        node.name,
    )


def match_combine(graph: Graph, node: Node) -> PartialAttention | Decline | None:
    """``node`` as the last step of a log-sum-exp combine of two or more partial attentions, as one sdpa; None when
    it reads fewer than two parts' products or a later step still combines them."""
    if not (node.op in STEPS or is_transparent(graph, node)) or len(_products(graph, node.name)) < 2:
        return None
    algebra = _Algebra(graph)
    found = algebra.value(node.name)
    if not _several(found) or any(_several(algebra.value(u.name)) for u in graph.users(node.name)):
        return None
    if isinstance(found, Fail):
        return Decline(found.reason, found.message, found.node)
    assert isinstance(found, Val)
    if found.form:
        return Decline(
            "normalizer_mismatch",
            f"{node.name} is exp({found.form}) times the attention over the keys of "
            f"{' and '.join(sorted(found.parts))}: the combine's weights do not sum to one",
            node.name,
        )
    return _prove(graph, node, algebra, found)


def unnormalized_product(graph: Graph, pv: Node) -> Decline | None:
    """Why P·V of ``exp(s - m)`` (no softmax) is left as it is: the ``attention`` rule's remark for a product that
    nothing divides or weighs (a deferred normalisation's or a combine's product: their remark)."""
    for x in pv.inputs:
        root = graph.node(walk(graph, x).root)
        if root.op != "exp":
            continue
        algebra = _Algebra(graph)
        found = algebra.value(root.name)
        if isinstance(found, Val) and found.kind == "exps" and not _feeds_combine(graph, pv, algebra, or_division=True):
            return Decline(
                "normalizer_mismatch",
                f"P·V reads exp {root.name} of the scores {min(found.parts)} with no softmax: no division by the "
                "sum of the same exps over the keys follows it, and no log-sum-exp combine weighs it",
                root.name,
                1,
            )
    return None


__all__ = [
    "Form", "PartialAttention", "feeds_combine", "match_combine", "match_deferred", "unnormalized_product",
]  # fmt: skip
