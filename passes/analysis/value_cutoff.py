"""A top-k selection written from the top-k *values*: MaxText's DSA indexer mask, read as a token selection.

MaxText 0.2.5's ``Indexer.generate_mask`` (``indexer_mask_exact_topk=True``) does not write the
indexer's top-k indices into a mask; it compares every score with the K-th top value::

    c   = top_k(s, K).values[..., -1:]              # the cutoff: take_along_axis(s, argtopk(s, K))[..., K-1]
    A   = s > c;   a = cumsum(A, axis=-1)            # strictly above, and their running count
    B   = s == c;  b = cumsum(B, axis=-1)            # the ties, and theirs
    sel = (A & (a <= K)) | (B & (b <= K - min(a[..., -1:], K)))

:func:`match_value_cutoff` reads that form (comparisons in either operand order, ``<=`` as ``>=``
swapped) and says, with a :class:`~..infra.rewrite.Decline` naming the node, why a look-alike is not it.

**Proof** (per row, ``n = a[-1]`` the number of cells above ``c``, ``m = K - min(n, K)``):

1. ``|sel| <= K`` for *every* score row, NaN and signed zeros included. ``A & (a <= K)`` is the first
   ``min(n, K)`` cells of ``A`` (``a`` counts ``A``'s cells in key order); ``B & (b <= m)`` is the first
   ``min(|B|, m)`` cells of ``B``; ``A`` and ``B`` are disjoint; so ``|sel| <= min(n, K) + m = K``. Hence
   ``argtopk(cast(sel, int32), K)`` (ones ranked above zeros) returns *every* selected cell, distinct,
   and when ``|sel| < K`` the lowest-index unselected cells besides: this is what ``dsa-gather`` gathers,
   exact whatever the scores, once the attention mask is proven false wherever ``sel`` is
   (:mod:`.cell_implication`).
2. ``sel`` is exactly the index set of ``lax.top_k(s, K)`` when the row has no NaN and no ``-0.0``
   (e.g. after ``s + 0.0``): top_k orders by value, equal values lower index first; ``c`` is its K-th
   value, so the ``n <= K - 1`` cells above ``c`` are all among its K, and it fills the other ``K - n``
   with the lowest-index cells equal to ``c`` (there are at least ``K - n``: ``c`` itself is one). In
   ``sel``, ``a <= K`` keeps all of ``A`` (``n < K``) and ``b <= K - n`` keeps the first ``K - n`` ties:
   the same cells. (``lax.top_k`` puts ``+0.0`` above ``-0.0`` and NaN above everything while ``==`` and
   ``>`` do not, so a row with NaN or a ``-0.0``/``+0.0`` tie at the cutoff can differ; item 1 does not
   need this.)

With ``indexer_mask_exact_topk=False`` MaxText writes ``s >= c``: every tie at the cutoff is selected, so
more than K cells when ties straddle it (declined ``ties_unbounded``). A strict part without the tie term
selects fewer than top_k (``missing_tie_term``); a cumulative sum along another axis counts the wrong
cells (``scan_axis``); a rank bound, a remaining-room ``K`` or a top_k ``k`` that disagree
(``k_mismatch``); a cutoff that is not the K-th value of top_k of the same scores (``cutoff_form``).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnpass.ir import Graph, Node

from ..infra.rewrite import Decline

_COMPARE = {"greater": ("gt", False), "less": ("gt", True), "greater_equal": ("ge", False),
            "less_equal": ("ge", True), "equal": ("eq", False)}  # fmt: skip


@dataclass(frozen=True)
class ValueCutoff:
    """A proven value-cutoff selection: ``selected`` (bool ``[..., T]``) holds at most ``top_k`` cells per row."""

    selected: str
    scores: str
    cutoff: str
    top_k: int
    kv_len: int


def _compare(node: Node) -> tuple[str, str, str] | None:
    """``(kind, lhs, rhs)`` of a comparison read as ``lhs > rhs``, ``lhs >= rhs`` or ``lhs == rhs``."""
    if node.op not in _COMPARE:
        return None
    kind, swap = _COMPARE[node.op]
    a, b = node.inputs
    return (kind, b, a) if swap else (kind, a, b)


def _splat_int(graph: Graph, name: str) -> int | None:
    node = graph.node(name)
    if node.op == "constant" and len(set(node.attrs["value"])) == 1 and not node.type.dtype.is_float:
        return int(node.attrs["value"][0])
    return None


def _through_reshapes(graph: Graph, node: Node) -> Node:
    while node.op == "reshape":
        node = graph.node(node.inputs[0])
    return node


def _cutoff(graph: Graph, name: str, scores: str) -> tuple[int, Node] | Decline:
    """``(K, argtopk)`` when ``name`` is the K-th value of ``top_k(scores, K)`` along the keys."""
    node = _through_reshapes(graph, graph.node(name))
    what = f"cutoff {name} ({node.op})"
    if node.op != "slice":
        return Decline("cutoff_form", f"{what} is not the last of top_k's values (a slice [..., K-1])", name)
    values = graph.node(node.inputs[0])
    last = values.type.rank - 1
    k = values.type.shape[-1] if values.type.rank else 0
    whole = all((a, b, c) == (0, n, 1) for axis, (a, b, c, n) in enumerate(
        zip(node.attrs["start"], node.attrs["stop"], node.attrs["step"], values.type.shape)) if axis != last)  # fmt: skip
    if (
        not whole
        or (node.attrs["start"][last], node.attrs["stop"][last]) != (k - 1, k)
        or values.op != "take_along_axis"
    ):
        return Decline("cutoff_form", f"{what} is not [..., K-1] of take_along_axis(scores, argtopk)", name)
    source, idx = (graph.node(i) for i in values.inputs)
    if idx.op != "argtopk" or values.attrs["axis"] % values.type.rank != last:
        return Decline("cutoff_form", f"{what}: the values are read at {idx.op} {idx.name}, not an argtopk", name)
    if source.name != scores or idx.inputs[0] != scores or idx.attrs["axis"] % idx.type.rank != last:
        return Decline(
            "cutoff_form",
            f"{what} is top_k of {idx.inputs[0]} read from {source.name}, not of the compared scores {scores}",
            name,
        )
    return idx.attrs["k"], idx


def _rank(graph: Graph, name: str, axis: int) -> str | Decline:
    """The bool counted when ``name`` is ``cumsum(cast(bool, int), axis)`` (inclusive, forward)."""
    node = graph.node(name)
    if node.op != "scan" or node.attrs["kind"] != "sum" or node.attrs["reverse"] or not node.attrs["inclusive"]:
        return Decline("cutoff_form", f"rank {name} ({node.op}) is not an inclusive forward cumsum", name)
    if node.attrs["axis"] % node.type.rank != axis:
        return Decline(
            "scan_axis",
            f"cumsum {name} runs along axis {node.attrs['axis']}, not the keys ({axis}): it ranks other cells",
            name,
            data={"axis": node.attrs["axis"], "keys": axis},
        )
    counted = graph.node(node.inputs[0])
    if counted.op == "cast" and not counted.type.dtype.is_float:
        counted = graph.node(counted.inputs[0])
    return counted.name


def _bounded(graph: Graph, node: Node) -> tuple[str, str, str] | None:
    """``(cells, rank, bound)`` of ``cells & (rank <= bound)`` (either operand order), or None."""
    if node.op != "logical_and":
        return None
    first, second = node.operands.values()  # logical_and: two operands, neither optional
    for cells, test in ((first, second), (second, first)):
        cmp = _compare(graph.node(test))
        if cmp is not None and cmp[0] == "ge":  # bound >= rank
            return cells, cmp[2], cmp[1]
    return None


def _term(graph: Graph, name: str) -> tuple[str, str, str, str, str, str] | None:
    """``(kind, scores, cutoff, cells, rank, bound)`` of a term ``(s kind c) & (rank <= bound)``, or None."""
    bounded = _bounded(graph, graph.node(name))
    if bounded is None:
        return None
    cells, rank, bound = bounded
    cmp = _compare(graph.node(cells))
    if cmp is None or cmp[0] == "ge":
        return None
    kind, s, c = cmp
    if kind == "eq" and graph.node(s).type.shape[-1:] == (1,):  # c == s written the other way round
        s, c = c, s
    return kind, s, c, cells, rank, bound


def _looks_like_cutoff(graph: Graph, node: Node) -> tuple[str, str] | None:
    """``(scores, cutoff)`` when ``node`` compares scores with a top-k cutoff (any kind), else None."""
    cmp = _compare(node)
    if cmp is None:
        return None
    for s, c in ((cmp[1], cmp[2]), (cmp[2], cmp[1])):
        if not isinstance(_cutoff(graph, c, s), Decline):
            return s, c
    return None


def match_value_cutoff(graph: Graph, node: Node) -> ValueCutoff | Decline | None:
    """The value-cutoff selection ``node`` computes (module docstring), a Decline for a look-alike, or None
    when ``node`` does not compare scores with a top-k cutoff at all."""
    if node.type.dtype.value != "bool" or node.type.rank == 0:
        return None
    seen = _looks_like_cutoff(graph, node)
    if seen is not None:
        kind = _compare(node)[0]
        if kind == "ge":
            return Decline(
                "ties_unbounded",
                f"{node.name} is scores >= cutoff: every tie at the K-th value is selected, more than K cells when "
                "ties straddle it (MaxText's indexer_mask_exact_topk=False)",
                node.name,
            )
        return Decline(
            "missing_tie_term",
            f"{node.name} compares scores with the top-k cutoff ({kind}) alone: not top_k's K cells",
            node.name,
        )
    terms = [node.name] if node.op == "logical_and" else list(node.inputs) if node.op == "logical_or" else []
    parsed = [_term(graph, t) for t in terms]
    if not parsed or any(p is None for p in parsed):
        return None
    strict = [p for p in parsed if p[0] == "gt"]
    ties = [p for p in parsed if p[0] == "eq"]
    if not any(not isinstance(_cutoff(graph, p[2], p[1]), Decline) for p in parsed):
        return None
    if len(strict) != 1 or len(ties) != 1:
        form = "not (s > c & rank <= K) | (s == c & rank <= K - min(n, K))"
        if not ties:
            return Decline("missing_tie_term", f"{node.name} has no tie (scores == cutoff) term: {form}", node.name)
        return Decline("cutoff_form", f"{node.name} has no strict (scores > cutoff) term: {form}", node.name)
    (_, s, c, above, a_rank, a_bound), (_, s2, c2, equal, b_rank, b_bound) = strict[0], ties[0]
    if (s, c) != (s2, c2):
        return Decline("cutoff_form", f"{node.name}'s terms compare {s} with {c} and {s2} with {c2}", node.name)
    found = _cutoff(graph, c, s)
    if isinstance(found, Decline):
        return found
    k, _idx = found
    axis = graph.node(s).type.rank - 1
    ranks = [_rank(graph, a_rank, axis), _rank(graph, b_rank, axis)]
    for r in ranks:
        if isinstance(r, Decline):
            return r
    if ranks != [above, equal]:
        return Decline(
            "cutoff_form",
            f"{node.name}'s ranks count {ranks[0]} and {ranks[1]}, not their own terms' cells {above} and {equal}",
            node.name,
        )
    room = _room(graph, b_bound, a_rank, axis)
    if isinstance(room, Decline):
        return room
    bounds = {"top_k's k": k, "the rank bound": _splat_int(graph, a_bound), "the remaining room's K": room}
    if len(set(bounds.values())) != 1:
        said = ", ".join(f"{w} {v}" for w, v in bounds.items())
        return Decline("k_mismatch", f"{node.name}: {said} differ: not one K", node.name, data={"k": k})
    kv_len = graph.node(s).type.shape[-1]
    return ValueCutoff(node.name, s, c, k, kv_len)


def _room(graph: Graph, name: str, a_rank: str, axis: int) -> int | Decline:
    """K when ``name`` is ``K - min(a[..., -1:], K)`` (the room left for ties), ``a`` the strict rank."""
    node = graph.node(name)
    if _splat_int(graph, name) is not None:
        return Decline(
            "ties_unbounded",
            f"tie bound {name} is the constant {_splat_int(graph, name)}, not K - min(count above, K): ties are kept "
            "whatever the cells above take, up to 2K - 1 cells",
            name,
        )
    if node.op != "sub" or _splat_int(graph, node.inputs[0]) is None:
        return Decline("cutoff_form", f"tie bound {name} ({node.op}) is not K - min(count above, K)", name)
    k, low = _splat_int(graph, node.inputs[0]), graph.node(node.inputs[1])
    if low.op != "minimum":
        return Decline("cutoff_form", f"tie bound {name} subtracts {low.op} {low.name}, not min(count, K)", name)
    consts = [_splat_int(graph, i) for i in low.inputs]
    count = graph.node(low.inputs[1] if consts[0] is not None else low.inputs[0])
    cap = consts[0] if consts[0] is not None else consts[1]
    last = count.type.rank - 1
    if count.op != "slice" or count.inputs[0] != a_rank or cap is None:
        return Decline("cutoff_form", f"tie bound {name}: {low.name} is not min(cumsum above [..., -1:], K)", name)
    n = graph.node(a_rank).type.shape[axis]
    src = graph.node(a_rank).type.shape
    rows = [(count.attrs["start"][a], count.attrs["stop"][a], count.attrs["step"][a]) for a in range(last)]
    if (count.attrs["start"][last], count.attrs["stop"][last]) != (n - 1, n) or rows != [
        (0, src[a], 1) for a in range(last)
    ]:
        return Decline(
            "cutoff_form", f"tie bound {name}: {count.name} is not each row's last cell of the strict rank", name
        )
    return k if cap == k else Decline("k_mismatch", f"tie bound {name} is {k} - min(count, {cap})", name)


def find_value_cutoff(graph: Graph, mask: Node, limit: int = 400) -> ValueCutoff | Decline | None:
    """The value-cutoff selection nearest ``mask`` among its ancestors (breadth first, at most ``limit``
    nodes), the Decline of the nearest look-alike, or None when no ancestor compares scores with a cutoff."""
    frontier, seen = [mask.name], {mask.name}
    while frontier and len(seen) <= limit:
        node = graph.node(frontier.pop(0))
        found = match_value_cutoff(graph, node)
        if found is not None:
            return found
        for i in node.inputs:
            if i not in seen:
                seen.add(i)
                frontier.append(i)
    return None


__all__ = ["ValueCutoff", "find_value_cutoff", "match_value_cutoff"]
