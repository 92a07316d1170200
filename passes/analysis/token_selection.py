"""DSA's token selection read from an sdpa mask: which ``K`` of the ``T`` cells each query row attends.

mlx-lm's ``deepseek_v32`` (and ``glm_moe_dsa``) call with more than one
query row builds its mask from the indexer's top-k positions ``idx``
(``i32 [B, 1, L, K]``, docs/mla.md)::

    sel  = put_along_axis(constant False [B, 1, L, T], idx, constant True, axis=-1)
    mask = where(sel, m, fill)        # or the bool sel itself
    mask = where(sel, cells, False)   # bool cells kept where selected

The last form is a block selection widened to its tokens (MiniMax-M3: each
row's top blocks, then its causal cells in them, both bool).

A bool mask that is neither reads a **value-cutoff selection** among its
ancestors (MaxText's DSA indexer: the cells at or above the K-th top-k value,
ties by rank, :mod:`.value_cutoff`), which holds at most ``K`` cells per row
for every input; the mask must be false wherever that selection is
(:mod:`.cell_implication`). Its indices are then ``argtopk(cast(sel, int32),
K)``, which the rewrite writes: every selected cell, distinct, and when a row
selects fewer than ``K`` the lowest-index unselected ones, which the mask
(gathered as the cells' values) keeps at weight 0. A row left with no key
(all ``K`` gathered cells false) is the mean of V over all ``T`` cells on the
masked path: the rewrite computes that row so (``keys="fallback"``). The
selection is ``[B, L, T]`` (one per query row) or ``[B, 1, T]`` with a mask of
one row (one per stream, shared by all its rows: MaxText's absorbed MLA folds
the query heads into the rows).

:func:`match_token_selection` reads that form off an ``sdpa`` and says
whether attention over each row's ``K`` indexed cells computes what the
masked call computes (up to summation order), or why not, as a
:class:`~..infra.rewrite.Decline`:

- the selection is head-shared (``[B, 1, L, T]``) and ``K < T``;
- ``fill`` is a constant at or below ``finfo(dtype).min`` (or ``-inf``): an
  unselected cell weighs exactly 0 once the row has a key;
- the indices of a row are distinct and in ``[0, T)``: proven when ``idx`` is
  an ``argpartition`` along the keys (or a contiguous slice of one), or
  promised by the caller for the graph input ``selection_input``;
- every row has a key: always for the bool selection itself and for a
  ``-inf`` fill (a row whose selected cells are all ``-inf`` is NaN on both
  paths); for bool cells filled with False, or a
  finite fill, only where the caller promises ``rows_have_keys`` (a row whose
  selected cells all hold the fill, or are all False, would weigh all ``T``
  cells equally masked, and only its ``K`` cells gathered).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnpass.ir import DType, Graph, Node

from ..infra.rewrite import Decline
from .cell_implication import implies_cellwise
from .value_cutoff import find_value_cutoff


@dataclass(frozen=True)
class TokenSelection:
    """A proven token selection: the indices, the per-cell values (None: the bool form) and why it is exact."""

    indices: str | None  # i32 [B, 1, L, K]; None: argtopk(cast(selected, int32), K), written by the rewrite
    values: str | None  # m of where(sel, m, fill); None when the mask is sel itself
    fill: float | None  # the where's fill; None for the bool forms (sel itself, or bool cells filled with False)
    top_k: int
    kv_len: int
    distinct: str  # "argpartition" (proven), "promised" (selection_input) or "argtopk" (of a value cutoff)
    keys: str  # why every row has a key: "bool", "neg_inf", "promised" (rows_have_keys); "fallback": not proven
    selected: str | None = None  # the value-cutoff selection (bool [..., T]) when indices is None

    @property
    def form(self) -> str:
        """``bool`` (sel itself), ``bool_where`` (bool cells kept where selected) or ``where`` (scores, fill)."""
        return "bool" if self.values is None else "bool_where" if self.fill is None else "where"

    @property
    def figures(self) -> dict:
        """The selection's figures by name (a remark's data)."""
        found = {
            "top_k": self.top_k, "kv_len": self.kv_len, "form": self.form,
            "fill": self.fill, "distinct": self.distinct, "keys": self.keys,
        }  # fmt: skip
        return found if self.selected is None else {**found, "selected": self.selected}


def check_promises(owner: str, selection_input: object, rows_have_keys: object) -> None:
    """A ValueError naming ``owner`` unless the promise options are a graph input's name (or None) and a bool."""
    if selection_input is not None and not (isinstance(selection_input, str) and selection_input.isidentifier()):
        raise ValueError(f"{owner}: selection_input must be a graph input's name or None, got {selection_input!r}")
    if not isinstance(rows_have_keys, bool):
        raise ValueError(f"{owner}: rows_have_keys must be True or False, got {rows_have_keys!r}")


