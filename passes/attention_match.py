"""Proving that ``softmax(q·kᵀ·scale + mask)·v`` written with matmuls is an ``sdpa``.

:func:`match_attention` starts at the ``P·V`` matmul, walks the producer
chains of its operands (layout ops, scalar scales, the mask) back to the
roots ``q``, ``k``, ``v`` and tracks, with :mod:`.layout_algebra`, which root
coordinates every axis walks. It then checks the semantics of ``sdpa`` on
those coordinates rather than on op spellings: the contraction runs over the
head dims (the roots' last axes) in order; every score pairs query row
``(b, h, s)`` with key row ``(b, h // G, t)`` exactly once; the softmax
normalises over exactly the key axis; ``P·V`` pairs key ``t`` with value row
``t`` of the same KV head; the mask reaches the scores without reordering its
``[..., S, T]`` axes; scales multiply q, k or the scores (never v or the
probabilities). Each failure is a :class:`Fail` naming what did not match.
Roots are rank 4 with batch first and the head dim last; heads and rows may
come in either order (``[B, H, S, D]`` as MLX, ``[B, S, H, D]`` as JAX).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import ml_dtypes

from attnpass.ir import DType, Graph, Node

from . import layout_algebra as la
from .layout_algebra import Atom, Layout

ROLE_NAMES = ("b", "h", "s", "t")  # axes of the canonical score tensor [B, Hq, S, T]
ORDERS = {"heads-first": (1, 2), "rows-first": (2, 1)}  # root axis holding heads, rows (B axis 0, head dim 3)


@dataclass(frozen=True)
class Fail:
    """Why a candidate is not an sdpa, and at which node (``stage`` ranks how far the check got)."""

    reason: str
    node: str
    stage: int = 0


@dataclass(frozen=True)
class Chain:
    """A value traced back to its root: the nodes in between (root side first) and their scale."""

    root: str
    nodes: tuple[Node, ...]
    scale: float


@dataclass(frozen=True)
class Attention:
    """A proven attention: roots, their axis orders, the mask root and its 4-d shape, the output layout."""

    pv: Node
    q: str
    k: str
    v: str
    q_perm: tuple[int, ...]
    kv_perm: tuple[int, ...]
    mask: str | None
    mask_shape: tuple[int, ...] | None
    mask_fill: float | None  # a bool mask's fill for the masked scores (None: additive or no mask)
    scale: float
    out_layout: Layout
    summary: str


def scalar_constant(graph: Graph, value: str) -> float | None:
    """The value of a splatted constant reached through layout ops, else None."""
    node = graph.node(value)
    while node.op in la.LAYOUT_OPS:
        node = graph.node(node.inputs[0])
    if node.op != "constant" or len(set(node.attrs["value"])) != 1:
        return None
    return float(node.attrs["value"][0])


def _scale_operand(graph: Graph, node: Node) -> tuple[str, float] | None:
    """``(other operand, factor)`` when ``node`` multiplies or divides by a scalar constant."""
    if node.op not in ("mul", "div"):
        return None
    for i in ((0, 1) if node.op == "mul" else (1,)):
        c = scalar_constant(graph, node.inputs[i])
        other = node.inputs[1 - i]
        if c is not None and graph.node(other).type == node.type and c != 0:
            return other, (c if node.op == "mul" else 1.0 / c)
    return None


def walk(graph: Graph, value: str, *, scales: bool) -> tuple[Chain, Node | None]:
    """Follow layout ops (and scalar scales when ``scales``) back to the first other producer.

    Returns the chain and, when a scale was met but not allowed, the scaling node.
    """
    nodes: list[Node] = []
    factor, refused = 1.0, None
    node = graph.node(value)
    while True:
        if node.op in la.LAYOUT_OPS:
            nodes.append(node)
            node = graph.node(node.inputs[0])
            continue
        scaled = _scale_operand(graph, node)
        if scaled is not None:
            if not scales:
                refused = refused or node
            nodes.append(node)
            factor *= scaled[1]
            node = graph.node(scaled[0])
            continue
        return Chain(node.name, tuple(reversed(nodes)), factor), refused


def rank4_root(graph: Graph, chain: Chain) -> Chain | None:
    """Re-root ``chain`` at its earliest rank-4 value (scales before it belong to the root)."""
    values = [chain.root] + [n.name for n in chain.nodes]
    for i, name in enumerate(values):
        if graph.node(name).type.rank == 4:
            rest = chain.nodes[i:]
            scale = math.prod(_scale_operand(graph, n)[1] for n in rest if n.op not in la.LAYOUT_OPS)
            return Chain(name, rest, scale)
    return None


def replay(graph: Graph, chain: Sequence[Node], layout: Layout) -> Layout | None:
    """Push ``layout`` through layout ops and scales (None: a reshape that is not a regrouping)."""
    for node in chain:
        if node.op == "transpose":
            layout = la.transpose(layout, node.attrs["perm"])
        elif node.op == "reshape":
            layout = la.reshape(layout, node.type.shape)
            if layout is None:
                return None
        elif node.op == "broadcast_to":
            layout = la.broadcast(layout, node.type.shape)
    return layout


def _first_problem(layout: list[list[Atom | str]]) -> str | None:
    """The most telling problem among the factors: a tiled KV grouping first, else the first one."""
    problems = [a for atoms in layout for a in atoms if isinstance(a, str)]
    tiled = [p for p in problems if "tiled" in p]
    return (tiled or problems or [None])[0]


def _swap_last(layout: Layout) -> Layout:
    return tuple(layout[:-2]) + (layout[-1], layout[-2])


def describe(atoms: Sequence[Atom], names: Sequence[str]) -> str:
    parts = [f"{names[a.axis]}:{a.size}" + (f"/{a.stride}" if a.stride != 1 else "") for a in atoms if a.axis is not None]
    return "(" + ", ".join(parts) + ")" if parts else "(broadcast)"


def _axis_names(prefix: str, order: str, rows: str) -> tuple[str, ...]:
    heads_at, rows_at = ORDERS[order]
    names = ["b", "", "", "d"]
    names[heads_at], names[rows_at] = "h", rows
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
    if qa.stride >= group:
        if ka is None or k_role != "h":
            return f"query heads (digit stride {qa.stride}) are not paired with {who} heads; sdpa needs kv head h // {group}"
        if qa.stride % group or ka.stride * group != qa.stride:
            return f"query head digit stride {qa.stride} pairs with {who} head stride {ka.stride}; sdpa needs stride {qa.stride // group if qa.stride % group == 0 else '?'}"
        return None
    if ka is not None and k_role == "h":
        return (
            f"query head h reads {who} head h % {hkv} (KV heads tiled), but sdpa's GQA reads kv head h // {group} "
            "(KV heads repeated): the repeat-KV grouping differs"
        )
    if qa.stride * qa.size > group:
        return f"query heads split as {qa.size} x stride {qa.stride} straddle the GQA group of {group}"
    return None


class _Matcher:
    def __init__(self, graph: Graph, pv: Node) -> None:
        self.g = graph
        self.pv = pv

    def fail(self, reason: str, node: str, stage: int) -> Fail:
        return Fail(reason, node, stage)

    def run(self) -> Attention | Fail | None:
        g, pv = self.g, self.pv
        for flip_pv in (False, True):  # P·V, or (P·V)ᵀ written as vᵀ·Pᵀ
            p_chain, refused = walk(g, pv.inputs[1 if flip_pv else 0], scales=False)
            if g.node(p_chain.root).op == "softmax":
                break
        else:
            return None  # not attention-shaped: neither operand is a softmax
        softmax = g.node(p_chain.root)
        if refused is not None:
            return self.fail(f"{refused.op} {refused.name} scales the probabilities after the softmax; sdpa scales the scores", refused.name, 1)
        v_chain, refused = walk(g, pv.inputs[0 if flip_pv else 1], scales=False)
        if refused is not None:
            return self.fail(f"{refused.op} {refused.name} scales v; sdpa applies its scale to the scores only", refused.name, 1)
        found = self.scores_chain(softmax.inputs[0])
        if isinstance(found, Fail):
            return found
        s_nodes, qk, masks = found
        best: Fail | None = None
        for flip_qk in (False, True):  # q·kᵀ, or (q·kᵀ)ᵀ written as k·qᵀ
            chains = self.roots(qk, flip_qk, v_chain)
            if isinstance(chains, Fail):
                best = chains if best is None or chains.stage > best.stage else best
                continue
            for q_order in ORDERS:
                for kv_order in ORDERS:
                    flips = (flip_qk, flip_pv)
                    result = self.check(chains, q_order, kv_order, flips, s_nodes, qk, softmax, p_chain, masks)
                    if isinstance(result, Attention):
                        return result
                    if best is None or result.stage > best.stage:
                        best = result
        return best

    def roots(self, qk: Node, flip: bool, v_chain: Chain) -> dict[str, Chain] | Fail:
        g = self.g
        q_chain, _ = walk(g, qk.inputs[1 if flip else 0], scales=True)
        k_chain, _ = walk(g, qk.inputs[0 if flip else 1], scales=True)
        chains = {}
        for role, chain in (("q", q_chain), ("k", k_chain), ("v", v_chain)):
            rooted = rank4_root(g, chain)
            if rooted is None:
                return self.fail(f"{role} is not reached from a rank-4 [B, H, rows, D] tensor (root {chain.root})", chain.root, 2)
            chains[role] = rooted
        dtypes = {g.node(c.root).type.dtype for c in chains.values()}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_float:
            return self.fail(f"q, k, v roots have dtypes {sorted(d.value for d in dtypes)}; sdpa needs one float dtype", self.pv.name, 2)
        return chains

    def scores_chain(self, value: str) -> tuple[list[Node], Node, list[tuple[Node, str, str]]] | Fail:
        """From the softmax input back to the q·kᵀ matmul: nodes (root side first), the matmul, masks."""
        g = self.g
        nodes: list[Node] = []
        masks: list[tuple[Node, str, str]] = []
        node = g.node(value)
        while node.op != "matmul":
            if node.op in la.LAYOUT_OPS or _scale_operand(g, node) is not None:
                nodes.append(node)
                node = g.node(node.inputs[0] if node.op in la.LAYOUT_OPS else _scale_operand(g, node)[0])
            elif node.op == "where":
                fill = scalar_constant(g, node.inputs[2])
                limit = float(ml_dtypes.finfo(node.type.dtype.numpy).min) * 0.5  # np.finfo rejects bfloat16
                if fill is None or fill > limit:
                    return self.fail(
                        f"where {node.name} fills masked scores with {node.inputs[2]} "
                        f"({'not a constant' if fill is None else fill}); a mask needs -inf or a value <= {limit:.3g}",
                        node.name, 1,
                    )  # fmt: skip
                nodes.append(node)
                masks.append((node, node.inputs[0], node.inputs[1]))
                node = g.node(node.inputs[1])
            elif node.op == "add":
                side = 0 if g.node(node.inputs[0]).type == node.type else 1
                nodes.append(node)
                masks.append((node, node.inputs[1 - side], node.inputs[side]))
                node = g.node(node.inputs[side])
            else:
                return self.fail(f"the softmax input comes from {node.op} {node.name}, not from a q·kᵀ matmul", node.name, 1)
        return list(reversed(nodes)), node, masks

    def check(self, chains, q_order, kv_order, flips, s_nodes, qk, softmax, p_chain, masks) -> Attention | Fail:
        g = self.g
        q, k, v = (chains[r].root for r in "qkv")
        qs, ks, vs = (g.node(x).type.shape for x in (q, k, v))
        qh, qr = ORDERS[q_order]
        kh, kr = ORDERS[kv_order]
        hq, hkv, d = qs[qh], ks[kh], qs[3]
        q_names, k_names = _axis_names("q", q_order, "s"), _axis_names("k", kv_order, "t")
        v_names = _axis_names("v", kv_order, "t")
        where = f"(q {q_order}, k/v {kv_order})"
        if hkv == 0 or hq % hkv or vs[kh] != hkv:
            return self.fail(f"{hq} query heads, {hkv} k heads and {vs[kh]} v heads do not form GQA {where}", qk.name, 2)
        group = hq // hkv
        a_layout = replay(g, chains["q"].nodes, la.root_layout(qs))
        b_layout = replay(g, chains["k"].nodes, la.root_layout(ks))
        if a_layout is None or b_layout is None:
            return self.fail("a reshape on the q or k path mixes axes unevenly", qk.name, 2)
        if flips[0]:
            a_layout, b_layout = _swap_last(a_layout), _swap_last(b_layout)
        if la.normalize(a_layout[-1]) != (Atom(3, d, 1),):
            return self.fail(f"q·kᵀ contracts q over {describe(a_layout[-1], q_names)}, not q's last axis (head dim {d})", qk.name, 3)
        if la.normalize(b_layout[-2]) != (Atom(3, ks[3], 1),) or ks[3] != d:
            return self.fail(
                f"q·kᵀ contracts k over {describe(b_layout[-2], k_names)}, not k's last axis (head dim {ks[3]}): "
                "check the transpose of k", qk.name, 3,
            )  # fmt: skip
        factors = _matmul_factors(a_layout, b_layout)
        if isinstance(factors, str):
            return self.fail(f"q·kᵀ: {factors}", qk.name, 3)
        q_roles = {0: "b", qh: "h", qr: "s"}
        k_roles = {0: "b", kh: "h", kr: "t"}
        score_layout = [
            [self._score_atom(qa, ka, q_roles, k_roles, group, hkv, q_names, k_names) for qa, ka in axis_factors]
            for axis_factors in factors
        ]
        bad = _first_problem(score_layout)
        if bad:
            return self.fail(f"q·kᵀ {where}: {bad}", qk.name, 4)
        score_layout = [la.normalize(atoms) for atoms in score_layout]
        if flips[0]:
            score_layout = list(_swap_last(tuple(score_layout)))
        sizes = (qs[0], hq, qs[qr], ks[kr])
        for role, size in enumerate(sizes):
            if not la.covers([a for axis in score_layout for a in axis if a.axis == role], size):
                return self.fail(f"the scores do not cover query/key {ROLE_NAMES[role]} (size {size}) exactly once {where}", qk.name, 4)
        layout: Layout | None = tuple(score_layout)
        mask_info = None
        by_node = {n.name: (m, sv) for n, m, sv in masks}
        for node in s_nodes:
            if node.name not in by_node:
                if mask_info is not None and node.op in ("mul", "div"):
                    return self.fail(
                        f"{node.op} {node.name} scales the scores after the mask {mask_info[0]}, so it scales the mask "
                        "too; sdpa adds its mask to the scaled scores", node.name, 5,
                    )  # fmt: skip
                layout = replay(g, [node], layout)
                if layout is None:
                    return self.fail(f"reshape {node.name} mixes score axes unevenly", node.name, 5)
                continue
            mask_value, scores_value = by_node[node.name]
            if node.type.shape != g.node(scores_value).type.shape:
                return self.fail(f"the mask of {node.op} {node.name} broadcasts the scores to {node.type}", node.name, 5)
            if mask_info is not None:
                return self.fail(f"two masks reach the scores ({mask_info[0]} and {node.name}); sdpa takes one", node.name, 5)
            found = self.mask(node, mask_value, layout, sizes)
            if isinstance(found, Fail):
                return found
            mask_info = (node.name, *found)
        axis = softmax.attrs["axis"] % softmax.type.rank
        if la.normalize(layout[axis]) != (Atom(3, sizes[3], 1),):
            got = describe(layout[axis], ROLE_NAMES)
            return self.fail(f"softmax {softmax.name} normalizes axis {softmax.attrs['axis']} walking {got}, not the keys (t:{sizes[3]})", softmax.name, 6)
        p_layout = replay(g, p_chain.nodes, layout)
        v_layout = replay(g, chains["v"].nodes, la.root_layout(vs))
        if p_layout is None or v_layout is None:
            return self.fail("a reshape on the probabilities or v path mixes axes unevenly", self.pv.name, 7)
        if flips[1]:
            p_layout, v_layout = _swap_last(p_layout), _swap_last(v_layout)
        if la.normalize(p_layout[-1]) != (Atom(3, sizes[3], 1),) or la.normalize(v_layout[-2]) != (Atom(kr, vs[kr], 1),) or vs[kr] != sizes[3]:
            return self.fail(
                f"P·V contracts P over {describe(p_layout[-1], ROLE_NAMES)} and v over {describe(v_layout[-2], v_names)}; "
                f"sdpa contracts keys t:{sizes[3]} with v's rows", self.pv.name, 7,
            )  # fmt: skip
        if la.normalize(v_layout[-1]) != (Atom(3, vs[3], 1),):
            return self.fail(f"P·V keeps {describe(v_layout[-1], v_names)} of v, not v's last axis (head dim)", self.pv.name, 7)
        pv_factors = _matmul_factors(p_layout, v_layout)
        if isinstance(pv_factors, str):
            return self.fail(f"P·V: {pv_factors}", self.pv.name, 7)
        last = len(pv_factors) - 1
        out_layout = [
            [self._out_atom(pa, va, kh, group, hkv, v_names, last=i == last) for pa, va in axis_factors]
            for i, axis_factors in enumerate(pv_factors)
        ]
        bad = _first_problem(out_layout)
        if bad:
            return self.fail(f"P·V {where}: {bad}", self.pv.name, 8)
        out_layout = [la.normalize(atoms) for atoms in out_layout]
        if flips[1]:
            out_layout = list(_swap_last(tuple(out_layout)))
        out_sizes = (qs[0], hq, qs[qr], vs[3])
        for role, size in enumerate(out_sizes):
            if not la.covers([a for axis in out_layout for a in axis if a.axis == role], size):
                return self.fail(f"P·V does not produce every output {('b', 'h', 's', 'dv')[role]} exactly once", self.pv.name, 8)
        scale = chains["q"].scale * chains["k"].scale * math.prod(
            _scale_operand(g, n)[1] for n in s_nodes if n.op in ("mul", "div") and _scale_operand(g, n) is not None
        )
        mask, mask_shape, mask_fill = (mask_info[1], mask_info[2], mask_info[3]) if mask_info else (None, None, None)
        summary = (
            f"q {q} ({q_order}), k {k} and v {v} ({kv_order}); {hq} query heads over {hkv} KV heads (GQA {group}); "
            f"S={qs[qr]} T={sizes[3]} D={d}; scale {scale:g}; mask {mask_info[0] + ' -> ' + mask if mask_info else 'none'}"
        )
        perm = lambda heads_at, rows_at: (0, heads_at, rows_at, 3)  # noqa: E731
        return Attention(
            self.pv, q, k, v, perm(qh, qr), perm(kh, kr), mask, mask_shape, mask_fill, scale, tuple(out_layout), summary
        )

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
    def _out_atom(pa, va, kh, group, hkv, v_names, *, last: bool) -> Atom | str:
        if pa is None and va is None:
            return "the output repeats along a broadcast axis"
        if pa is None:
            if not last:
                return f"v's {v_names[va.axis]} axis walks the output without a matching query axis"
            return Atom(3, va.size, va.stride)
        v_role = {0: "b", kh: "h"}.get(va.axis) if va is not None else None
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

    def mask(
        self, node: Node, value: str, layout: Layout, sizes: tuple[int, ...]
    ) -> tuple[str, tuple[int, ...], float | None] | Fail:
        """The mask root, its [B, Hq, S, T]-broadcastable shape and a bool mask's fill, or why it does not fit."""
        g = self.g
        kind = "bool" if node.op == "where" else "additive"
        mtype = g.node(value).type
        if (kind == "bool") != (mtype.dtype is DType.bool) or (kind == "additive" and mtype.dtype != node.type.dtype):
            return self.fail(f"the {kind} mask {value} of {node.name} has dtype {mtype.dtype.value}", node.name, 5)
        root, nodes = _skip_true_and(g, walk(g, value, scales=False)[0])
        shape = g.node(root).type.shape
        m_layout = replay(g, nodes, la.root_layout(shape))
        if m_layout is None:
            return self.fail(f"a reshape on the mask path of {node.name} mixes axes unevenly", node.name, 5)
        pairs = []
        for axis, (s_atoms, m_atoms) in enumerate(zip(layout, la.broadcast(m_layout, node.type.shape))):
            refined = la.refine(s_atoms, m_atoms)
            if refined is None:
                return self.fail(f"mask {root} and the scores split axis {axis} of {node.name} differently", node.name, 5)
            pairs += [(sa, ma) for sa, ma in refined if ma is not None]
        order = []
        for axis, size in enumerate(shape):
            if size == 1:
                continue
            mine = [(sa, ma) for sa, ma in pairs if ma.axis == axis]
            roles = {sa.axis if sa is not None else None for sa, _ma in mine}
            if len(roles) != 1 or None in roles:
                shown = ", ".join(sorted(ROLE_NAMES[r] if r is not None else "none" for r in roles)) or "none"
                return self.fail(f"mask {root} axis {axis} walks score axes ({shown}), not one of them", node.name, 5)
            (role,) = roles
            whole = size == sizes[role] and la.covers([sa for sa, _ma in mine], size)
            if not whole or any(sa.stride != ma.stride for sa, ma in mine):
                return self.fail(f"mask {root} axis {axis} (size {size}) is not the whole {ROLE_NAMES[role]} axis", node.name, 5)
            order.append(role)
        if order != sorted(order):
            shown = ", ".join(ROLE_NAMES[r] for r in order)
            return self.fail(
                f"mask {root} has axes ({shown}); sdpa masks are laid out [..., S, T] and a reordered mask is not raised",
                node.name, 5,
            )  # fmt: skip
        shape4 = [1, 1, 1, 1]
        for role, size in zip(order, [n for n in shape if n != 1]):
            shape4[role] = size
        return root, tuple(shape4), scalar_constant(g, node.inputs[2]) if kind == "bool" else None


def _skip_true_and(graph: Graph, chain: Chain) -> tuple[str, tuple[Node, ...]]:
    """Look through ``logical_and(x, all-True constant)`` at the root of a mask chain."""
    node, nodes = graph.node(chain.root), list(chain.nodes)
    while node.op == "logical_and":
        truth = [i for i in (0, 1) if scalar_constant(graph, node.inputs[i]) == 1.0]
        if not truth or graph.node(node.inputs[1 - truth[0]]).type.shape != node.type.shape:
            break
        inner, _ = walk(graph, node.inputs[1 - truth[0]], scales=False)
        nodes = list(inner.nodes) + nodes
        node = graph.node(inner.root)
    return node.name, tuple(nodes)


def match_attention(graph: Graph, pv: Node) -> Attention | Fail | None:
    """Prove that matmul ``pv`` computes an sdpa; None when it is not P·V of a softmax at all."""
    return _Matcher(graph, pv).run()


__all__ = ["Attention", "Fail", "match_attention", "scalar_constant", "walk"]
