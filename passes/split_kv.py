"""Split-KV attention (flash-decoding): attend T-shards of the keys separately, combine them exactly.

``sdpa(q, k, v, mask)`` over ``T`` keys becomes, for ``n`` shards of ``Tn = T / n``
keys, one batched partial attention whose leading axis enumerates
``(shard, stream)`` pairs, its ``sdpa_lse`` companion, and a float32 combine::

    o_i, l_i = sdpa(q, k_i, v_i, m_i), sdpa_lse(q, k_i, v_i, m_i)     # shard i, [n*B, ...]
    w_i = exp(l_i - max_j l_j);  out = sum_i w_i * o_i / sum_i w_i

which is exactly softmax over all keys (each key lies in one shard). The K/V
reshapes keep the shard axis outermost, so a mesh axis over it gives each
device whole shards and the only cross-shard traffic is the combine (a max
and two sums over ``[B, Hq, S(, Dv)]``).

Forms:

- dense: ``k``/``v`` are read whole (``[B, Hkv, T, D]``); a causal attribute
  becomes an explicit bool mask compared from iotas (the shards need their own
  key offsets; each device computes only its part);
- gathered (QSA, ``qsa-gather{batched=false}``): ``k = take(K, cells,
  axis=2)`` and ``v = take(V, cells, axis=2)`` with the same 1-D ``cells``; the
  gather *source* is split. Every shard gathers ``cells % Tn`` from its own
  slice and masks the slots whose cell it does not own, so each slot is
  attended by exactly the shard holding it (compute per shard stays O(W); only
  K/V storage is split);
- batched gathered (QSA, ``qsa-gather``'s default): ``k = reshape(take(
  reshape(K, [B*Hkv*T, D]), rows, axis=0), [B*S, Hkv, W, D])`` (and ``v`` by the
  same ``rows``) with ``rows = cells + (b*Hkv + h)*T``, ``cells`` int32 ``[B, S,
  1, W]`` (see :func:`match_row_gather`). The same as the gathered form, per
  (stream, row): every shard gathers ``cells % Tn`` from its own slice with one
  ``take_along_axis`` that keeps the shard, stream and KV-head axes array axes
  (:func:`gather_rows`), and masks the slots it does not own.

Numerics: partials are rounded to the sdpa's dtype before the float32 combine
(rounding-class vs the unsplit call). A shard whose keys are all masked has
``l_i = -inf`` (``sdpa_lse`` of a row without keys), so ``w_i = 0`` and its
partial is discarded. A row that attends no key at all stays the mean of V
over all keys (docs/semantics.md §4), as the unsplit sdpa gives it:

- dense, bool mask or causal: every shard's partial is the mean of its own V
  and every ``l_i`` is -inf; the combine then weighs the shards equally (they
  all hold ``T / n`` keys);
- dense, an additive mask with causal rows that see no key (bottom-right,
  ``S > T``): those rows get a zero query and a zero mask, as the lowering
  gives them, so every shard weighs its keys equally and ``l_i = log(T / n)``;
- gathered, a bool mask: rows it leaves without any slot get a zero query and
  attend every slot they own, so each shard averages the slots it owns and
  weighs that by their number (``l_i = log(owned)``).

An additive mask that is -inf on a whole row is NaN there, split or not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import DType, Graph, Node
from attnpass.ir.dialects.attention import sdpa_operands

from .base import Pass, Remarks, require_int
from .registry import register_pass
from .rewrite import Decline, Rewriter, Rule, apply_rules

Labels = Sequence["str | None"]  # per dimension: "batch", "heads", "shard" or None
Place = Callable[[str, Labels], None]  # annotate a value from its dimension labels


def no_placement(value: str, labels: Labels) -> None:
    """The :data:`Place` of a split without a mesh: nothing is annotated."""


@dataclass(frozen=True)
class SplitPlan:
    """How to split one sdpa: ``shards`` of the T axis of ``k_source``/``v_source`` (gathered: by ``cells``)."""

    shards: int
    k_source: str
    v_source: str
    cells: str | None  # the gathered form's cell indices (1-D, or [B, S, 1, W] batched), None for the dense form
    kv_len: int
    batched: bool = False  # the batched multi-row gather form (cells [B, S, 1, W])
    sinks: bool = False
    softcap: float | None = None

    def describe(self) -> str:
        form = (
            f"gathered form{' (batched rows)' if self.batched else ''}: each shard gathers {self.cells} % "
            f"{self.kv_len // self.shards} from its own slice and masks the cells it does not own"
            if self.cells
            else "dense form"
        )
        return (
            f"{self.shards} T-shards of {self.kv_len // self.shards} keys (kv_len {self.kv_len}) of "
            f"{self.k_source}/{self.v_source}: one batched partial sdpa + sdpa_lse, combined exactly in "
            f"float32 by log-sum-exp weights; {form}"
            + (f"; logit_softcap {self.softcap:g} kept by every partial and its sdpa_lse" if self.softcap else "")
            + ("; sinks added once, to the combine's denominator (weight exp(sink - max))" if self.sinks else "")
        )


def is_split_partial(graph: Graph, node: Node) -> bool:
    """Whether ``node`` (an sdpa) already has its ``sdpa_lse`` companion: a split-KV partial."""
    return any(
        u.op == "sdpa_lse" and u.inputs == node.inputs and u.attrs == node.attrs for u in graph.users(node.inputs[0])
    )


@dataclass(frozen=True)
class RowGather:
    """The batched multi-row QSA gather feeding an sdpa (``qsa-gather``'s default form)::

        k = reshape(take(reshape(K, [B*Hkv*T, D]), rows, axis=0), [B*S, Hkv, W, D])   # v alike, same rows
        rows = cells + base,  base[b, 0, h, 0] = (b*Hkv + h) * T   (no base when B*Hkv == 1)

    so row ``(b, s)`` of the sdpa's batch reads ``K[b, h, cells[b, s, 0, :]]`` for every KV head ``h``, given
    cells in ``[0, T)`` (as ``qsa_cells`` makes them; the rewrites assume it, like the per-row form's ``take``).
    """

    k_source: str  # K [B, Hkv, T, D]
    v_source: str  # V [B, Hkv, T, Dv]
    cells: str  # int32 [B, S, 1, W], each in [0, T)
    streams: int
    rows: int


def match_row_gather(graph: Graph, k: Node, v: Node) -> RowGather | None:
    """``k``/``v`` as the batched gather form; None when they are not gathered exactly that way (any other
    form is then handled as before: a dense split reads ``k``/``v`` whole)."""
    takes = [graph.node(x.inputs[0]) if x.op == "reshape" else None for x in (k, v)]
    if any(t is None or t.op != "take" or t.type.rank != 5 or t.attrs["axis"] % 2 for t in takes):
        return None
    kt, vt = takes
    assert kt is not None and vt is not None
    flats = [graph.node(t.inputs[0]) for t in (kt, vt)]
    if any(f.op != "reshape" or f.type.rank != 2 or graph.node(f.inputs[0]).type.rank != 4 for f in flats):
        return None
    ks, vs = (graph.node(f.inputs[0]) for f in flats)
    (b, hkv, t, _), (vb, vh, vtn, _) = ks.type.shape, vs.type.shape
    if kt.inputs[1] != vt.inputs[1] or (b, hkv, t) != (vb, vh, vtn):
        return None
    rows = graph.node(kt.inputs[1])
    if rows.type.rank != 4:
        return None
    bs, s, hr, width = rows.type.shape
    if (bs, hr) != (b, hkv) or (k.type.shape, v.type.shape) != (
        (b * s, hkv, width, ks.type.shape[3]),
        (b * s, hkv, width, vs.type.shape[3]),
    ):
        return None
    if b == 1 and hkv == 1:  # one plane: the rows are the cells
        return RowGather(ks.name, vs.name, rows.name, b, s)
    if rows.op != "add":
        return None
    bases = tuple((i * hkv + h) * t for i in range(b) for h in range(hkv))
    for x, y in (rows.inputs, rows.inputs[::-1]):
        base = graph.node(y)
        if (
            base.op == "constant"
            and base.type.shape == (b, 1, hkv, 1)
            and tuple(base.attrs["value"]) == bases
            and graph.node(x).type.shape == (b, s, 1, width)
        ):
            return RowGather(ks.name, vs.name, x, b, s)
    return None


def gather_rows(rw: Rewriter, source: str, cells: str, place: Place, hint: str) -> str:
    """``source [N, B, Hkv, T, D]`` at ``cells [B, S, 1, W]`` -> ``[N*B*S, Hkv, W, D]``: for every ``n``, stream
    ``b``, row ``s`` and KV head ``h``, ``source[n, b, h, cells[b, s, 0, :]]``. One ``take_along_axis`` whose
    other axes (``N``, streams, KV heads, features) stay array axes, so a mesh axis over any of them needs no
    communication; the same rows, bit for bit, as the flat gather of the batched form."""
    n, b, h, t, d = rw.type(source).shape
    _b, s, _one, width = rw.type(cells).shape
    lead = "shard" if n > 1 else None
    x = rw.reshape(source, (n, b, 1, h, t, d), f"{hint}_source")
    place(x, (lead, "batch", None, "heads", None, None))
    idx = rw.reshape(cells, (1, b, s, 1, width, 1), f"{hint}_index")
    out = rw.op("take_along_axis", [x, idx], {"axis": 4}, hint)
    place(out, (lead, "batch", None, "heads", None, None))
    out = rw.reshape(out, (n * b * s, h, width, d), hint)
    place(out, ("shard" if n > 1 else "batch", "heads", None, None))
    return out


def match_split(graph: Graph, node: Node, shards: int) -> SplitPlan | Decline:
    """The plan for splitting ``node`` into ``shards`` T-shards, or the precondition that failed."""
    if is_split_partial(graph, node):
        return Decline("already a split-KV partial (its sdpa_lse companion reads the same operands)")
    if node.attrs["window"] is not None:
        return Decline(f"window={tuple(node.attrs['window'])}: split-kv does not carry a structured mask to its shards")
    k, v = graph.node(node.inputs[1]), graph.node(node.inputs[2])
    row_gather = match_row_gather(graph, k, v)
    gathered = k.op == "take" and v.op == "take"
    if row_gather is not None:
        if node.attrs["causal"] != "none":
            return Decline(f"gathered attention with causal={node.attrs['causal']!r}: key positions are gathered")
        k_source, v_source = row_gather.k_source, row_gather.v_source
    elif gathered:
        if k.inputs[1] != v.inputs[1] or any(n.attrs["axis"] % 4 != 2 for n in (k, v)):
            return Decline(f"k {k.name} and v {v.name} are takes, but not along T by the same cells")
        cells = graph.node(k.inputs[1])
        if cells.type.rank != 1:
            return Decline(f"the gathered cells {cells.name} are {cells.type}, not one 1-D index vector")
        if node.attrs["causal"] != "none":
            return Decline(f"gathered attention with causal={node.attrs['causal']!r}: key positions are gathered")
        k_source, v_source = k.inputs[0], v.inputs[0]
    else:
        k_source, v_source = k.name, v.name
    kv_len = graph.node(k_source).type.shape[2]
    keys = k.type.shape[2]
    mask, sinks = sdpa_operands(node.inputs, node.attrs["has_sinks"])
    if mask is not None and graph.node(mask).type.shape[-1:] != (keys,):
        return Decline(f"the mask {mask} broadcasts over the keys (last dimension is not {keys})")
    if sinks is not None and (row_gather is not None or gathered):
        return Decline("sinks with the gathered form: its rows without a slot are the mean of V, not 0")
    if kv_len % shards:
        return Decline(f"kv_len {kv_len} of {k_source} is not divisible by {shards} shards")
    variants = {"sinks": sinks is not None, "softcap": node.attrs["logit_softcap"]}
    if row_gather is not None:
        return SplitPlan(shards, k_source, v_source, row_gather.cells, kv_len, batched=True, **variants)
    return SplitPlan(shards, k_source, v_source, k.inputs[1] if gathered else None, kv_len, **variants)


def rewrite_split(rw: Rewriter, plan: SplitPlan, place: Place) -> str:
    """Build the split attention for the anchor sdpa; returns the combined output (not yet replacing it)."""
    node, n = rw.anchor, plan.shards
    q = node.inputs[0]
    b, hq, s, d = rw.type(q).shape
    dv = rw.type(node.inputs[2]).shape[3]
    tn = plan.kv_len // n
    name = node.name
    mask, sinks = sdpa_operands(node.inputs, node.attrs["has_sinks"])
    bool_mask = mask is not None and rw.type(mask).dtype is DType.bool
    live = None  # bool [1, 1, S, 1]: the rows causality leaves a key (None: all), when the mask is additive
    if plan.cells is None and mask is not None and not bool_mask and sinks is None:  # with sinks such a row is 0
        live = _causal_live_rows(rw, node.attrs["causal"], s, plan.kv_len)
        if live is not None:  # rows without keys: zero query (and zero mask below), equal weights
            q = rw.op("where", [live, q, rw.scalar(0.0, rw.type(q).dtype, "zero")], hint=f"{name}_q_live")
    elif plan.cells is not None and bool_mask:
        assert mask is not None
        mask, no_slot = _no_slot_rows(rw, mask)  # rows without slots: zero query, every owned slot
        q = rw.op("where", [no_slot, rw.scalar(0.0, rw.type(q).dtype, "zero"), q], hint=f"{name}_q_live")
    if q != node.inputs[0]:
        place(q, ("batch", "heads", None, None))
    q_rep = rw.broadcast(q, (n, b, hq, s, d), f"{name}_q_rep")
    place(q_rep, ("shard", "batch", "heads", None, None))
    q_rep = rw.reshape(q_rep, (n * b, hq, s, d), f"{name}_q_rep")
    place(q_rep, ("shard", "heads", None, None))
    if plan.cells is None:
        k_split = _split_keys(rw, plan.k_source, n, place, f"{name}_k_split")
        v_split = _split_keys(rw, plan.v_source, n, place, f"{name}_v_split")
        mask = None if mask is None else _split_mask(rw, mask, n, b, hq, place)
        if node.attrs["causal"] != "none":
            seen = _causal_split(rw, node.attrs["causal"], s, plan.kv_len, n, b, place)
            mask = seen if mask is None else _and_mask(rw, mask, seen, hq, place, live)
    elif plan.batched:  # per (stream, row): the cells [B, S, 1, W] of this batch row
        local, owned = _owned_cells(rw, plan.cells, n, tn)
        k5 = _split_keys5(rw, plan.k_source, n, place, f"{name}_k_split")
        v5 = _split_keys5(rw, plan.v_source, n, place, f"{name}_v_split")
        k_split = gather_rows(rw, k5, local, place, f"{name}_k_gathered")
        v_split = gather_rows(rw, v5, local, place, f"{name}_v_gathered")
        mask = _owned_mask(rw, mask, owned, n, b, hq, s, place)
    else:
        local, owned = _owned_cells(rw, plan.cells, n, tn)
        k_split = _split_keys(rw, plan.k_source, n, place, f"{name}_k_split")
        v_split = _split_keys(rw, plan.v_source, n, place, f"{name}_v_split")
        k_split = rw.op("take", [k_split, local], {"axis": 2}, f"{name}_k_gathered")
        v_split = rw.op("take", [v_split, local], {"axis": 2}, f"{name}_v_gathered")
        for value in (k_split, v_split):
            place(value, ("shard", "heads", None, None))
        mask = _owned_mask(rw, mask, owned, n, b, hq, s, place)
    operands = [q_rep, k_split, v_split] + ([mask] if mask is not None else [])
    attrs = {"scale": node.attrs["scale"], "causal": "none", "logit_softcap": node.attrs["logit_softcap"]}
    partial = rw.op("sdpa", operands, attrs, f"{name}_partial")
    place(partial, ("shard", "heads", None, None))
    lse = rw.op("sdpa_lse", operands, attrs, f"{name}_lse")
    place(lse, ("shard", "heads", None))
    return _combine(rw, partial, lse, (n, b, hq, s, dv), node.type.dtype, place, sinks)


def _split_keys5(rw: Rewriter, x: str, n: int, place: Place, hint: str) -> str:
    """``[B, H, T, E] -> [n, B, H, T/n, E]``, the shard axis outermost (shared by every sdpa splitting ``x``)."""
    b, h, t, e = rw.type(x).shape
    r = _reuse(rw, "reshape", x, {"shape": (b, h, n, t // n, e)}, hint)
    place(r, ("batch", "heads", "shard", None, None))
    r = _reuse(rw, "transpose", r, {"perm": (2, 0, 1, 3, 4)}, hint)
    place(r, ("shard", "batch", "heads", None, None))
    return r


def _split_keys(rw: Rewriter, x: str, n: int, place: Place, hint: str) -> str:
    """``[B, H, T, E] -> [n*B, H, T/n, E]``, the shard axis outermost (shared by every sdpa splitting ``x``)."""
    b, h, t, e = rw.type(x).shape
    r = _split_keys5(rw, x, n, place, hint)
    r = _reuse(rw, "reshape", r, {"shape": (n * b, h, t // n, e)}, hint)
    place(r, ("shard", "heads", None, None))
    return r


def _split_mask(rw: Rewriter, mask: str, n: int, b: int, hq: int, place: Place) -> str:
    """A mask broadcastable to ``[B, Hq, S, T]`` as ``[n*B, Hm, S, T/n]`` matching the split keys."""
    shape = rw.type(mask).shape
    bm, hm, s, t = (1,) * (4 - len(shape)) + shape
    heads = "heads" if hm == hq else None
    place(mask, (("batch" if bm == b else None, heads, None, "shard"))[4 - len(shape) :])  # e.g. a folded causal mask
    hint = f"{mask}_split"
    r = _reuse(rw, "reshape", mask, {"shape": (bm, hm, s, n, t // n)}, hint)
    r = _reuse(rw, "transpose", r, {"perm": (3, 0, 1, 2, 4)}, hint)
    if bm != b:
        r = _reuse(rw, "broadcast_to", r, {"shape": (n, b, hm, s, t // n)}, hint)
    place(r, ("shard", "batch", heads, None, None))
    r = _reuse(rw, "reshape", r, {"shape": (n * b, hm, s, t // n)}, hint)
    place(r, ("shard", heads, None, None))
    return r


def _reuse(rw: Rewriter, op: str, x: str, attrs: dict, hint: str) -> str:
    """``op[attrs](x)``: an existing such node if there is one (the split of a shared K/V or mask), else a new one."""
    for user in rw.graph.users(x):
        if user.op == op and user.inputs == (x,) and dict(user.attrs) == attrs:
            return user.name
    return rw.op(op, [x], attrs, hint)


def _causal_split(rw: Rewriter, causal: str, s: int, t: int, n: int, b: int, place: Place) -> str:
    """The causal attribute as a bool ``[n*B, 1, S, T/n]`` in the split layout: key ``j`` of shard ``i`` is seen by
    row ``r`` iff ``i*T/n + j <= r + offset``, from iotas (so each device computes only its own keys' part)."""
    tn, shape = t // n, (n * b, 1, 1, t // n)
    shard = rw.op("iota", [], {"shape": shape, "axis": 0}, "key_shard")
    if b > 1:  # the leading axis enumerates (shard, stream) pairs
        shard = rw.op("floor_divide", [shard, rw.scalar(b, DType.int32, "streams")], hint="key_shard")
    start = rw.op("mul", [shard, rw.scalar(tn, DType.int32, "shard_len")], hint="key_start")
    key = rw.op("add", [start, rw.op("iota", [], {"shape": shape, "axis": 3}, "key_local")], hint="key_position")
    offset = t - s if causal == "bottom_right" else 0
    row = rw.op("iota", [], {"shape": (1, 1, s, 1), "axis": 2}, "query_row")
    last = rw.op("add", [row, rw.scalar(offset, DType.int32, "causal_offset")], hint="last_key")
    seen = rw.op("greater_equal", [last, key], hint="causal")
    for value in (shard, start, key, seen):
        place(value, ("shard", None, None, None))
    return seen


def _causal_live_rows(rw: Rewriter, causal: str, s: int, t: int) -> str | None:
    """bool ``[1, 1, S, 1]``: the query rows that causality leaves at least one key; None when that is every row."""
    dead = min(s, max(0, s - t)) if causal == "bottom_right" else 0
    if not dead:
        return None
    row = rw.op("iota", [], {"shape": (1, 1, s, 1), "axis": 2}, "query_row")
    return rw.op("greater_equal", [row, rw.scalar(dead, DType.int32, "first_live_row")], hint="live_row")


def _no_slot_rows(rw: Rewriter, mask: str) -> tuple[str, str]:
    """A bool mask (last axis: the slots) as ``(mask | no_slot, no_slot)``, 4-D; ``no_slot`` is ``[.., 1]``:
    the rows the mask lets attend no slot at all."""
    shape = rw.type(mask).shape
    if len(shape) < 4:
        mask = rw.reshape(mask, (1,) * (4 - len(shape)) + shape, f"{mask}_4d")
    seen = rw.op("max", [rw.cast(mask, DType.int32, f"{mask}_count")], {"axes": (3,), "keepdims": True}, "row_seen")
    no_slot = rw.op("equal", [seen, rw.scalar(0, DType.int32, "zero_slots")], hint="no_slot_row")
    return rw.op("logical_or", [mask, no_slot], hint=f"{mask}_or_all"), no_slot


def _and_mask(rw: Rewriter, mask: str, seen: str, hq: int, place: Place, live: str | None) -> str:
    """A split mask (bool, or additive in q's dtype) restricted to the keys ``seen`` allows; an additive mask
    is 0, not -inf, on the rows outside ``live`` (the rows without any key, whose query is zero)."""
    if rw.type(mask).dtype is DType.bool:
        both = rw.op("logical_and", [mask, seen], hint="causal_mask")
    else:
        dtype = rw.type(mask).dtype
        fill = rw.scalar(-math.inf, dtype, "neg_inf")
        if live is not None:
            fill = rw.op("where", [live, fill, rw.scalar(0.0, dtype, "zero")], hint="causal_fill")
        both = rw.op("where", [seen, mask, fill], hint="causal_mask")
    place(both, ("shard", "heads" if rw.type(both).shape[1] == hq else None, None, None))
    return both


def _owned_cells(rw: Rewriter, cells: str, n: int, tn: int) -> tuple[str, str]:
    """``(cells % Tn, owner == shard)``: the local index of every slot, and ``bool[n, R, 1, 1, W]`` of who holds
    it, ``R`` the sdpa batch rows the cells belong to (1 for 1-D cells; ``B*S`` for batched ``[B, S, 1, W]``)."""
    shape = rw.type(cells).shape
    rows, width = math.prod(shape[:-1]), shape[-1]
    size = rw.scalar(tn, DType.int32, "shard_len")
    owner = rw.op("floor_divide", [cells, size], hint="cell_shard")
    local = rw.op("sub", [cells, rw.op("mul", [owner, size], hint="shard_start")], hint="cell_local")
    ids = {"value": tuple(range(n)), "shape": (n, 1, 1, 1, 1), "dtype": DType.int32}
    shards = rw.op("constant", [], ids, "shard_id")
    owned = rw.op("equal", [rw.reshape(owner, (1, rows, 1, 1, width)), shards], hint="cell_owned")
    return local, owned


def _owned_mask(rw: Rewriter, mask: str | None, owned: str, n: int, b: int, hq: int, s: int, place: Place) -> str:
    """The gathered sdpa's mask restricted to the slots each shard owns, as ``[n*B, Hm, Sm, W]``."""
    width = rw.type(owned).shape[-1]
    shape = rw.type(mask).shape if mask is not None else (1, 1, 1, width)
    _, hm, sm, _ = (1,) * (4 - len(shape)) + shape
    target = (n, b, hm, sm, width)
    own = rw.broadcast(owned, target, "cell_owned")
    if mask is not None:
        m = rw.broadcast(mask, target, f"{rw.anchor.name}_m_split")
        if rw.type(mask).dtype is DType.bool:
            own = rw.op("logical_and", [m, own], hint=f"{rw.anchor.name}_m_split")
        else:
            neg_inf = rw.scalar(-math.inf, rw.type(mask).dtype, "neg_inf")
            own = rw.op("where", [own, m, neg_inf], hint=f"{rw.anchor.name}_m_split")
    heads = "heads" if hm == hq else None
    place(own, ("shard", "batch", heads, None, None))
    own = rw.reshape(own, (n * b, hm, sm, width), f"{rw.anchor.name}_m_split")
    place(own, ("shard", heads, None, None))
    return own


def _combine(
    rw: Rewriter, partial: str, lse: str, shape: tuple[int, int, int, int, int], dtype: DType, place: Place,
    sinks: str | None = None,
) -> str:  # fmt: skip
    """``sum_i w_i o_i / sum_i w_i`` with ``w_i = exp(l_i - max_j l_j)`` in float32, cast back to ``dtype``.

    ``sinks`` ``[Hq]``: one more term of the denominator, once, ``exp(sink - max)`` (the max taken with it),
    carrying no value; a row no shard attends is then 0."""
    n, b, hq, s, dv = shape
    name = rw.anchor.name
    o = rw.cast(rw.reshape(partial, shape, f"{name}_parts"), DType.float32, f"{name}_parts")
    lse5 = rw.reshape(lse, (n, b, hq, s, 1), f"{name}_lse_parts")
    for value in (o, lse5):
        place(value, ("shard", "batch", "heads", None, None))
    peak = rw.op("max", [lse5], {"axes": (0,), "keepdims": True}, f"{name}_lse_max")
    sink = None
    if sinks is not None:
        sink = rw.reshape(rw.cast(sinks, DType.float32, f"{name}_sinks"), (1, 1, hq, 1, 1), f"{name}_sinks")
        peak = rw.op("maximum", [peak, sink], hint=f"{name}_lse_max")
    zero = rw.scalar(0.0, DType.float32, "zero")
    # No shard attends a key (every l_i = -inf): each partial is the mean of its T/n values; weigh them equally.
    none = rw.op("equal", [peak, rw.scalar(-math.inf, DType.float32, "neg_inf")], hint=f"{name}_no_key")
    shift = rw.op("sub", [lse5, rw.op("where", [none, zero, peak], hint=f"{name}_lse_max")], hint=f"{name}_lse_shift")
    weight = rw.op("exp", [rw.op("where", [none, zero, shift], hint=f"{name}_lse_shift")], hint=f"{name}_weight")
    dropped = rw.op("equal", [weight, zero], hint=f"{name}_dropped")  # a shard without keys: its partial may be NaN
    weighted = rw.op(
        "where", [dropped, zero, rw.op("mul", [weight, o], hint=f"{name}_weighted")], hint=f"{name}_weighted"
    )
    num = rw.op("sum", [weighted], {"axes": (0,)}, f"{name}_num")
    den = rw.op("sum", [weight], {"axes": (0,)}, f"{name}_den")
    if sink is not None:  # peak is finite here (at least the sink), so `none` is False
        sink_weight = rw.op("exp", [rw.op("sub", [sink, peak], hint=f"{name}_sink_shift")], hint=f"{name}_sink_weight")
        den = rw.op("add", [den, rw.reshape(sink_weight, (b, hq, s, 1), f"{name}_sink_weight")], hint=f"{name}_den")
    for value in (num, den):
        place(value, ("batch", "heads", None, None))
    out = rw.cast(rw.op("div", [num, den], hint=f"{name}_combined"), dtype, f"{name}_combined")
    place(out, ("batch", "heads", None, None))
    return out


@register_pass
@dataclass(frozen=True)
class SplitKV(Pass):
    """Split every ``sdpa``'s keys into ``shards`` T-shards, attended separately and combined exactly.

    Preconditions (one remark per sdpa): ``kv_len % shards == 0``; a gathered
    sdpa reads K and V through ``take`` along T by one 1-D cell vector and has
    no causal attribute; an sdpa that already has an ``sdpa_lse`` companion (a
    partial of an earlier split) is left alone, so running the pass again
    changes nothing.
    """

    name: ClassVar[str] = "split-kv"
    shards: int = 2

    def __post_init__(self) -> None:
        require_int("SplitKV", "shards", self.shards, minimum=2)

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        def rewrite(rw: Rewriter, plan: SplitPlan) -> None:
            rw.replace_matched(rewrite_split(rw, plan, no_placement), prune=True)

        rule = Rule("split-kv", "sdpa", lambda g, n: match_split(g, n, self.shards), rewrite, SplitPlan.describe)
        return bool(apply_rules(graph, [rule], remarks))


__all__ = [
    "Labels",
    "Place",
    "SplitKV",
    "SplitPlan",
    "RowGather",
    "gather_rows",
    "is_split_partial",
    "match_row_gather",
    "match_split",
    "no_placement",
    "rewrite_split",
]
