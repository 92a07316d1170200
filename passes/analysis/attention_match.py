"""Proving that ``softmax(q·kᵀ·scale + mask)·v`` written with matmuls is an ``sdpa``.

:func:`match_attention` starts at the ``P·V`` matmul, walks the producer
chains of its operands (layout ops, float casts, scalar scales; see
:mod:`.chains`) back to the roots ``q``, ``k``, ``v``, reads the scores path
as algebra (:mod:`.score_path`) and tracks, with :mod:`.layout_algebra`,
which root coordinates every axis walks. It then checks the semantics of
``sdpa`` on those coordinates rather than on op spellings: the contraction
runs over the head dims (the roots' last axes) in order; every score pairs
query row ``(b, h, s)`` with key row ``(b, h // G, t)`` exactly once; the
softmax normalises over exactly the key axis; ``P·V`` pairs key ``t`` with
value row ``t`` of the same KV head; each mask reaches the scores without
reordering its ``[..., S, T]`` axes. Each failure is a :class:`~.rewrite.Decline`: a
reason code, what did not match, where, and how far the check got (``stage``).

Roots are rank 4 (``[B, H, S, D]`` or ``[B, S, H, D]``) or unbatched rank 3
(``[H, S, D]`` or ``[S, H, D]``; sdpa gets them with a unit batch axis in
front), the head dim last; q, k and v are read in their own layouts (mlx-lm's
V is a plain transpose of its projection while Q and K come through norm and
RoPE). Where the matmul proves otherwise, the head dim is what it contracts
(q and k) or keeps (v), wherever it sits in the root after the batch: a
projection computed feature-major (``[H*D, S]``, as JAX writes a vmapped
``W @ x``, equinox's layers) or a k stored transposed reads as ``[B, H, D, S]``;
a head dim spread over several root axes that a reshape merges (interleaved
RoPE's ``[..., D/2, 2]``) reads as one. Scales on q, k and the scores become
sdpa's scale; a scale on v stays in v's root (``P·(v·c)``: v is that
product). sdpa runs in the dtype of the ``P·V`` matmul; roots in other
dtypes are cast to it, and the summary states where the source rounded.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Sequence

from attnpass.ir import DType, Graph, Node

from ..infra.rewrite import Decline
from . import layout_algebra as la
from .chains import Chain, chain_scale, elementwise_steps, exact_cast, replay, scalar_constant, walk
from .layout_algebra import Atom, Layout
from .score_path import UNDERFLOW, MaskUse, ScoreAlgebra, Step, score_algebra, score_steps

ROLE_NAMES = ("b", "h", "s", "t")  # axes of the canonical score tensor [B, Hq, S, T]
Order = tuple[int, int, int]  # the axes of a root's lifted view holding its heads, rows and head dim (batch: 0)


def orders(dim_at: int) -> tuple[Order, Order]:
    """The readings of a view whose head dim is axis ``dim_at``: heads before rows, then rows before heads."""
    first, second = (a for a in (1, 2, 3) if a != dim_at)
    return (first, second, dim_at), (second, first, dim_at)


def order_name(order: Order, rows: str = "s") -> str:
    """``heads-first`` / ``rows-first`` for the head dim last, else the axes spelled out (``[B, H, D, S]``)."""
    heads_at, rows_at, dim_at = order
    if dim_at == 3:
        return "heads-first" if heads_at < rows_at else "rows-first"
    names = ["B", "", "", ""]
    names[heads_at], names[rows_at], names[dim_at] = "H", rows.upper(), "D"
    return "[" + ", ".join(names) + "]"


@dataclass(frozen=True)
class Operand:
    """An sdpa operand: ``root`` reshaped to ``shape4`` (leading 1s for an unbatched root), permuted, then
    the source's own elementwise ``steps`` on its path (casts; for v, scales too) replayed in order."""

    root: str
    shape4: tuple[int, ...]
    perm: tuple[int, ...]
    steps: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class MaskPlan:
    """sdpa's mask: bool roots (and-ed) and one additive root times ``factor``, each with its 4-d shape."""

    bools: tuple[tuple[str, tuple[int, ...]], ...]
    additive: tuple[str, tuple[int, ...], float] | None
    nan_rows: bool = False  # a bool mask filled with -inf: a row with no key is 0/0 = NaN in the source
    finite_fills: tuple[float, ...] = ()  # the finite fills (at the softmax) taken as exact masks


@dataclass(frozen=True)
class Attention:
    """A proven attention: its operands, mask, scale, dtype, the output layout, a summary and its figures."""

    pv: Node
    q: Operand
    k: Operand
    v: Operand
    mask: MaskPlan
    scale: float
    dtype: DType
    out_layout: Layout
    summary: str
    softcap: float | None = None
    sinks: tuple[str, tuple[int, ...]] | float | None = None  # (root, 4-d shape (1, Hq|1, 1, 1)) or a splat value
    figures: Mapping[str, Any] = field(default_factory=dict)  # what the summary states, by name (Remark.data)
    scores_layout: Layout | None = None  # the softmax input's axes as roles of [B, Hq, S, T] (0..3)