def _splat(node: Node, value: object) -> bool:
    return node.op == "constant" and len(node.attrs["value"]) == 1 and node.attrs["value"][0] == value


def _distinct(graph: Graph, idx: Node, kv_len: int, selection_input: str | None) -> str | None:
    """How the indices are known distinct per row and in ``[0, T)``; None when they are not. A reshape that keeps
    the last axis keeps every row's indices as they were."""
    while idx.op == "reshape" and graph.node(idx.inputs[0]).type.shape[-1:] == idx.type.shape[-1:]:
        idx = graph.node(idx.inputs[0])
    if idx.op == "input":
        return "promised" if idx.name == selection_input else None
    if idx.op == "slice":  # mlx-lm keeps the last K of an argpartition: [..., -K:]
        last = idx.type.rank - 1
        whole = all(
            (a, b, c) == (0, n, 1)
            for axis, (a, b, c, n) in enumerate(zip(*(idx.attrs[k] for k in ("start", "stop", "step")), idx.type.shape))
            if axis != last
        )
        if not whole or idx.attrs["step"][last] != 1:
            return None
        idx = graph.node(idx.inputs[0])
    if idx.op != "argpartition" or idx.attrs["axis"] % idx.type.rank != idx.type.rank - 1:
        return None
    return "argpartition" if idx.type.shape[-1] == kv_len else None


def match_token_selection(
    graph: Graph, sdpa: Node, *, selection_input: str | None = None, rows_have_keys: bool = False
) -> TokenSelection | Decline:
    """The token selection of ``sdpa``'s mask (see the module docstring), or why it is not one we can gather."""
    mask = None if sdpa.mask is None else graph.node(sdpa.mask)
    if mask is None:
        return Decline("mask_not_selection", f"{sdpa.name} has no mask, so it attends no token selection")
    cond, values, fill = mask, None, None
    if mask.op == "where":
        cond, value, other = (graph.node(i) for i in mask.inputs)
        if not mask.type.dtype.is_float:
            if not _splat(other, False) or value.type.dtype is not DType.bool:
                what = f"constant {other.attrs['value'][0]!r}" if other.op == "constant" else f"{other.op} {other.name}"
                return Decline(
                    "mask_form",
                    f"mask {mask.name} is a bool where filling unselected cells with {what}: write it as "
                    "where(sel, bool cells, False) or where(sel, scores, fill)",
                )
            return _selection(graph, cond, value.name, None, sdpa, selection_input, rows_have_keys)
        lowest = float(mask.type.dtype.finfo.min)
        if other.op != "constant" or len(set(other.attrs["value"])) != 1 or not other.attrs["value"][0] <= lowest:
            what = f"constant {other.attrs['value'][0]!r}" if other.op == "constant" else f"{other.op} {other.name}"
            return Decline(
                "mask_form",
                f"mask {mask.name} fills unselected cells with {what}, not one constant <= finfo("
                f"{mask.type.dtype.value}).min = {lowest:g} (or -inf): they would not weigh exactly 0",
                data={"lowest": lowest},
            )
        values, fill = value.name, float(other.attrs["value"][0])
    elif mask.type.dtype is DType.bool and mask.op != "put_along_axis":
        found = find_value_cutoff(graph, mask)
        if found is not None:
            return (
                found if isinstance(found, Decline) else _value_cutoff(graph, sdpa, mask, found.selected, found.top_k)
            )
    return _selection(graph, cond, values, fill, sdpa, selection_input, rows_have_keys)


