"""Canonicalization: fold constants, layout chains, identities, exact casts and common subexpressions.

Imported graphs spell one value many ways; these rules give each value one spelling, so the raising rules see
through them. Every rule is exact: the graph computes bit for bit the same function afterwards.

- ``fold``: an op of constants becomes a constant (by default only ops MLX and JAX compute bit for bit as the
  reference does; ``fold="reference"`` folds transcendental ops too), at most :data:`FOLD_LIMIT` elements;
- layout chains and identities (reshape/transpose/broadcast chains proven on coordinates), exact casts,
  elementwise identities (``x*1``, ``x-0``, ... but not ``x+0.0``), and ``cse``.

Driver: the shared walker, up to :data:`MAX_SWEEPS` sweeps; :func:`canonicalize_rules` gives a fresh rule list
per run. In full (which folds are declined and why): docs/passes.md, "canonicalize".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from attnpass.ir import DType, Graph, Node, TensorType
from attnpass.ir.dialects.evaluate import EVALUATORS, constant, evaluate

from ..analysis import layout_algebra as la
from ..analysis.chains import exact_cast, splat
from ..infra.base import Pass, Remarks
from ..infra.registry import register_pass
from ..infra.rewrite import ANY, Decline, Rewriter, Rule, apply_rules

FOLD_LIMIT = 4096  # elements of a folded constant that is not a splat
MAX_SWEEPS = 8
_NOT_FOLDED = {
    "argpartition": "the order within each side is target-defined",
    "put_along_axis": "which of several writes to one cell wins is target-defined",
}
FOLD_MODES = ("exact", "reference")
# Ops every target computes bit for bit as the reference does: correctly rounded arithmetic, comparisons,
# selection, moves, rounding to integers and arg reductions (exact results). + - * / and sqrt are correctly rounded in IEEE arithmetic; the reference computes them
# in float64 and rounds once, which is the correctly rounded result in float32, bfloat16 and float16 (53 >=
# 2p + 2 bits for each: double rounding is innocuous), and so is what a target gets computing in the dtype
# itself or in float32 and rounding once (24 >= 2p + 2 for bf16 and f16). exp, sin, cos, rsqrt, sigmoid,
# softmax, sum and matmul are computed by each target in its own way (not correctly rounded).
_TARGET_EXACT = frozenset({
    "add", "sub", "mul", "div", "sqrt", "maximum", "neg", "relu", "equal", "less", "greater_equal", "logical_and",
    "logical_or", "where", "cast", "reshape", "transpose", "broadcast_to", "slice", "concat", "take", "max",
    "floor", "ceil", "round", "argmax", "argmin",
})  # fmt: skip
# Exact ops that copy bits (or flip a sign bit) without arithmetic: subnormals and NaNs pass through them alike.
_BIT_COPYING = frozenset({"neg", "where", "cast", "reshape", "transpose", "broadcast_to", "slice", "concat", "take"})
_SIGNED_ZERO_PICKS = frozenset({"maximum", "relu", "max"})  # which of +0.0 and -0.0 they return is target-defined
_VALUE_MOVING = frozenset({"reshape", "transpose", "broadcast_to", "slice"})  # a splat stays that splat


# ----------------------------------------------------------------------------- constants


def _array(node: Node) -> np.ndarray:
    return constant(node.attrs["value"], node.type.shape, node.type.dtype)


def _bits(array: np.ndarray) -> np.ndarray:
    return (
        array.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[array.itemsize])
        if array.dtype.kind not in "biu"
        else array
    )


def _python_values(array: np.ndarray, dtype: DType) -> tuple:
    """A constant's ``value`` attribute for ``array``: one value when every element has the same bits."""
    flat = array.reshape(-1)
    if flat.size and np.all(_bits(flat) == _bits(flat[:1])):
        flat = flat[:1]
    if dtype.is_float:
        return tuple(float(v) for v in flat.astype(np.float64))
    return tuple(bool(v) for v in flat) if dtype is DType.bool else tuple(int(v) for v in flat)


@dataclass(frozen=True)
class _Folded:
    """``node`` is the constant ``values`` of ``shape``, broadcast to the node's shape when that differs."""

    node: Node
    values: tuple
    shape: tuple[int, ...]