@dataclass(frozen=True)
class Root:
    """Where an operand starts: graph ``value`` read as ``view`` (a regrouping of its shape as [B, H, S, D] or
    [B, S, H, D], B = 1 for an unbatched root; the head dim at axis ``dim_at``), the ``nodes`` from it to the
    matmul and their ``scale``."""

    value: str
    view: tuple[int, ...]
    nodes: tuple[Node, ...]
    scale: float
    dim_at: int = 3


def value_roots(graph: Graph, chain: Chain, dim_axis: int) -> list[Root]:
    """The rank-4 and rank-3 values on ``chain``, earliest first, read as they are with the head dim last; then
    those whose axis that the matmul's ``dim_axis`` walks whole is another one after the batch, read with the head
    dim there (after all the others: a value that holds the heads at axis 0 must not pass for the batch)."""
    values = [chain.root] + [n.name for n in chain.nodes]
    found, elsewhere = [], []
    for i, name in enumerate(values):
        shape = graph.node(name).type.shape
        if len(shape) not in (3, 4):
            continue
        root = Root(name, lifted(shape), chain.nodes[i:], chain_scale(graph, chain.nodes[i:]))
        found.append(root)
        layout = replay(root.nodes, la.root_layout(shape))
        atoms = la.normalize(layout[dim_axis]) if layout is not None else ()
        if len(atoms) == 1 and atoms[0].stride == 1 and atoms[0].size == shape[atoms[0].axis]:
            dim_at = atoms[0].axis + 4 - len(shape)
            if dim_at not in (0, 3):
                elsewhere.append(Root(root.value, root.view, root.nodes, root.scale, dim_at))
    return found + elsewhere


def _partitions(factors: Sequence[int], groups: int) -> Iterator[tuple[list[int], set[int]]]:
    """Every split of ``factors`` into ``groups`` contiguous (possibly empty) groups: the groups' products and
    the positions cut between two factors (position i: between factors i - 1 and i)."""
    if groups == 0:
        if not factors:
            yield [], set()
        return
    for cuts in itertools.combinations_with_replacement(range(len(factors) + 1), groups - 1):
        bounds = (0, *cuts, len(factors))
        yield [math.prod(factors[lo:hi]) for lo, hi in zip(bounds, bounds[1:])], set(cuts) - {0, len(factors)}


def _unnatural(axes: Sequence[int | None], cuts: set[int]) -> int:
    """How far a regrouping of factors (of root ``axes``) strays from the root's own axes: cuts inside one root
    axis plus boundaries between two root axes left uncut."""
    return sum((i in cuts) == (axes[i - 1] == axes[i]) for i in range(1, len(axes)))


def view_roots(graph: Graph, chain: Chain, dim_axis: int) -> list[Root]:
    """``chain``'s root read as every rank-4 and rank-3 regrouping of the factors its layout ops split it
    into, the head dim one group: for roots whose [B, H, S, D] form no value on the chain has (a projection
    [S, H*D] that a canonicalized reshape turns straight into [B, S, Hkv, G, D]). The head dim is the run of
    factors the matmul's ``dim_axis`` walks (possibly several root axes, possibly not last), else the last factor."""
    shape = graph.node(chain.root).type.shape
    layout = replay(chain.nodes, la.root_layout(shape))
    if layout is None:
        return []
    atoms_in_order: list[Atom] = []
    for axis, n in enumerate(shape):
        atoms_in_order += sorted((a for atoms in layout for a in atoms if a.axis == axis), key=lambda a: -a.stride)
    factors = [a.size for a in atoms_in_order]
    if not factors:
        return []
    lo, hi = len(factors) - 1, len(factors)
    walked = [a for a in layout[dim_axis] if a.axis is not None and a.size > 1]
    if walked and all(a in atoms_in_order for a in walked):
        at = [atoms_in_order.index(a) for a in walked]
        if at == list(range(at[0], at[0] + len(at))):
            lo, hi = at[0], at[-1] + 1
    before, dim, after = factors[:lo], math.prod(factors[lo:hi]), factors[hi:]
    axes = [a.axis for a in atoms_in_order]
    views: dict[tuple[tuple[int, ...], int], int] = {}
    for dim_at in (3, 2, 1) if after else (3,):
        for head, head_cuts in _partitions(before, dim_at):
            for tail, tail_cuts in _partitions(after, 3 - dim_at):
                stray = _unnatural(axes[:lo], head_cuts) + _unnatural(axes[hi:], tail_cuts)
                key = (tuple(head + [dim] + tail), dim_at)
                views[key] = min(views.get(key, stray), stray)
    # the root's own axes first: every regrouping that check() proves computes the source's function, but one that
    # folds query rows into heads or kv heads into the batch (exact without a mask) does not name the source's axes
    natural = sorted(views, key=views.__getitem__)
    return [Root(chain.root, view, chain.nodes, chain.scale, dim_at) for view, dim_at in natural]


def start_layout(graph: Graph, root: Root) -> Layout | None:
    """The layout at the matmul of an operand rooted at ``root`` (atoms name the axes of its lifted view)."""
    layout: Layout | None = la.root_layout(root.view)
    shape = graph.node(root.value).type.shape
    if root.view != shape:
        layout = la.reshape(layout, shape)
    return replay(root.nodes, layout)


def _broadcast_before(chain: Chain, root: Root) -> bool:
    """Is ``root`` (a value on ``chain``) computed by a broadcast_to on the chain: does it hold repeated heads that
    a root further up holds once (sdpa's GQA reads kv head h // G itself)?"""
    upstream = chain.nodes[: len(chain.nodes) - len(root.nodes)]
    return any(n.op == "broadcast_to" for n in upstream)


