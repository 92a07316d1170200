"""Split-KV attention (flash-decoding): attend T-shards of the keys separately, combine them exactly.

``sdpa(q, k, v, mask)`` over ``T`` keys becomes, for ``n`` shards of ``T / n`` keys, one batched partial
attention whose leading axis enumerates ``(shard, stream)`` pairs, its ``sdpa_lse`` companion, and a float32
combine ``out = sum_i w_i o_i / sum_i w_i`` with ``w_i = exp(l_i - max_j l_j)``: exactly softmax over all keys.
The shard axis is outermost, so a mesh axis over it gives each device whole shards and only the combine crosses
devices.

Forms: dense (``k``/``v`` read whole; a causal attribute becomes an explicit mask with each shard's key offsets)
and gathered (``qsa-gather``'s ``qsa_gather`` form: the gather *source* is split, each shard attends the slots
it owns). Any other gather of the QSA cells is declined.

Numerics: partials are rounded to the sdpa's dtype before the float32 combine (rounding-class vs the unsplit
call); a row without keys stays the mean of V as the unsplit sdpa gives it (docs/semantics.md §4). In full:
docs/passes.md, "split-kv".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import DType, Graph, Node, require_int

from ..analysis.quantized_attention import NOT_CARRIED, decline_quantized
from ..infra.base import Pass, Remarks
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules

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
    cells: str | None  # the gathered form's cells [B, S, W] (qsa_gather's), None for the dense form
    kv_len: int
    sinks: bool = False
    softcap: float | None = None

    def describe(self) -> str:
        form = (
            f"gathered form (qsa_gather): each shard gathers {self.cells} % "
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
        u.op == "sdpa_lse" and u.operands == node.operands and u.attrs == node.attrs for u in graph.users(node.q)
    )


def gathers_qsa_cells(graph: Graph, node: Node) -> bool:
    """Whether ``node`` is a ``take``/``take_along_axis`` whose indices derive from a ``qsa_cells``: a QSA gather
    not in the ``qsa_gather`` form."""
    if node.op not in ("take", "take_along_axis"):
        return False
    return any(graph.node(n).op == "qsa_cells" for n in graph.ancestors([node.indices]))


def match_split(graph: Graph, node: Node, shards: int) -> SplitPlan | Decline:
    """The plan for splitting ``node`` into ``shards`` T-shards, or the precondition that failed."""
    if is_split_partial(graph, node):
        return Decline("already_done", "already a split-KV partial (its sdpa_lse companion reads the same operands)")
    if node.attrs["window"] is not None:
        return Decline(
            "unsupported_variant",
            f"window={tuple(node.attrs['window'])}: split-kv does not carry a structured mask to its shards",
        )
    k, v = graph.node(node.k), graph.node(node.v)
    gathered = k.op == "qsa_gather" or v.op == "qsa_gather"
    if gathered:
        if k.op != v.op or k.cells != v.cells:
            return Decline(
                "gather_form", f"k {k.name} ({k.op}) and v {v.name} ({v.op}) are not both qsa_gather of the same cells"
            )
        if node.attrs["causal"] != "none":
            return Decline(
                "unsupported_variant",
                f"gathered attention with causal={node.attrs['causal']!r}: key positions are gathered",
            )
        k_source, v_source = k.x, v.x
    else:
        stray = next((x for x in (k, v) if gathers_qsa_cells(graph, x)), None)
        if stray is not None:
            return Decline(
                "gather_form",
                f"{stray.name} gathers the QSA cells by {stray.op}, not by qsa_gather (qsa-gather's form): a dense "
                "split of the gathered values would have every device gather from all of K and V",
            )
        k_source, v_source = k.name, v.name
    kv_len = graph.node(k_source).type.shape[2]
    keys = k.type.shape[2]
    mask, sinks = node.mask, node.sinks
    if mask is not None and graph.node(mask).type.shape[-1:] != (keys,):
        return Decline("mask_layout", f"the mask {mask} broadcasts over the keys (last dimension is not {keys})")
    if sinks is not None and gathered:
        return Decline(
            "rows_without_keys", "sinks with the gathered form: its rows without a slot are the mean of V, not 0"
        )
    if kv_len % shards:
        return Decline("not_divisible", f"kv_len {kv_len} of {k_source} is not divisible by {shards} shards")
    variants = {"sinks": sinks is not None, "softcap": node.attrs["logit_softcap"]}
    return SplitPlan(shards, k_source, v_source, k.cells if gathered else None, kv_len, **variants)


def rewrite_split(rw: Rewriter, plan: SplitPlan, place: Place) -> str:
    """Build the split attention for the anchor sdpa; returns the combined output (not yet replacing it)."""
    node, n = rw.anchor, plan.shards
    q = node.q
    b, hq, s, d = rw.type(q).shape
    dv = rw.type(node.v).shape[3]
    tn = plan.kv_len // n
    name = node.name
    mask, sinks = node.mask, node.sinks
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
    if q != node.q:
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
    else:  # per (shard, stream, row): the cells [B, S, W] of this batch row, local to the shard
        local, owned = _owned_cells(rw, plan.cells, n, tn)
        streams, rows, width = rw.type(local).shape
        local = rw.broadcast(local, (n, streams, rows, width), f"{name}_cells_split")
        local = rw.reshape(local, (n * streams, rows, width), f"{name}_cells_split")
        place(local, ("shard", None, None))
        k_split = _split_keys(rw, plan.k_source, n, place, f"{name}_k_split")
        v_split = _split_keys(rw, plan.v_source, n, place, f"{name}_v_split")
        k_split = rw.op("qsa_gather", [k_split, local], hint=f"{name}_k_gathered")
        v_split = rw.op("qsa_gather", [v_split, local], hint=f"{name}_v_gathered")
        for value in (k_split, v_split):
            place(value, ("shard", "heads", None, None))
        mask = _owned_mask(rw, mask, owned, n, b, hq, s, place)
    operands = {"q": q_rep, "k": k_split, "v": v_split, "mask": mask}
    attrs = {"scale": node.attrs["scale"], "causal": "none", "logit_softcap": node.attrs["logit_softcap"]}
    partial = rw.op("sdpa", operands, attrs, f"{name}_partial")
    place(partial, ("shard", "heads", None, None))
    lse = rw.op("sdpa_lse", operands, attrs, f"{name}_lse")
    place(lse, ("shard", "heads", None))
    return _combine(rw, partial, lse, (n, b, hq, s, dv), node.type.dtype, place, sinks)


def _split_keys(rw: Rewriter, x: str, n: int, place: Place, hint: str) -> str:
    """``[B, H, T, E] -> [n*B, H, T/n, E]``, the shard axis outermost (shared by every sdpa splitting ``x``)."""
    b, h, t, e = rw.type(x).shape
    r = _reuse(rw, "reshape", x, {"shape": (b, h, n, t // n, e)}, hint)
    place(r, ("batch", "heads", "shard", None, None))
    r = _reuse(rw, "transpose", r, {"perm": (2, 0, 1, 3, 4)}, hint)
    place(r, ("shard", "batch", "heads", None, None))
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
    """``(cells % Tn, owner == shard)``: the local index of every slot, and ``bool[n, B*S, 1, 1, W]`` of who holds
    it, for the sdpa batch rows the cells ``[B, S, W]`` belong to."""
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
    sdpa reads K and V through ``qsa_gather`` of the same cells and has no
    causal attribute (a QSA gather of another form is declined); an sdpa that already has an ``sdpa_lse`` companion (a
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
        decline_quantized(graph, remarks, NOT_CARRIED.format(self.name))
        return bool(apply_rules(graph, [rule], remarks))


__all__ = [
    "Labels",
    "Place",
    "SplitKV",
    "SplitPlan",
    "gathers_qsa_cells",
    "is_split_partial",
    "match_split",
    "no_placement",
    "rewrite_split",
]