def _constant_operand(graph: Graph, value: str, through_broadcast: bool) -> Node | None:
    """The constant node behind ``value``: itself, or (``through_broadcast``) the operand of its broadcast_to."""
    node = graph.node(value)
    if through_broadcast and node.op == "broadcast_to":
        node = graph.node(node.inputs[0])
    return node if node.op == "constant" else None


def _folded(node: Node, array: np.ndarray) -> _Folded:
    values = _python_values(array, node.type.dtype)
    return _Folded(node, values, node.type.shape if len(values) == 1 else array.shape)


def _fold_match(graph: Graph, node: Node, mode: str) -> _Folded | Decline | None:
    """An op of constants, evaluated in the op's dtype with the reference semantics.

    ``mode`` "exact" folds only the ops every target computes bit for bit as the reference does
    (:data:`_TARGET_EXACT`; integer floor division too); "reference" folds every op with an evaluator.

    An elementwise op (or a cast) is evaluated on the shape its operands vary over (a splat is one
    value), looking through ``broadcast_to`` of a constant, and broadcast back; other ops are
    evaluated whole, up to FOLD_LIMIT elements. A layout op of a non-splat constant is evaluated
    whole, except ``broadcast_to``, which would only store repeated values.
    """
    elementwise = node.opdef.family == "elementwise"
    sources = [_constant_operand(graph, i, node.opdef.family != "layout") for i in node.inputs]
    if not sources or None in sources or node.type.size == 0:
        return None
    if node.op not in EVALUATORS:
        return Decline(
            "no_evaluator",
            f"{node.op} of constants is not folded: {_NOT_FOLDED.get(node.op, 'it has no reference evaluator')}",
        )
    if (
        mode == "exact"
        and node.op not in _TARGET_EXACT
        and not (node.op == "floor_divide" and node.type.dtype is DType.int32)
    ):
        return Decline(
            "target_defined",
            f"{node.op} of constants is not folded: MLX and JAX compute {node.op} in their own way, so folding it with "
            "the reference would change the program's last bits (canonicalize{fold=reference} folds it)",
        )
    splats = [len(c.attrs["value"]) == 1 for c in sources]
    if all(splats) and node.op in _VALUE_MOVING:
        return _Folded(node, sources[0].attrs["value"], node.type.shape)
    if node.op == "broadcast_to":
        stored = len(sources[0].attrs["value"])
        return Decline(
            "too_large",
            f"broadcast_to of a constant is not folded: it would store {stored} values {node.type.size // stored} times",
        )
    rank = node.type.rank
    if elementwise or node.op == "cast":
        shapes = [(1,) * rank if one else (1,) * (rank - c.type.rank) + c.type.shape for c, one in zip(sources, splats)]
        core = tuple(np.broadcast_shapes(*shapes))
        operands = [
            _array(c).reshape(-1)[:1].reshape(sh) if one else _array(c).reshape(sh)
            for c, one, sh in zip(sources, splats, shapes)
        ]
    else:
        core = node.type.shape
        operands = [np.broadcast_to(_array(c), graph.node(i).type.shape) for c, i in zip(sources, node.inputs)]
    biggest = max([math.prod(core)] + [a.size for a in operands])
    if biggest > FOLD_LIMIT:
        return Decline(
            "too_large",
            f"{node.op} of constants is not folded: {biggest} elements (more than {FOLD_LIMIT}) and not a splat",
        )
    if node.op == "cast" and node.type.dtype is DType.int32 and operands[0].dtype.kind not in "biu":
        values = operands[0].astype(np.float64)
        if not (np.isfinite(values).all() and (np.abs(values) < 2.0**31).all()):
            return Decline(
                "target_defined",
                "cast of constants to int32 is not folded: a value is not finite or out of range (target-defined)",
            )
    try:
        result = evaluate(node.op, node.attrs, operands, TensorType(core, node.type.dtype))
    except (IndexError, ValueError) as exc:
        return Decline("no_evaluator", f"{node.op} of constants is not folded: evaluating it fails ({exc})")
    if mode == "exact":
        unsure = _target_defined(node.op, operands, result)
        if unsure:
            return Decline("target_defined", f"{node.op} of constants is not folded: {unsure}")
    return _folded(node, result)