def lifted(shape: Sequence[int]) -> tuple[int, ...]:
    return (1,) * (4 - len(shape)) + tuple(shape)


def _walks(atoms: Sequence[Atom], axis: int, size: int) -> bool:
    """Do ``atoms`` walk exactly the whole of root axis ``axis`` (of ``size``) in order? (size 1: no atoms)."""
    return la.normalize(atoms) == ((Atom(axis, size, 1),) if size > 1 else ())


def _first_problem(layout: list[list[Atom | str]]) -> str | None:
    """The most telling problem among the factors: a tiled KV grouping first, else the first one."""
    problems = [a for atoms in layout for a in atoms if isinstance(a, str)]
    tiled = [p for p in problems if "tiled" in p]
    return (tiled or problems or [None])[0]


def _uncovered(layout: Sequence[Sequence[Atom]], sizes: Sequence[int]) -> int | None:
    """The first role whose atoms in ``layout`` do not cover its size exactly once, or None."""
    for role, size in enumerate(sizes):
        if not la.covers([a for axis in layout for a in axis if a.axis == role], size):
            return role
    return None


def _settled(
    layout: list[list[Atom | str]], flip: bool, sizes: Sequence[int]
) -> tuple[list[tuple[Atom, ...]], str | None, int | None]:
    """A matmul result's layout normalized (its last two axes swapped when ``flip``), with its first problem, else
    the first role it does not cover exactly once (``_uncovered``): ``(layout, problem, role)``."""
    bad = _first_problem(layout)
    if bad:
        return [], bad, None
    settled = [la.normalize(atoms) for atoms in layout]
    if flip:
        settled = list(_swap_last(tuple(settled)))
    return settled, None, _uncovered(settled, sizes)


def _dim_axis(dim_at: int) -> str:
    return "last axis" if dim_at == 3 else f"head-dim axis {dim_at}"


def _swap_last(layout: Layout) -> Layout:
    return tuple(layout[:-2]) + (layout[-1], layout[-2])


def describe(atoms: Sequence[Atom], names: Sequence[str]) -> str:
    parts = [
        f"{names[a.axis]}:{a.size}" + (f"/{a.stride}" if a.stride != 1 else "") for a in atoms if a.axis is not None
    ]
    return "(" + ", ".join(parts) + ")" if parts else "(broadcast)"


def _axis_names(prefix: str, order: Order, rows: str) -> tuple[str, ...]:
    heads_at, rows_at, dim_at = order
    names = ["b", "", "", ""]
    names[heads_at], names[rows_at], names[dim_at] = "h", rows, "d"
    return tuple(f"{prefix}.{n}" for n in names)


def _matmul_factors(a: Layout, b: Layout) -> list[list[tuple[Atom | None, Atom | None]]] | str:
    """Per output axis of ``a @ b``: the factors pairing a's atoms with b's (rows: a only, cols: b only)."""
    batch_a, batch_b = a[:-2], b[:-2]
    n = max(len(batch_a), len(batch_b))
    batch_a = ((),) * (n - len(batch_a)) + tuple(batch_a)
    batch_b = ((),) * (n - len(batch_b)) + tuple(batch_b)
    axes = []
    for i, (x, y) in enumerate(zip(batch_a, batch_b)):
        pairs = la.refine(x, y)
        if pairs is None:
            return f"batch axis {i} walks {x} on one side and {y} on the other, which do not align"
        axes.append(pairs)
    axes.append([(x, None) for x in a[-2] if x.axis is not None] or [])
    axes.append([(None, y) for y in b[-1] if y.axis is not None] or [])
    return axes


def _pair_heads(qa: Atom, ka: Atom | None, k_role: str | None, group: int, hkv: int, who: str) -> str | None:
    """Check the factor of q's head axis: digits >= G pair with kv head h // G, the others with none."""
    if ka is not None and k_role != "h":
        return (
            f"query heads (digit stride {qa.stride}) pair with {who}'s {k_role or 'head dim'} axis, not with its heads"
        )
    if qa.stride >= group:
        if ka is None or k_role != "h":
            return f"query heads (digit stride {qa.stride}) are not paired with {who} heads; sdpa needs kv head h // {group}"
        if qa.stride % group or ka.stride * group != qa.stride:
            need = qa.stride // group if qa.stride % group == 0 else "?"
            return f"query head digit stride {qa.stride} pairs with {who} head stride {ka.stride}; sdpa needs stride {need}"
        return None
    if ka is not None and k_role == "h":
        return (
            f"query head h reads {who} head h % {hkv} (KV heads tiled), but sdpa's GQA reads kv head h // {group} "
            "(KV heads repeated): the repeat-KV grouping differs"
        )
    if qa.stride * qa.size > group:
        return f"query heads split as {qa.size} x stride {qa.stride} straddle the GQA group of {group}"
    return None