def _value_cutoff(graph: Graph, sdpa: Node, mask: Node, selected: str, top_k: int) -> TokenSelection | Decline:
    """The bool ``mask`` as a gather of the value-cutoff selection ``selected`` (module docstring), or why not."""
    (b, _h, rows, _d), kv_len = graph.node(sdpa.q).type.shape, graph.node(sdpa.k).type.shape[2]
    sel = graph.node(selected).type
    lead, per_row, shared = (tuple(d for d in shape if d != 1) for shape in (sel.shape[:-1], (b, rows), (b,)))
    _mb, mask_heads, mask_rows, _mt = (1,) * (4 - mask.type.rank) + mask.type.shape  # sdpa's [B, H, L, T] view
    if (
        sel.shape[-1] != kv_len
        or mask.type.shape[-1] != kv_len
        or mask_heads != 1
        or not ((lead == per_row and mask_rows == rows) or (lead == shared and mask_rows == 1))
    ):
        return Decline(
            "mask_layout",
            f"selection {selected} is {sel} and mask {mask.name} {mask.type}; the keys are T={kv_len}, the rows "
            f"[B, L] = {[b, rows]} with a head-shared mask of L rows (or one row of cells per stream, [B] = {[b]}, "
            "shared by all rows, with a mask of one row)",
            selected,
        )
    if top_k >= kv_len:
        return Decline(
            "little_gain",
            f"the selection keeps K={top_k} of T={kv_len} cells: a gather would read every cell",
            data={"top_k": top_k, "kv_len": kv_len},
        )
    unproven = implies_cellwise(graph, mask.name, selected)
    if unproven is not None:
        return unproven
    return TokenSelection(None, mask.name, None, top_k, kv_len, "argtopk", "fallback", selected)


def _selection(
    graph: Graph, cond: Node, values: str | None, fill: float | None, sdpa: Node, selection_input: str | None,
    rows_have_keys: bool,
) -> TokenSelection | Decline:  # fmt: skip
    """The selection ``cond`` writes, with the cell ``values`` kept where it selects (``fill`` elsewhere; None:
    False, for bool cells, or no values at all), or why it is not one we can gather."""
    (b, _h, rows, _d), kv_len = graph.node(sdpa.q).type.shape, graph.node(sdpa.k).type.shape[2]
    what = f"graph input {cond.name}" if cond.op == "input" else f"{cond.op} {cond.name}"
    if cond.op != "put_along_axis":
        return Decline("mask_not_selection", f"the selection is {what}, not put_along_axis(false, idx, true)")
    base, idx, written = (graph.node(i) for i in cond.inputs)
    if cond.type.dtype is not DType.bool or not (_splat(base, False) and _splat(written, True)):
        return Decline(
            "mask_not_selection",
            f"{cond.name} writes {written.op} {written.name} into {base.op} {base.name}: "
            "not constant True into constant False",
        )
    if cond.attrs["axis"] % cond.type.rank != cond.type.rank - 1:
        return Decline("mask_layout", f"{cond.name} writes along axis {cond.attrs['axis']}, not the keys (-1)")
    top_k = idx.type.shape[-1]
    want = (b, 1, rows, kv_len)
    if cond.type.shape != want or idx.type.shape != (b, 1, rows, top_k):
        return Decline(
            "mask_layout",
            f"{cond.name} is {cond.type} with indices {idx.type}; a head-shared token selection is "
            f"[B, 1, L, T] = {list(want)} with indices [B, 1, L, K]",
        )
    if top_k >= kv_len:
        return Decline(
            "little_gain",
            f"the selection keeps K={top_k} of T={kv_len} cells: a gather would read every cell",
            data={"top_k": top_k, "kv_len": kv_len},
        )
    distinct = _distinct(graph, idx, kv_len, selection_input)
    if distinct is None:
        promise = f"the promised selection_input {selection_input}" if selection_input else "no selection_input"
        return Decline(
            "indices_not_distinct",
            f"indices {idx.name} ({idx.op}) are neither an argpartition along the keys nor {promise}: "
            "a repeated index is one masked cell but two gathered ones",
        )
    if values is None:
        keys = "bool"
    else:
        keys = "neg_inf" if fill is not None and fill == -math.inf else "promised" if rows_have_keys else None
    if keys is None:
        what = "are all False" if fill is None else f"all hold fill {fill:g}"
        return Decline(
            "rows_without_keys",
            f"a row whose selected cells {what} weighs all T={kv_len} cells equally masked but only its K={top_k} "
            "gathered (promise rows_have_keys where every row has a key)",
            data={"fill": fill},
        )
    return TokenSelection(idx.name, values, fill, top_k, kv_len, distinct, keys)


__all__ = ["TokenSelection", "check_promises", "match_token_selection"]