def _target_defined(op: str, operands: list[np.ndarray], result: np.ndarray) -> str | None:
    """Why the targets may disagree on the bits of this fold, or None. IEEE pins the rounding of + - * / and
    sqrt, but not subnormals (XLA on CPU flushes them to zero, in arithmetic and in comparisons), not a NaN's
    sign and payload, and not which zero ``max(+0.0, -0.0)`` returns (numpy, MLX and JAX differ)."""
    if op in _BIT_COPYING:
        return None
    floats = [a for a in operands if DType.from_numpy(a.dtype).is_float]
    for array in floats:
        if _subnormal(array):
            return "an operand is subnormal, and targets may flush subnormals to zero (XLA on CPU does)"
    if not DType.from_numpy(result.dtype).is_float:
        return None
    if _subnormal(result):
        return "the result is subnormal, and targets may flush subnormals to zero (XLA on CPU does)"
    if np.isnan(np.asarray(result, np.float64)).any():
        return "the result holds a NaN, whose sign and payload each target chooses"
    if op in _SIGNED_ZERO_PICKS:
        wide = [np.asarray(a, np.float64) for a in floats]
        signs = np.concatenate([np.signbit(v[v == 0]).reshape(-1) for v in wide] + [np.zeros(int(op == "relu"), bool)])
        if signs.any() and not signs.all():
            return "+0.0 and -0.0 meet, and which one it returns differs between targets"
    return None


def _subnormal(array: np.ndarray) -> bool:
    values = np.abs(np.asarray(array, np.float64))
    return bool(((values > 0) & (values < float(DType.from_numpy(array.dtype).finfo.tiny))).any())


def _describe_fold(m: _Folded) -> str:
    shown = f" (broadcast from {list(m.shape)})" if m.shape != m.node.type.shape else ""
    return f"{m.node.op}({', '.join(m.node.inputs)}) of constants -> constant {m.node.type}{shown}"


def _fold_rewrite(rw: Rewriter, m: _Folded) -> None:
    t = m.node.type
    value = rw.op("constant", [], {"value": m.values, "shape": m.shape, "dtype": t.dtype}, f"{m.node.name}_folded")
    rw.replace_matched(rw.broadcast(value, t.shape, f"{m.node.name}_folded"), prune=True)


# ----------------------------------------------------------------------------- layout chains


@dataclass(frozen=True)
class _Forward:
    """Replace ``node`` by ``op(source, attrs)`` (``op`` None: by ``source`` itself, broadcast to the node's shape)."""

    node: Node
    source: str
    op: str | None = None
    attrs: tuple[tuple[str, Any], ...] = ()
    why: str = ""


def _forward(rw: Rewriter, m: _Forward) -> None:
    shape = m.node.type.shape
    if m.op is None:
        value = rw.broadcast(m.source, shape, m.node.name)
    else:
        value = rw.op(m.op, [m.source], dict(m.attrs), m.node.name)
    rw.replace_matched(value, prune=True)


def _describe(m: _Forward) -> str:
    target = m.source if m.op is None else f"{m.op}({m.source})"
    return f"{m.why} -> {target}"


def _producer(graph: Graph, node: Node, op: str) -> Node | None:
    inner = graph.node(node.inputs[0])
    return inner if inner.op == op else None


def _same_shape(graph: Graph, node: Node) -> _Forward | None:
    x = node.inputs[0]
    return _Forward(node, x, why=f"{node.op}({x}) to its own type") if graph.node(x).type == node.type else None


def _reshape_chain(graph: Graph, node: Node) -> _Forward | None:
    inner = _producer(graph, node, "reshape")
    if inner is None:
        return None
    return _Forward(
        node, inner.inputs[0], "reshape", (("shape", node.type.shape),), f"reshape(reshape({inner.inputs[0]}))"
    )


def _broadcast_as_reshape(graph: Graph, node: Node) -> _Forward | None:
    x = graph.node(node.inputs[0])
    if x.type.size != node.type.size or x.type.shape == node.type.shape:
        return None
    return _Forward(
        node, x.name, "reshape", (("shape", node.type.shape),), f"broadcast_to({x.name}) adding unit axes only"
    )