def _probability_change(graph: Graph, value: str, depth: int = 3) -> Decline | None:
    """A candidate a few elementwise ops (or a slice) away from P·V: ``value`` changes a softmax output
    before P·V reads it. The failure names the op next to the softmax."""
    node = graph.node(walk(graph, value).root)
    if depth == 0 or (node.opdef.family != "elementwise" and node.op != "slice"):
        return None
    for operand in node.inputs:
        softmax = graph.node(walk(graph, operand).root)
        if softmax.op != "softmax":
            found = _probability_change(graph, operand, depth - 1)
            if found is not None:
                return found
            continue
        if node.op == "slice":
            source = graph.node(walk(graph, softmax.x).root)
            if source.op == "concat":
                return Decline(
                    "probabilities_changed",
                    f"P·V reads slice {node.name} of softmax {softmax.name} over concat {source.name}: the softmax "
                    "also normalizes over columns P·V drops, not as sdpa's sinks (one column per row, along the "
                    "softmax axis, before or after the scores, sliced back out exactly)", node.name, 1,
                )  # fmt: skip
            return Decline(
                "probabilities_changed",
                f"P·V reads slice {node.name} of softmax {softmax.name}; sdpa reads all the keys it normalizes over",
                node.name,
                1,
            )
        if node.op in ("mul", "div"):
            return Decline(
                "probabilities_changed",
                f"{node.op} {node.name} scales the probabilities after the softmax; sdpa scales the scores",
                node.name,
                1,
            )
        return Decline(
            "probabilities_changed",
            f"{node.op} {node.name} changes the probabilities between softmax {softmax.name} and P·V",
            node.name,
            1,
        )
    return None


def _sink_form(graph: Graph, node: Node) -> tuple[Node, str, str] | None:
    """``(softmax, sink column, scores)`` when ``node`` slices the scores' columns back out of a softmax over
    ``concat([sink, scores])`` (or ``[scores, sink]``) along the softmax's last axis, the sink one column wide:
    attention sinks (MLX's ``sinks=`` as its fallback writes it)."""
    if node.op != "slice":
        return None
    softmax = graph.node(node.inputs[0])
    concat = graph.node(softmax.x) if softmax.op == "softmax" else None
    if concat is None or concat.op != "concat" or len(concat.inputs) != 2:
        return None
    rank = softmax.type.rank
    if softmax.attrs["axis"] % rank != rank - 1 or concat.attrs["axis"] % rank != rank - 1:
        return None
    first, second = (graph.node(x).type.shape for x in concat.inputs)
    sink_at = 0 if first[-1] == 1 else 1 if second[-1] == 1 else None
    if sink_at is None:
        return None
    scores = concat.inputs[1 - sink_at]
    width = graph.node(scores).type.shape[-1]
    start = (0,) * (rank - 1) + ((1,) if sink_at == 0 else (0,))
    stop = softmax.type.shape[:-1] + ((width + 1,) if sink_at == 0 else (width,))
    if node.attrs["start"] != start or node.attrs["stop"] != stop or set(node.attrs["step"]) != {1}:
        return None
    return softmax, concat.inputs[sink_at], scores


def _mask_chain(graph: Graph, value: str) -> tuple[str, tuple[Node, ...]]:
    """A mask's root through layout ops and value-keeping casts (a rounding cast is part of the mask's value)."""
    nodes: list[Node] = []
    node = graph.node(value)
    while node.op in la.LAYOUT_OPS or (
        node.op == "cast" and exact_cast(graph.node(node.inputs[0]).type.dtype, node.type.dtype)
    ):
        nodes.append(node)
        node = graph.node(node.inputs[0])
    return node.name, tuple(reversed(nodes))


def _rounding(dtypes: dict[str, DType], dtype: DType, notes: list[str]) -> str:
    """The summary's rounding clause: where the source computes in another precision than sdpa's."""
    if all(d is dtype for d in dtypes.values()) and dtype is DType.float32 and not notes:
        return ""
    shown = ", ".join(f"{what} in {d.short}" for what, d in dtypes.items())
    extra = "; " + "; ".join(notes) if notes else ""
    return f"; rounding: the source computes {shown}{extra}; sdpa({dtype.short}) rounds as its target does"


class _Matcher:
    def __init__(self, graph: Graph, pv: Node) -> None:
        self.g = graph
        self.pv = pv

    def run(self) -> Attention | Decline | None:
        g, pv = self.g, self.pv
        sink_form = None
        for flip_pv in (False, True):  # P·V, or (P·V)ᵀ written as vᵀ·Pᵀ
            p_chain = walk(g, pv.inputs[1 if flip_pv else 0])
            sink_form = _sink_form(g, g.node(p_chain.root))
            if g.node(p_chain.root).op == "softmax" or sink_form is not None:
                break
        else:
            return next((f for f in (_probability_change(g, x) for x in pv.inputs) if f is not None), None)
        softmax = g.node(p_chain.root) if sink_form is None else sink_form[0]
        self.sink = None if sink_form is None else sink_form[1:]
        v_chain = walk(g, pv.inputs[0 if flip_pv else 1], scales=True)
        found = score_steps(g, softmax.x if sink_form is None else sink_form[2])
        if isinstance(found, Decline):
            return replace(found, node=found.node or softmax.name, stage=1)
        steps, qk = found
        algebra = score_algebra(g, steps)
        if isinstance(algebra, Decline):
            return replace(algebra, node=algebra.node or softmax.name, stage=1)
        best: Decline | None = None  # the most telling failure of the roots as they are; views only add successes
        repeated: Attention | None = None  # a success whose k or v root repeats heads: kept while a GQA one is sought
        for roots_of in (value_roots, view_roots):
            for flip_qk in (False, True):  # q·kᵀ, or (q·kᵀ)ᵀ written as k·qᵀ
                chains = {"q": walk(g, qk.inputs[1 if flip_qk else 0], scales=True),
                          "k": walk(g, qk.inputs[0 if flip_qk else 1], scales=True), "v": v_chain}  # fmt: skip
                # the matmul axis holding each operand's head dim: q·kᵀ contracts q's last and k's second-to-last
                # axis (swapped for k·qᵀ); P·V keeps v's last (vᵀ·Pᵀ: its second-to-last)
                dim_axis = {"q": -2 if flip_qk else -1, "k": -1 if flip_qk else -2, "v": -2 if flip_pv else -1}
                if not flip_qk:
                    named = chains  # the no-reading message names q and k as written
                bad = [
                    f"{r} {g.node(c.root).type}" for r, c in chains.items() if not g.node(c.root).type.dtype.is_float
                ]
                if bad:
                    return Decline("not_float", f"the roots {', '.join(bad)} are not float tensors", pv.name, 2)
                roots = {r: roots_of(g, c, dim_axis[r]) for r, c in chains.items()}
                for q, k, v, orders in self.readings(roots):
                    repeats = _broadcast_before(chains["k"], k) or _broadcast_before(chains["v"], v)
                    if repeated is not None and repeats:
                        continue
                    result = self.check(
                        {"q": q, "k": k, "v": v}, orders, (flip_qk, flip_pv), steps, algebra, qk, softmax, p_chain
                    )
                    if isinstance(result, Attention):
                        if not repeats:
                            return result
                        repeated = repeated or result
                    elif roots_of is value_roots and (best is None or result.stage > best.stage):
                        best = result
        if repeated is not None:
            return repeated
        if best is None:
            shapes = ", ".join(f"{r} {list(g.node(c.root).type.shape)}" for r, c in named.items())
            best = Decline(
                "axes_mismatch",
                f"no reading of the roots {shapes} as [B, H, S, D] or [B, S, H, D] (unbatched: [H, S, D] or "
                "[S, H, D]) gives k and v one number of heads dividing q's, one length and q and k one head dim",
                qk.name, 2,
            )  # fmt: skip
        return best

    @staticmethod
    def readings(roots: dict[str, list[Root]]):
        """(q, k, v roots, their orders) under which k and v have one number of heads dividing q's and one
        length, and q and k one head dim."""

        def read(root: Root, order: Order) -> tuple[int, int, int]:
            heads_at, rows_at, dim_at = order
            return root.view[heads_at], root.view[rows_at], root.view[dim_at]

        pairs = [
            (k, ko, v, vo) for k in roots["k"] for ko in orders(k.dim_at) for v in roots["v"] for vo in orders(v.dim_at)
            if read(k, ko)[0] and read(k, ko)[:2] == read(v, vo)[:2]
        ]  # fmt: skip
        for q in roots["q"]:
            for qo in orders(q.dim_at):
                hq, _s, d = read(q, qo)
                for k, ko, v, vo in pairs:
                    hk, _t, dk = read(k, ko)
                    if d == dk and hq % hk == 0:
                        yield q, k, v, (qo, ko, vo)

    def check(
        self, chains, orders, flips, steps: list[Step], algebra: ScoreAlgebra, qk, softmax, p_chain
    ) -> Attention | Decline:
        g = self.g
        qs, ks, vs = (chains[r].view for r in "qkv")
        (qh, qr, qd), (kh, kr, kd), (vh, vr, vd) = orders
        hq, hkv, d = qs[qh], ks[kh], qs[qd]
        q_names, k_names, v_names = (_axis_names(p, o, r) for p, o, r in zip("qkv", orders, "stt"))
        where = f"(q {order_name(orders[0])}, k {order_name(orders[1], 't')}, v {order_name(orders[2], 't')})"
        group = hq // hkv
        a_layout, b_layout = start_layout(g, chains["q"]), start_layout(g, chains["k"])
        if a_layout is None or b_layout is None:
            return Decline("uneven_reshape", "a reshape on the q or k path mixes axes unevenly", qk.name, 2)
        if flips[0]:
            a_layout, b_layout = _swap_last(a_layout), _swap_last(b_layout)
        if not _walks(a_layout[-1], qd, d):
            return Decline(
                "axes_mismatch",
                f"q·kᵀ contracts q over {describe(a_layout[-1], q_names)}, not q's {_dim_axis(qd)} (head dim {d})",
                qk.name,
                3,
            )
        if not _walks(b_layout[-2], kd, ks[kd]) or ks[kd] != d:
            return Decline(
                "axes_mismatch",
                f"q·kᵀ contracts k over {describe(b_layout[-2], k_names)}, not k's {_dim_axis(kd)} "
                f"(head dim {ks[kd]}): check the transpose of k", qk.name, 3,
            )  # fmt: skip
        factors = _matmul_factors(a_layout, b_layout)
        if isinstance(factors, str):
            return Decline("axes_mismatch", f"q·kᵀ: {factors}", qk.name, 3)
        q_roles, k_roles = {0: "b", qh: "h", qr: "s"}, {0: "b", kh: "h", kr: "t"}
        score_layout = [
            [self._score_atom(qa, ka, q_roles, k_roles, group, hkv, q_names, k_names) for qa, ka in axis_factors]
            for axis_factors in factors
        ]
        sizes = (qs[0], hq, qs[qr], ks[kr])
        score_layout, bad, role = _settled(score_layout, flips[0], sizes)
        if bad:
            return Decline("axes_mismatch", f"q·kᵀ {where}: {bad}", qk.name, 4)
        if role is not None:
            return Decline(
                "axes_mismatch",
                f"the scores do not cover query/key {ROLE_NAMES[role]} (size {sizes[role]}) exactly once {where}",
                qk.name,
                4,
            )
        found = self.masks(steps, algebra, tuple(score_layout), sizes)
        if isinstance(found, Decline):
            return found
        layout, mask = found
        axis = softmax.attrs["axis"] % softmax.type.rank
        if not _walks(layout[axis], 3, sizes[3]):
            got = describe(layout[axis], ROLE_NAMES)
            return Decline(
                "axes_mismatch",
                f"softmax {softmax.name} normalizes axis {softmax.attrs['axis']} walking {got}, not the keys (t:{sizes[3]})",
                softmax.name,
                6,
            )
        p_layout = replay(p_chain.nodes, layout)
        v_layout = start_layout(g, chains["v"])
        if p_layout is None or v_layout is None:
            return Decline(
                "uneven_reshape", "a reshape on the probabilities or v path mixes axes unevenly", self.pv.name, 7
            )
        if flips[1]:
            p_layout, v_layout = _swap_last(p_layout), _swap_last(v_layout)
        if not _walks(p_layout[-1], 3, sizes[3]) or not _walks(v_layout[-2], vr, vs[vr]) or vs[vr] != sizes[3]:
            return Decline(
                "axes_mismatch",
                f"P·V contracts P over {describe(p_layout[-1], ROLE_NAMES)} and v over {describe(v_layout[-2], v_names)}; "
                f"sdpa contracts keys t:{sizes[3]} with v's rows", self.pv.name, 7,
            )  # fmt: skip
        if not _walks(v_layout[-1], vd, vs[vd]):
            return Decline(
                "axes_mismatch",
                f"P·V keeps {describe(v_layout[-1], v_names)} of v, not v's last axis (head dim)",
                self.pv.name,
                7,
            )
        pv_factors = _matmul_factors(p_layout, v_layout)
        if isinstance(pv_factors, str):
            return Decline("axes_mismatch", f"P·V: {pv_factors}", self.pv.name, 7)
        last = len(pv_factors) - 1
        out_layout = [
            [self._out_atom(pa, va, vh, group, hkv, v_names, last=i == last) for pa, va in axis_factors]
            for i, axis_factors in enumerate(pv_factors)
        ]
        out_sizes = (qs[0], hq, qs[qr], vs[vd])
        out_layout, bad, role = _settled(out_layout, flips[1], out_sizes)
        if bad:
            return Decline("axes_mismatch", f"P·V {where}: {bad}", self.pv.name, 8)
        if role is not None:
            return Decline(
                "axes_mismatch",
                f"P·V does not produce every output {('b', 'h', 's', 'dv')[role]} exactly once",
                self.pv.name,
                8,
            )
        scale = chains["q"].scale * chains["k"].scale * algebra.scale
        if scale == 0 or not math.isfinite(scale):
            return Decline(
                "bad_scale",
                f"the scales on q, k and the scores multiply to {scale:g}; sdpa needs a finite, non-zero scale",
                qk.name,
                8,
            )
        found = self.result(chains, orders, mask, scale, tuple(out_layout), group, sizes, d, qk, softmax)
        found = replace(found, scores_layout=tuple(tuple(atoms) for atoms in layout))
        if algebra.softcap is not None:
            summary = found.summary + f"; logit_softcap {algebra.softcap:g}"
            figures = {**found.figures, "softcap": algebra.softcap}
            found = replace(found, softcap=algebra.softcap, summary=summary, figures=figures)
        if self.sink is None:
            return found
        sinks = self.sinks(layout, sizes)
        if isinstance(sinks, Decline):
            return sinks
        shown = f"{sinks:g} for every head" if isinstance(sinks, float) else f"{sinks[0]} (per query head)"
        figures = {**found.figures, "sinks": sinks if isinstance(sinks, float) else sinks[0]}
        return replace(found, sinks=sinks, summary=found.summary + f"; sinks {shown}", figures=figures)

    def sinks(self, layout: Layout, sizes: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | float | Decline:
        """The sink column as sdpa's ``[Hq]`` sinks: its root laid out ``(1, Hq, 1, 1)`` (or ``(1, 1, 1, 1)``),
        or a splat constant's value; else why it is not one logit per query head."""
        g = self.g
        sink, scores = self.sink
        root, _nodes = _mask_chain(g, sink)
        value = scalar_constant(g, root)
        if value is not None:
            return value
        probe = Node(sink, "add", (scores, sink), {}, g.node(scores).type)
        found = self.mask(MaskUse(Step(probe, "add", scores, mask=sink), 1.0), layout, sizes)
        if isinstance(found, Decline):
            return Decline("sinks_form", f"sink column {sink}: " + found.message.replace("mask ", "", 1), sink, 9)
        if found[1][0] != 1 or found[1][2:] != (1, 1):
            return Decline(
                "sinks_form",
                f"sink column {sink} varies over {found[1]} of [B, Hq, S, T]; "
                "sdpa's sinks are one logit per query head",
                sink, 9,
            )  # fmt: skip
        return found

    def masks(
        self, steps: list[Step], algebra: ScoreAlgebra, layout: Layout, sizes
    ) -> tuple[Layout, MaskPlan] | Decline:
        """The scores layout at the softmax, and every mask laid out as sdpa takes it."""
        uses = {u.step.node.name: u for u in (*algebra.bools, *((algebra.additive,) if algebra.additive else ()))}
        bools, additive, nan_rows, finite = [], None, False, []
        current: Layout | None = layout
        for step in steps:
            use = uses.get(step.node.name)
            if use is None:
                current = replay([step.node], current)
                if current is None:
                    return Decline(
                        "uneven_reshape", f"reshape {step.node.name} mixes score axes unevenly", step.node.name, 5
                    )
                continue
            found = self.mask(use, current, sizes)
            if isinstance(found, Decline):
                return found
            if step.kind == "where":
                bools.append(found)
                nan_rows = nan_rows or use.fill == -math.inf
                finite += [use.fill] if math.isfinite(use.fill) else []
            else:
                additive = (*found, use.factor)
        return current, MaskPlan(tuple(bools), additive, nan_rows, tuple(finite))

    def mask(self, use: MaskUse, layout: Layout, sizes: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | Decline:
        """The mask root and its [B, Hq, S, T]-broadcastable shape, or why it does not fit."""
        g = self.g
        node, value = use.step.node, use.step.mask
        kind = "bool" if use.step.kind == "where" else "additive"
        mtype = g.node(value).type
        if node.type.shape != g.node(use.step.scores).type.shape:
            return Decline(
                "mask_layout", f"the mask of {node.op} {node.name} broadcasts the scores to {node.type}", node.name, 5
            )
        if (kind == "bool") != (mtype.dtype is DType.bool):
            return Decline(
                "mask_layout", f"the {kind} mask {value} of {node.name} has dtype {mtype.dtype.value}", node.name, 5
            )
        root, nodes = _mask_chain(g, value)
        shape = g.node(root).type.shape
        m_layout = replay(nodes, la.root_layout(shape))
        if m_layout is None:
            return Decline(
                "uneven_reshape", f"a reshape on the mask path of {node.name} mixes axes unevenly", node.name, 5
            )
        pairs = []
        for axis, (s_atoms, m_atoms) in enumerate(zip(layout, la.broadcast(m_layout, node.type.shape))):
            refined = la.refine(s_atoms, m_atoms)
            if refined is None:
                return Decline(
                    "mask_layout",
                    f"mask {root} and the scores split axis {axis} of {node.name} differently",
                    node.name,
                    5,
                )
            pairs += [(sa, ma) for sa, ma in refined if ma is not None]
        groups: list[tuple[int, list[int]]] = []  # (role, root axes): consecutive axes walking one score axis
        for axis, size in enumerate(shape):
            if size == 1:
                continue
            mine = [(sa, ma) for sa, ma in pairs if ma.axis == axis]
            roles = {sa.axis if sa is not None else None for sa, _ma in mine}
            if len(roles) != 1 or None in roles:
                shown = ", ".join(sorted(ROLE_NAMES[r] if r is not None else "none" for r in roles)) or "none"
                return Decline(
                    "mask_layout", f"mask {root} axis {axis} walks score axes ({shown}), not one of them", node.name, 5
                )
            (role,) = roles
            if groups and groups[-1][0] == role:
                groups[-1][1].append(axis)
            else:
                groups.append((role, [axis]))
        order, shape4 = [], [1, 1, 1, 1]
        for role, axes in groups:  # row-major: the axes of a group merge into one (as [Hkv, G] into Hq)
            inner = {a: math.prod(shape[b] for b in axes if b > a) for a in axes}
            mine = [(sa, ma) for sa, ma in pairs if ma.axis in axes]
            size = math.prod(shape[a] for a in axes)
            whole = size == sizes[role] and la.covers([sa for sa, _ma in mine], size)
            if not whole or any(sa.stride != ma.stride * inner[ma.axis] for sa, ma in mine):
                shown = f"axis {axes[0]}" if len(axes) == 1 else f"axes {', '.join(map(str, axes))}"
                return Decline(
                    "mask_layout",
                    f"mask {root} {shown} (size {size}) is not the whole {ROLE_NAMES[role]} axis",
                    node.name,
                    5,
                )
            order.append(role)
            shape4[role] = size
        if order != sorted(order):
            shown = ", ".join(ROLE_NAMES[r] for r in order)
            return Decline(
                "mask_layout",
                f"mask {root} has axes ({shown}); sdpa masks are laid out [..., S, T] and a reordered mask is not raised",
                node.name, 5,
            )  # fmt: skip
        return root, tuple(shape4)

    def result(self, chains, orders, mask: MaskPlan, scale, out_layout, group, sizes, d, qk, softmax) -> Attention:
        g, pv = self.g, self.pv
        dtype = pv.type.dtype
        operands = []
        for role, order in zip("qkv", orders):
            chain = chains[role]
            steps = elementwise_steps(g, chain.nodes, scales=role == "v")
            operands.append(Operand(chain.value, chain.view, (0, *order), steps))
        notes = []
        for role, x in zip("qkv", operands):
            own = next((arg for op, arg in reversed(x.steps) if op == "cast"), g.node(x.root).type.dtype)
            if own is not dtype:  # a cast the source does not have: sdpa takes one dtype
                notes.append(f"{role} {x.root} cast from {own.short}")
        if mask.additive is not None and not exact_cast(g.node(mask.additive[0]).type.dtype, dtype):
            notes.append(
                f"mask {mask.additive[0]} rounded from {g.node(mask.additive[0]).type.dtype.short} to {dtype.short}"
            )
        computed = {"q·kᵀ": qk.type.dtype, "the softmax": softmax.type.dtype, "P·V": dtype}
        rounding = _rounding(computed, dtype, notes)
        masks = [f"{root} (bool)" for root, _s in mask.bools]
        if mask.additive is not None:
            root, _shape, factor = mask.additive
            masks.append(f"{root}" + (f"·{factor:g}" if factor != 1 else "") + " (additive)")
        names = [order_name(o, rows) for o, rows in zip(orders, "stt")]
        summary = (
            f"q {operands[0].root} ({names[0]}), k {operands[1].root} ({names[1]}), v {operands[2].root}"
            + "".join(f"{'·' if op == 'mul' else '/'}{c:g}" for op, c in operands[2].steps if op != "cast")
            + f" ({names[2]}); "
            f"{sizes[1]} query heads over {sizes[1] // group} KV heads (GQA {group}); S={sizes[2]} T={sizes[3]} D={d}; "
            f"scale {scale:g}; mask {' and '.join(masks) or 'none'}{rounding}"
        )
        for fill in mask.finite_fills:
            bound = fill + UNDERFLOW
            summary += f"; fill {fill!r} masks exactly while every row's highest unmasked score is >= {bound!r}"
        figures = {
            "q": operands[0].root, "k": operands[1].root, "v": operands[2].root,
            "v_steps": [(op, c) for op, c in operands[2].steps if op != "cast"],
            "q_heads": sizes[1], "kv_heads": sizes[1] // group, "gqa": group, "q_len": sizes[2], "kv_len": sizes[3],
            "head_dim": d, "scale": scale, "bool_masks": [root for root, _s in mask.bools],
            "additive_mask": None if mask.additive is None else mask.additive[0],
            "mask_factor": None if mask.additive is None else mask.additive[2],
            "rounding": bool(rounding), "qk_dtype": qk.type.dtype.short, "softmax_dtype": softmax.type.dtype.short,
            "dtype": dtype.short, "fills": list(mask.finite_fills), "fill_bounds": [f + UNDERFLOW for f in mask.finite_fills],
            "softcap": None, "sinks": None,
        }  # fmt: skip
        return Attention(pv, *operands, mask, scale, dtype, out_layout, summary, figures=figures)

    @staticmethod
    def _score_atom(qa, ka, q_roles, k_roles, group, hkv, q_names, k_names) -> Atom | str:
        q_role = q_roles.get(qa.axis) if qa is not None else None
        k_role = k_roles.get(ka.axis) if ka is not None else None
        if qa is None and ka is None:
            return "the scores repeat along a broadcast axis"
        if qa is None:
            if k_role != "t":
                return f"k's {k_names[ka.axis]} axis walks the scores without a matching q axis"
            return Atom(3, ka.size, ka.stride)
        if q_role == "b":
            if k_role != "b" or ka.stride != qa.stride:
                return f"q's batch pairs with {k_names[ka.axis] if ka else 'nothing'} of k, not k's batch"
            return Atom(0, qa.size, qa.stride)
        if q_role == "h":
            bad = _pair_heads(qa, ka, k_role, group, hkv, "k")
            return bad or Atom(1, qa.size, qa.stride)
        if ka is not None:
            return f"q's {q_names[qa.axis]} axis is paired with k's {k_names[ka.axis]}; query rows pair with every key"
        return Atom(2, qa.size, qa.stride)

    @staticmethod
    def _out_atom(pa, va, vh, group, hkv, v_names, *, last: bool) -> Atom | str:
        if pa is None and va is None:
            return "the output repeats along a broadcast axis"
        if pa is None:
            if not last:
                return f"v's {v_names[va.axis]} axis walks the output without a matching query axis"
            return Atom(3, va.size, va.stride)
        v_role = {0: "b", vh: "h"}.get(va.axis) if va is not None else None
        if pa.axis == 0:
            if v_role != "b" or va.stride != pa.stride:
                return "the batch of P is not paired with v's batch"
            return Atom(0, pa.size, pa.stride)
        if pa.axis == 1:
            bad = _pair_heads(pa, va, v_role, group, hkv, "v")
            return bad or Atom(1, pa.size, pa.stride)
        if pa.axis == 2 and va is None:
            return Atom(2, pa.size, pa.stride)
        return f"P's {ROLE_NAMES[pa.axis]} axis pairs with v's {v_names[va.axis] if va else 'nothing'}"


def match_attention(graph: Graph, pv: Node) -> Attention | Decline | None:
    """Prove that matmul ``pv`` computes an sdpa; None when it is not P·V of a softmax at all."""
    return _Matcher(graph, pv).run()


__all__ = ["Attention", "MaskPlan", "Operand", "lifted", "match_attention"]