def _broadcast_chain(graph: Graph, node: Node) -> _Forward | None:
    inner = _producer(graph, node, "broadcast_to")
    if inner is None:
        return None
    return _Forward(
        node,
        inner.inputs[0],
        "broadcast_to",
        (("shape", node.type.shape),),
        f"broadcast_to(broadcast_to({inner.inputs[0]}))",
    )


def _transpose_identity(graph: Graph, node: Node) -> _Forward | None:
    perm = node.attrs["perm"]
    return (
        _Forward(node, node.inputs[0], why=f"transpose({node.inputs[0]}) by the identity")
        if list(perm) == sorted(perm)
        else None
    )


def _transpose_chain(graph: Graph, node: Node) -> _Forward | None:
    inner = _producer(graph, node, "transpose")
    if inner is None:
        return None
    perm = tuple(inner.attrs["perm"][p] for p in node.attrs["perm"])
    return _Forward(node, inner.inputs[0], "transpose", (("perm", perm),), f"transpose(transpose({inner.inputs[0]}))")


def _transpose_as_reshape(graph: Graph, node: Node) -> _Forward | None:
    x = graph.node(node.inputs[0])
    perm = node.attrs["perm"]
    moved = [p for p in perm if x.type.shape[p] != 1]
    if list(perm) == sorted(perm) or moved != sorted(moved):
        return None
    return _Forward(
        node, x.name, "reshape", (("shape", node.type.shape),), f"transpose({x.name}) moving unit axes only"
    )


def _whole_slice(graph: Graph, node: Node) -> _Forward | None:
    x = graph.node(node.inputs[0])
    whole = (
        node.attrs["start"] == (0,) * x.type.rank
        and node.attrs["stop"] == x.type.shape
        and set(node.attrs["step"]) <= {1}
    )
    return _Forward(node, x.name, why=f"slice({x.name}) of all of it") if whole else None


def _single_concat(graph: Graph, node: Node) -> _Forward | None:
    return (
        _Forward(node, node.inputs[0], why=f"concat({node.inputs[0]}) of one operand")
        if len(node.inputs) == 1
        else None
    )


@dataclass(frozen=True)
class _Relayout:
    """``node`` is ``root`` reshaped to ``split``, transposed by ``perm`` and reshaped: ``ops`` ops, not ``length``."""

    node: Node
    root: str
    split: tuple[int, ...]
    perm: tuple[int, ...]
    ops: int
    length: int


def _layout_chain(graph: Graph, node: Node) -> _Relayout | None:
    """A chain of reshapes and transposes whose canonical form (reshape, transpose, reshape) is shorter."""
    chain, x = [], node
    while x.op in ("reshape", "transpose"):  # the anchor is any node: other ops give an empty chain
        chain.append(x)
        x = graph.node(x.inputs[0])
    if len(chain) < 3:
        return None
    layout: la.Layout | None = la.root_layout(x.type.shape)
    for n in reversed(chain):
        layout = la.transpose(layout, n.attrs["perm"]) if n.op == "transpose" else la.reshape(layout, n.type.shape)
        if layout is None:
            return None
    perm = _as_transpose(layout, x.type.shape)
    if perm is not None:
        return _Relayout(node, x.name, x.type.shape, perm, int(list(perm) != sorted(perm)), len(chain))
    split, perm = la.view_plan(layout, x.type.shape)
    moved = tuple(split[p] for p in perm)
    ops = (split != x.type.shape) + (list(perm) != sorted(perm)) + (moved != node.type.shape)
    return _Relayout(node, x.name, split, perm, ops, len(chain)) if ops < len(chain) else None


def _as_transpose(layout: la.Layout, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The perm when ``layout`` of a root of ``shape`` is one transpose (unit axes matched in order), else None."""
    if len(layout) != len(shape):
        return None
    units = iter(a for a, n in enumerate(shape) if n == 1)
    perm = []
    for atoms in layout:
        atoms = la.normalize(atoms)
        if not atoms:
            perm.append(next(units, None))
        elif len(atoms) == 1 and atoms[0].stride == 1 and atoms[0].size == shape[atoms[0].axis]:
            perm.append(atoms[0].axis)
        else:
            return None
    return tuple(perm) if sorted(p for p in perm if p is not None) == list(range(len(shape))) else None


def _relayout(rw: Rewriter, m: _Relayout) -> None:
    rw.replace_matched(rw.relayout(m.root, m.split, m.perm, m.node.type.shape, m.node.name), prune=True)


# ----------------------------------------------------------------------------- casts


def _cast_chain(graph: Graph, node: Node) -> _Forward | None:
    inner = _producer(graph, node, "cast")
    if inner is None:
        return None
    x = graph.node(inner.inputs[0])
    if not exact_cast(x.type.dtype, inner.type.dtype):
        return None
    why = f"cast(cast({x.name}, {inner.type.dtype.value}), {node.type.dtype.value}), the inner one exact"
    if x.type.dtype is node.type.dtype:
        return _Forward(node, x.name, why=why)
    return _Forward(node, x.name, "cast", (("dtype", node.type.dtype),), why)


# ----------------------------------------------------------------------------- elementwise identities


def _is(value: np.ndarray | None, target: float | bool) -> bool:
    """Is the splat ``value`` exactly ``target``, sign of zero included?"""
    if value is None or (value.dtype == np.bool_) != isinstance(target, bool):
        return False
    if isinstance(target, bool):
        return bool(value) is target
    v = value.astype(np.float64)
    return bool(v == target) and bool(np.signbit(v)) == bool(np.signbit(np.float64(target)))


def _neutral(graph: Graph, node: Node, target: float | bool, sides: tuple[int, ...]) -> _Forward | None:
    for i in sides:
        if _is(splat(graph, node.inputs[i]), target):
            other = node.inputs[1 - i]
            return _Forward(node, other, why=f"{node.op}({', '.join(node.inputs)}) with the neutral {target!r}")
    return None


def _add_zero(graph: Graph, node: Node) -> _Forward | None:
    """``x + (-0.0)`` on floats; ``x + 0`` on integers."""
    return _neutral(graph, node, -0.0 if node.type.dtype.is_float else 0, (0, 1))


def _where_splat(graph: Graph, node: Node) -> _Forward | None:
    cond = splat(graph, node.cond)
    if cond is None:
        return None
    chosen = node.x if bool(cond) else node.y
    return _Forward(node, chosen, why=f"where({node.cond} = {bool(cond)}, ...)")


# ----------------------------------------------------------------------------- common subexpressions


@dataclass(frozen=True)
class _Same:
    node: Node
    earlier: str


def _attr_key(value: Any) -> Any:
    """Attribute values compared bit for bit (``-0.0`` and ``0.0`` differ)."""
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, (tuple, list)):
        return tuple(_attr_key(v) for v in value)
    return value


class _ValueNumbers:
    """The first node seen per (op, operands, attributes, type) during one run."""

    def __init__(self) -> None:
        self.first: dict[Any, str] = {}

    @staticmethod
    def key(node: Node) -> Any:
        attrs = tuple((k, _attr_key(v)) for k, v in node.attrs.items())
        return (node.op, node.inputs, node.optionals, attrs, node.type)

    def match(self, graph: Graph, node: Node) -> _Same | None:
        """An earlier node computing what ``node`` computes (operands are visited, so numbered, first)."""
        key = self.key(node)
        earlier = self.first.get(key)
        if earlier is not None and earlier != node.name and earlier in graph and self.key(graph.node(earlier)) == key:
            return _Same(node, earlier)
        self.first[key] = node.name
        return None


def _cse_rewrite(rw: Rewriter, m: _Same) -> None:
    rw.replace_matched(m.earlier)


# ----------------------------------------------------------------------------- the rules


def _neutral_rule(name: str, op: str, target: float | bool, sides: tuple[int, ...]) -> Rule:
    return Rule(name, op, lambda g, n: _neutral(g, n, target, sides), _forward, _describe)


RULES: list[Rule] = [
    Rule("reshape-identity", "reshape", _same_shape, _forward, _describe),  # reshape(x) to x's shape -> x
    Rule("reshape-chain", "reshape", _reshape_chain, _forward, _describe),  # reshape(reshape(x)) -> reshape(x)
    Rule("broadcast-identity", "broadcast_to", _same_shape, _forward, _describe),  # broadcast_to(x) to x's shape -> x
    Rule("broadcast-as-reshape", "broadcast_to", _broadcast_as_reshape, _forward, _describe),  # broadcast_to(x) adding unit axes -> reshape(x)
    Rule("broadcast-chain", "broadcast_to", _broadcast_chain, _forward, _describe),  # broadcast_to(broadcast_to(x)) -> broadcast_to(x)
    Rule("transpose-identity", "transpose", _transpose_identity, _forward, _describe),  # transpose(x, identity) -> x
    Rule("transpose-chain", "transpose", _transpose_chain, _forward, _describe),  # transpose(transpose(x)) -> transpose(x)
    Rule("transpose-as-reshape", "transpose", _transpose_as_reshape, _forward, _describe),  # transpose moving unit axes -> reshape(x)
    Rule("layout-chain", ANY, _layout_chain, _relayout,
         lambda m: f"{m.length} reshapes/transposes of {m.root} -> {m.ops}"),  # reshape/transpose chain -> reshape, transpose, reshape
    Rule("slice-identity", "slice", _whole_slice, _forward, _describe),  # x[:, ..., :] -> x
    Rule("concat-identity", "concat", _single_concat, _forward, _describe),  # concat(x) -> x
    Rule("cast-identity", "cast", _same_shape, _forward, _describe),  # cast(x: T, T) -> x
    Rule("cast-chain", "cast", _cast_chain, _forward, _describe),  # cast(cast(x, exact), T) -> cast(x, T)
    _neutral_rule("mul-one", "mul", 1.0, (0, 1)),  # x * 1 -> x
    _neutral_rule("div-one", "div", 1.0, (1,)),  # x / 1 -> x
    _neutral_rule("sub-zero", "sub", 0.0, (1,)),  # x - 0 -> x
    Rule("add-zero", "add", _add_zero, _forward, _describe),  # x + (-0.0) -> x (floats), x + 0 -> x (ints)
    _neutral_rule("and-true", "logical_and", True, (0, 1)),  # x and True -> x
    _neutral_rule("or-false", "logical_or", False, (0, 1)),  # x or False -> x
    Rule("where-splat", "where", _where_splat, _forward, _describe),  # where(True, x, y) -> x; where(False, x, y) -> y
]  # fmt: skip


def canonicalize_rules(fold: str = "exact") -> list[Rule]:
    """``fold`` (a :data:`FOLD_MODES` mode), :data:`RULES` and a fresh ``cse`` (it numbers the values of one run)."""
    numbers = _ValueNumbers()
    return [
        Rule(
            "fold", ANY, lambda g, n: _fold_match(g, n, fold), _fold_rewrite, _describe_fold
        ),  # op(constants) -> constant
        *RULES,
        Rule("cse", ANY, numbers.match, _cse_rewrite, lambda m: f"same as {m.earlier}"),  # op(x) twice -> op(x) once
    ]


def canonicalize(graph: Graph, remarks: Remarks, fold: str = "exact") -> bool:
    """Apply the canonicalization rules to ``graph`` in place; True when it changed."""
    return bool(apply_rules(graph, canonicalize_rules(fold), remarks, max_sweeps=MAX_SWEEPS))


@register_pass
@dataclass(frozen=True)
class Canonicalize(Pass):
    """Fold constants, layout chains, identities, exact casts and common subexpressions (module docstring)."""

    name: ClassVar[str] = "canonicalize"
    fold: str = "exact"

    def __post_init__(self) -> None:
        if self.fold not in FOLD_MODES:
            raise ValueError(f"Canonicalize: fold must be one of {', '.join(FOLD_MODES)}, got {self.fold!r}")

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        return canonicalize(graph, remarks, self.fold)


__all__ = ["FOLD_LIMIT", "FOLD_MODES", "RULES", "Canonicalize", "canonicalize", "canonicalize_rules"]
