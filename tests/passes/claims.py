"""What a remark states, measured on the graphs before and after its pass, not compared with wording.

:func:`check_remarks` reads the figures (``Remark.data``) of every remark of a kind listed in :data:`CHECKED`
and checks each against the graphs: bytes against :meth:`Graph.input_nbytes` and the inputs' shapes and dtypes
(``numpy`` itemsizes, not ``TensorType.nbytes``), counts against the nodes the rewrite left, widths
against the operands of the new calls, visible cells against the mask the numpy reference computes. A
remark of a checked kind that lacks a figure its check reads fails too: a renamed figure needs its check
renamed. It returns how many remarks it checked, so a test can require that its graphs exercised it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from attnpass.backends import run
from attnpass.ir import DType, Graph, Node, TensorType, get_op
from attnpass.lowering import lower
from attnpass.passes import Pass, PassManager, Remark
from attnpass.passes.rewrites.dce import MAX_LISTED
from attnpass.passes.rewrites.mla_absorb import PROJECTIONS
from attnpass.passes.rewrites.qsa_pool_cache import XLA_ROW_REDUCTION_ELEMENTS
from tests.fuzz.choices import Choices
from tests.fuzz.families import FAMILIES, Case

UNITS = {"streamed": "bytes per call", "resident": "bytes of device memory"}


def nbytes(t: TensorType | str) -> int:
    """Bytes of a tensor type, from its shape and numpy's itemsize (independent of ``TensorType.nbytes``)."""
    return math.prod(t.shape) * np.dtype(t.dtype.numpy).itemsize


@dataclass
class _Context:
    """What a check may need besides the graphs: the pass (its options), the inputs, bytes saved per role."""

    pass_: Pass | None
    arrays: Mapping[str, np.ndarray] | None
    saved: Counter = field(default_factory=Counter)

    def option(self, name: str):
        assert self.pass_ is not None, f"checking this remark needs the pass (its {name})"
        return getattr(self.pass_, name)


def _new(before: Graph, after: Graph, op: str) -> list[Node]:
    return [n for n in after.nodes() if n.op == op and n.name not in before]


def _live(graph: Graph) -> set[str]:
    return graph.ancestors(list(graph.outputs))


def _role_deltas(before: Graph, after: Graph) -> dict[str, int]:
    return {role: before.input_nbytes(role) - after.input_nbytes(role) for role in UNITS}


# ---------------------------------------------------------------------- dce


def _dce(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    """An input's remark (its type, role and bytes) or the summary of the internal nodes removed."""
    if r.node is None:
        removed = [n.name for n in before.nodes() if n.op != "input" and n.name not in after]
        listed = list(r.data["listed"])
        assert r.data["count"] == len(removed) >= len(listed) and len(listed) == min(len(removed), MAX_LISTED)
        assert listed == removed[: len(listed)] and not set(removed) & _live(before)
        return
    name, role = r.node, r.data["role"]
    assert name in before.inputs and name not in after.inputs
    assert str(before.node(name).type) == r.data["type"] and before.input_role(name) == role
    assert not before.users(name) or name not in _live(before), f"{name} is read"
    assert r.data["bytes"] == nbytes(before.node(name).type) and UNITS[role] in r.message
    ctx.saved[role] += r.data["bytes"]


def _dce_after(before: Graph, after: Graph, ctx: _Context) -> None:
    assert _live(after) == {n.name for n in after.nodes()}, "dce left dead nodes"
    assert _role_deltas(before, after) == {role: ctx.saved[role] for role in UNITS}


# ---------------------------------------------------------------------- narrow-inputs


def _narrowed(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    name, role, window = r.node, r.data["role"], r.data["slice"]
    old, new = before.node(name).type, after.node(name).type
    assert str(old) == r.data["before"] and str(new) == r.data["after"] and after.input_role(name) == role
    assert before.inputs.index(name) == after.inputs.index(name)
    assert np.empty(old.shape, np.int8)[tuple(slice(*w) for w in window)].shape == new.shape
    assert r.data["bytes_before"] == nbytes(old) and r.data["bytes_after"] == nbytes(new)
    assert UNITS[role] in r.message
    readers = before.users(name)
    assert readers and all(n.op == "slice" and n.type == new for n in readers)
    bounds = {tuple(zip(*(n.attrs[k] for k in ("start", "stop", "step")))) for n in readers}
    assert bounds == {tuple(tuple(w) for w in window)}
    ctx.saved[role] += r.data["bytes_before"] - r.data["bytes_after"]


def _narrow_declined(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    readers = before.users(r.node)
    if r.reason == "read_whole" and not r.data["ops"]:  # one slice, of the whole input
        assert readers and all(n.op == "slice" and n.type == before.node(r.node).type for n in readers)
    elif r.reason == "read_whole":
        assert list(r.data["ops"]) == sorted({n.op for n in readers if n.op != "slice"})
    else:
        bounds = {tuple(n.attrs[k] for k in ("start", "stop", "step")) for n in readers}
        assert r.data["slices"] == len(readers) and r.data["distinct"] == len(bounds) > 1


def _narrow_after(before: Graph, after: Graph, ctx: _Context) -> None:
    assert _role_deltas(before, after) == {role: ctx.saved[role] for role in UNITS}


# ---------------------------------------------------------------------- head-chunk


def _shapes(graph: Graph, node: str) -> tuple[tuple[int, ...], ...]:
    return tuple(graph.node(i).type.shape for i in graph.node(node).inputs)


def _chunked(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    (_b, hq, s, _d), (_b2, hkv, *_), _v, *rest = _shapes(before, r.node)
    anchor = before.node(r.node)
    with_sinks = anchor.sinks is not None
    mask = [] if anchor.mask is None else [rest[0]]
    assert r.data["sinks"] == with_sinks, "sinks stated iff the sdpa has them"
    budget = r.data["budget"]
    assert budget == ctx.option("budget")
    assert (r.data["q_len"], r.data["gqa"], r.data["kv_heads"]) == (s, hq // hkv, hkv)
    assert s * r.data["gqa"] > budget
    concat = after.node(next(n.name for n in _new(before, after, "concat") if n.name.startswith(f"{r.node}_heads")))
    calls = [after.node(c) for c in concat.inputs]
    assert all(c.op == "sdpa" for c in calls) and len(calls) == r.data["calls"] and concat.attrs["axis"] == 1
    heads = [after.node(c.inputs[0]).type.shape[1] for c in calls]
    starts = [after.node(c.inputs[0]).attrs["start"][1] if after.node(c.inputs[0]).op == "slice" else 0 for c in calls]
    assert sum(heads) == hq and starts == [sum(heads[:i]) for i in range(len(heads))], "not in head order"
    assert max(heads) == r.data["heads_per_chunk"] and max(heads) * s <= budget, "a subcall exceeds the budget"
    kv = [c.inputs[1] for c in calls]
    assert len(set(kv)) == hkv and all(after.node(k).type.shape[1] == 1 for k in kv)
    assert [h for h, k in zip(heads, kv) if k == kv[0]] == list(r.data["sizes"])
    if with_sinks:  # call i reads sinks[h0:h1], its own heads' logits
        sinks = [after.node(c.sinks) for c in calls]
        assert all(x.op == "slice" and x.inputs[0] == anchor.sinks for x in sinks)
        assert [(x.attrs["start"][0], x.attrs["stop"][0]) for x in sinks] == [(a, a + h) for a, h in zip(starts, heads)]
    if r.data["mask"] == "none":
        assert not mask and all(len(c.inputs) == 3 + with_sinks for c in calls)
    elif r.data["mask"] == "broadcast":
        assert all(c.mask == anchor.mask for c in calls) and mask[0][-3:-2] != (hq,)
    else:
        assert r.data["mask"] == "per_head" and [after.node(c.mask).type.shape[-3] for c in calls] == heads


def _fits(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    (_b, hq, s, _d), (_b2, hkv, *_), *_rest = _shapes(before, r.node)
    assert (r.data["q_len"], r.data["gqa"]) == (s, hq // hkv) and s * hq // hkv <= r.data["budget"]
    assert r.data["budget"] == ctx.option("budget")
    assert r.node in after and after.node(r.node).op == "sdpa"


# ---------------------------------------------------------------------- qsa-gather


def _ancestor(graph: Graph, name: str, op: str) -> Node:
    (found,) = [graph.node(n) for n in graph.ancestors([name]) if graph.node(n).op == op]
    return found


def _gathered(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    anchor, fig = before.node(r.node), r.data
    (b, _hq, s, _d), (_b, hkv, t, dk), *_ = _shapes(before, r.node)
    select = _ancestor(before, r.node, "qsa_select")
    top, ratio, cells, width = fig["top_k"], fig["ratio"], fig["cells"], fig["width"]
    assert (top, ratio) == (select.attrs["top_k_blocks"], select.attrs["ratio"])
    assert fig["tail"] == ratio - 1 and cells == top * ratio + ratio - 1
    pad = fig["pad_multiple"]
    assert pad == ctx.option("pad_multiple") and fig["min_depth_factor"] == ctx.option("min_depth_factor")
    assert width % pad == 0 and cells <= width < cells + pad
    assert fig["n_kv"] == t >= fig["min_depth_factor"] * width
    assert (fig["streams"], fig["rows"]) == (b, s)
    calls = _new(before, after, "sdpa")
    assert fig["tiles"] == 1 and fig["batched"] == b * s and len(calls) == 1, "a prefill tiling needs its own check"
    kv = [after.node(x) for x in calls[0].inputs[1:3]]  # K and V: each one qsa_gather of every row's cells
    assert [x.op for x in kv] == ["qsa_gather"] * 2 and kv[0].inputs[1] == kv[1].inputs[1]
    assert [x.inputs[0] for x in kv] == list(anchor.inputs[1:3])
    assert kv[0].type.shape == (b * s, hkv, width, dk)
    assert r.node not in _live(after), "the masked sdpa is still live"
    if ctx.arrays is not None:  # the masked path's visible cells per row: at most the stated count
        qmask = _ancestor(before, anchor.mask, "qsa_mask")
        visible = _evaluate(before, qmask.name, ctx.arrays).reshape(b, s, t).sum(-1)
        assert visible.max() <= cells, f"a row sees {visible.max()} cells, the remark says {cells}"


def _evaluate(graph: Graph, name: str, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    g = graph.copy()
    g.set_outputs([name])
    g.remove_dead()
    return np.asarray(run(lower(g, "numpy"), **{n: arrays[n] for n in g.inputs}))


# ---------------------------------------------------------------------- qsa-pool-cache


def _pool_cache(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    fig = r.data
    scores = before.node(r.node)
    keys = before.node(scores.inputs[1])
    pool = _ancestor(before, keys.name, "qsa_pool")
    raw, cache = before.node(fig["raw"]), fig["cache"]
    assert pool.inputs[0] == raw.name and raw.op == "input"
    assert fig["keys"] == keys.name and fig["store"] in ("pooled", "keys")
    stored = pool if fig["store"] == "pooled" else keys
    # the cache: a new resident state input of the stored value's shape
    assert cache not in before and cache in after.inputs and after.input_role(cache) == "resident"
    assert str(after.node(cache).type) == fig["cache_type"] and after.node(cache).type.shape == stored.type.shape
    assert fig["cache_bytes"] == nbytes(after.node(cache).type)
    assert (cache, fig["output"]) in after.state_pairs()
    writer = after.node(after.outputs[fig["output"]])
    blocks = fig["blocks"]
    (positions,) = {before.node(n.inputs[1]).type.shape for n in before.users(r.node) if n.op == "qsa_select"}
    assert blocks == math.prod(positions)
    assert writer.op == fig["write"] and len(_new(before, after, writer.op)) == 1
    assert (writer.op == "dynamic_update_slice") == (blocks == 1)
    # what the step reads of the raw keys: one new pool per block, over `ratio` rows gathered by take
    ratio = pool.attrs["ratio"]
    assert fig["ratio"] == ratio and fig["raw_rows"] == raw.type.shape[1] and fig["raw_bytes"] == nbytes(raw.type)
    pools = _new(before, after, "qsa_pool")
    assert len(pools) == blocks and all(after.node(p.inputs[0]).type.shape[-2] == ratio for p in pools)
    live, others = _live(after), set(fig["raw_readers"])
    reads, frontier = [], [u for u in after.users(raw.name) if u.name in live and u.name not in others]
    while frontier:  # raw's live readers: slices (a stream's view) down to the takes of a block's rows
        node = frontier.pop()
        assert node.op in ("slice", "take"), f"{raw.name} is still read by {node.op} {node.name}"
        reads += [node] if node.op == "take" else []
        frontier += [u for u in after.users(node.name) if u.name in live] if node.op == "slice" else []
    assert sum(nbytes(n.type) for n in reads) == fig["read_bytes"] and len(reads) == blocks
    assert fig["saved_bytes"] == nbytes(raw.type) - fig["read_bytes"]
    assert others == {u.name for u in before.users(raw.name) if u.name != pool.name and u.name in _live(before)}
    assert others <= {u.name for u in after.users(raw.name)}, "a reader the remark names no longer reads the raw keys"
    # the ops between the pool and the block keys
    chain = (before.ancestors([keys.name]) & before.descendants([pool.name])) - {pool.name}
    assert fig["chain_length"] == len(chain)
    assert list(fig["chain_ops"]) == sorted({before.node(n).op for n in chain})
    n_blocks = stored.type.shape[1]
    assert fig["cache_blocks"] == n_blocks
    if fig["store"] == "pooled":  # the chain runs on the whole cache
        assert all(n in live and after.node(n).type.shape[1] == n_blocks for n in chain)
        return
    assert not chain & live, "the whole-cache chain still runs"
    replayed = after.descendants([p.name for p in pools]) - {writer.name}
    sums = [after.node(n) for n in replayed if after.node(n).op == "sum"]
    feeding = after.ancestors([s.name for s in sums]) | {s.name for s in sums}
    for n in (replayed & after.ancestors([writer.name])) - feeding:  # arithmetic no sum reads: on the block's row
        node = after.node(n)
        if get_op(node.op).family == "elementwise" and node.type.dtype.is_float:
            assert node.type.shape[:2] == (1, 1), f"{n} runs over {node.type}, not one block's row"
    if tuple(fig["replay_rows"]) == (1, 1):
        assert not sums or all(after.node(s.inputs[0]).type.shape[:2] == (1, 1) for s in sums)
        return
    padded, whole = tuple(fig["replay_rows"]), tuple(fig["key_blocks"])
    assert whole == keys.type.shape[:2] and sums
    for s in sums:  # each one-block reduction runs over the padded rows, in the regime of the whole cache's
        x = after.node(s.inputs[0]).type.shape
        assert x[:2] == padded
        big = math.prod(x) >= XLA_ROW_REDUCTION_ELEMENTS
        assert big == (math.prod(whole) * x[-1] >= XLA_ROW_REDUCTION_ELEMENTS), (x, whole)


# ---------------------------------------------------------------------- raise-attention


def _raised(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    fig = r.data
    (call,) = [n for n in _new(before, after, "sdpa") if n.name.startswith(f"{r.node}_sdpa")]
    (b, hq, s, d), (_b, hkv, t, dk), (_b2, _h, _t, dv), *mask = _shapes(after, call.name)
    assert (fig["q_heads"], fig["kv_heads"], fig["gqa"]) == (hq, hkv, hq // hkv) and hq % hkv == 0
    assert (fig["q_len"], fig["kv_len"], fig["head_dim"]) == (s, t, d) == (s, t, dk)
    assert fig["scale"] == call.attrs["scale"] and call.attrs["causal"] == "none"
    masks = [*fig["bool_masks"], *([fig["additive_mask"]] if fig["additive_mask"] is not None else [])]
    assert bool(masks) == (call.mask is not None)
    for root in masks:  # the mask is computed from each root the remark names
        assert root in after.ancestors([call.mask]) | {call.mask}, f"the mask does not read {root}"
    for role, operand in zip("qkv", call.inputs):  # each operand is computed from the root the remark names
        assert fig[role] in after.ancestors([operand]) | {operand}, f"{role} does not read {fig[role]}"
    if call.type.dtype is not DType.float32:
        assert fig["rounding"], "a half-precision sdpa without its rounding clause"
    assert fig["dtype"] == call.type.dtype.short
    if fig["rounding"]:
        pv = before.node(r.node) if r.node in before else None
        if pv is not None:  # q·kᵀ: the one matmul the probabilities come from
            probs = [before.node(n) for n in before.ancestors([pv.inputs[0]])]
            (qk,) = [n for n in probs if n.op == "matmul"]
            exps = {n.name for n in probs if n.op == "exp"}  # the softmax: fused, or its normalizing div
            (sm,) = [n for n in probs if n.op == "softmax" or n.op == "div" and exps & before.ancestors([n.name])]
            stated = (fig["qk_dtype"], fig["softmax_dtype"], fig["dtype"])
            assert stated == (qk.type.dtype.short, sm.type.dtype.short, pv.type.dtype.short)
    assert fig["softcap"] == call.attrs.get("logit_softcap")
    assert (fig["sinks"] is not None) == (call.sinks is not None), "sinks stated iff the sdpa has them"
    assert len(fig["fills"]) == len(fig["fill_bounds"])
    for fill, bound in zip(fig["fills"], fig["fill_bounds"]):  # exp(fill - m) is 0 in float64 once m >= fill + 1024
        assert masks and bound == fill + 1024, (fill, bound)
        assert bound <= -(2**24 if call.type.dtype is not DType.float16 else 31728), bound  # docs §1.2
    v_path = [after.node(n) for n in after.ancestors([call.inputs[2]]) if n not in before]
    for op, factor in fig["v_steps"]:  # each scale the remark puts on v is applied to v
        constants = {c for n in v_path if n.op == op for c in _constants(after, n)}
        assert factor in constants, f"v is not {op} by {factor}"


def _constants(graph: Graph, node: Node) -> list[float]:
    return [float(graph.node(i).attrs["value"][0]) for i in node.inputs if graph.node(i).op == "constant"]


# ---------------------------------------------------------------------- mla-absorb


def _selection_width(before: Graph, anchor: Node) -> int | None:
    """K of the anchor's token selection (the put_along_axis its mask reads), None when it has none."""
    if anchor.mask is None:
        return None
    puts = [before.node(n) for n in before.ancestors([anchor.mask]) if before.node(n).op == "put_along_axis"]
    return before.node(puts[0].inputs[1]).type.shape[-1] if len(puts) == 1 else None


def _mla_figures(before: Graph, r: Remark, ctx: _Context) -> None:
    """The shapes, the multiply-add counts and the crossover the remark states, recomputed from the graph."""
    fig, anchor = r.data, before.node(r.node)
    (_b, h, rows, dn), (_b2, _hk, t, _dk), (_b3, _hv, _tv, dv), *_ = _shapes(before, r.node)
    assert (fig["rows"], fig["heads"], fig["kv_len"], fig["dn"], fig["dv"]) == (rows, h, t, dn, dv)
    latent = before.node(before.node(anchor.inputs[1]).inputs[0]).type  # k = matmul(latent, w_uk)
    assert fig["rank"] == latent.shape[-1]
    k_cells = _selection_width(before, anchor)
    assert fig["attended"] == (k_cells if fig["selection"] else t) and (k_cells is not None or not fig["selection"])
    r_, a = fig["rank"], fig["attended"]
    assert fig["absorbed_flops"] == h * rows * a * 2 * r_ + h * rows * r_ * (dn + dv)
    assert fig["expanded_flops"] == h * t * r_ * (dn + dv) + h * rows * a * (dn + dv)
    per_row = a * (2 * r_ - dn - dv) + r_ * (dn + dv)
    model = math.inf if per_row <= 0 else t * r_ * (dn + dv) / per_row
    assert fig["crossover_model"] == model and fig["crossover_factor"] == ctx.option("crossover_factor")
    assert fig["crossover"] == model * fig["crossover_factor"]


def _absorbed(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    _mla_figures(before, r, ctx)
    fig, anchor = r.data, before.node(r.node)
    assert fig["rows"] < fig["crossover"]
    (call,) = [n for n in _new(before, after, "sdpa") if n.name.startswith("sdpa_latent")]
    q_lat, latent = after.node(call.inputs[0]), after.node(call.inputs[1])
    assert call.inputs[1] == call.inputs[2] and latent.type.shape[1] == fig["latent_heads"]
    assert latent.type.shape[3] == fig["rank"] and q_lat.op in PROJECTIONS and q_lat.inputs[0] == anchor.inputs[0]
    assert q_lat.type.shape == (*after.node(anchor.inputs[0]).type.shape[:3], fig["rank"])
    assert (call.mask, call.sinks) == (anchor.mask, anchor.sinks)
    scale = anchor.attrs["scale"]
    assert call.attrs == {**anchor.attrs, "scale": 1 / math.sqrt(fig["dn"]) if scale is None else scale}
    assert r.node not in _live(after) and not {anchor.inputs[1], anchor.inputs[2]} & _live(after)


def _absorb_kept(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    _mla_figures(before, r, ctx)
    assert r.data["rows"] >= r.data["crossover"] and r.node in _live(after)


def _not_latent(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    k, v = (before.node(i) for i in before.node(r.node).inputs[1:3])
    if k.op in PROJECTIONS and v.op in PROJECTIONS:  # then they project different latents (a broadcast aside)
        sources = [before.node(x.inputs[0]) for x in (k, v)]
        roots = {s.inputs[0] if s.op == "broadcast_to" else s.name for s in sources}
        assert len(roots) == 2


def _other_readers(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    k, v = before.node(r.node).inputs[1:3]
    assert any({u.name for u in before.users(x)} - {r.node} or x in before.outputs for x in (k, v))


# ---------------------------------------------------------------------- dsa-gather


def _dsa_value_cutoff(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    """A value-cutoff selection gathered: its figures, one argtopk of K over the selection, one sdpa per tile (one
    in all for cells shared by a stream's rows), and on the inputs: at most K selected cells per row, the mask
    false wherever the selection is."""
    fig, anchor = r.data, before.node(r.node)
    (b, h, rows, _d), (_b, hk, t, _dk), *_ = _shapes(before, r.node)
    sel = before.node(fig["selected"])
    shared = rows > 1 and math.prod(sel.type.shape[:-1]) == b
    assert (fig["streams"], fig["rows"], fig["heads"], fig["kv_heads"], fig["kv_len"]) == (b, rows, h, hk, t)
    assert fig["shared_cells"] == shared and fig["flop_ratio"] == fig["top_k"] / t and fig["top_k"] < t
    (ranked,) = _new(before, after, "argtopk")
    assert ranked.attrs["k"] == fig["top_k"] and ranked.type.shape[:-1] == sel.type.shape[:-1]
    assert len(_new(before, after, "sdpa")) == (1 if shared else fig["tiles"])
    assert r.node not in _live(after), "the masked sdpa is still live"
    if ctx.arrays is not None:
        selected = _evaluate(before, sel.name, ctx.arrays)
        assert (selected.sum(-1) <= fig["top_k"]).all(), "a row selects more than K cells"
        mask = _evaluate(before, anchor.mask, ctx.arrays)
        lead = selected.reshape(b, 1, 1 if shared else rows, t)
        assert not (np.broadcast_to(mask, np.broadcast_shapes(mask.shape, lead.shape)) & ~lead).any()


def _dsa_gathered(before: Graph, after: Graph, r: Remark, ctx: _Context) -> None:
    fig, anchor = r.data, before.node(r.node)
    if fig["distinct"] == "argtopk":
        _dsa_value_cutoff(before, after, r, ctx)
        return
    (b, h, rows, _d), (_b, hk, t, _dk), *_ = _shapes(before, r.node)
    top_k = _selection_width(before, anchor)
    assert (fig["streams"], fig["rows"], fig["heads"], fig["kv_heads"]) == (b, rows, h, hk)
    assert (fig["top_k"], fig["kv_len"], fig["flop_ratio"]) == (top_k, t, top_k / t) and top_k < t
    arrays = [before.node(anchor.inputs[1])] + (
        [] if anchor.inputs[1] == anchor.inputs[2] else [before.node(anchor.inputs[2])]
    )
    assert fig["gathered_arrays"] == len(arrays)
    assert fig["row_bytes"] == b * top_k * sum(x.type.shape[1] * x.type.shape[3] * np.dtype(x.type.dtype.numpy).itemsize
                                               for x in arrays)  # fmt: skip
    tile, tiles = fig["tile"], fig["tiles"]
    assert fig["tile_bytes"] == ctx.option("tile_bytes") and tiles == -(-rows // tile)
    assert fig["gathered_bytes"] == tile * fig["row_bytes"]
    assert not fig["tile_bytes"] or tile == 1 or fig["gathered_bytes"] <= fig["tile_bytes"]
    gathers, calls = _new(before, after, "qsa_gather"), _new(before, after, "sdpa")
    assert len(gathers) == tiles * len(arrays) and len(calls) == tiles
    sizes = [min(tile, rows - i * tile) for i in range(tiles)]
    assert sorted(g.type.shape for g in gathers) == sorted(
        (b * n, hk, top_k, x.type.shape[3]) for n in sizes for x in arrays
    )
    assert {g.inputs[0] for g in gathers} == {x.name for x in arrays}
    assert all(c.attrs == anchor.attrs and c.sinks == anchor.sinks for c in calls)
    assert r.node not in _live(after), "the masked sdpa is still live"
    if ctx.arrays is not None:  # each row: K distinct cells, and a key where the remark says so
        (put,) = [before.node(n) for n in before.ancestors([anchor.mask]) if before.node(n).op == "put_along_axis"]
        selected = _evaluate(before, put.name, ctx.arrays).reshape(b, rows, t)
        assert (selected.sum(-1) == top_k).all(), "a row's indices repeat"
        if fig["keys"] == "promised":
            mask = np.broadcast_to(_evaluate(before, anchor.mask, ctx.arrays), (b, h, rows, t))
            best = np.where(selected[:, None], mask, -np.inf).max(-1)
            assert (best > fig["fill"]).all(), "a row has no key above the fill"


# ---------------------------------------------------------------------- dispatch

Check = Callable[[Graph, Graph, Remark, _Context], None]
# (pass, kind) -> the check of its remarks; a declined kind's checks are keyed by reason code
CHECKED: dict[tuple[str, str], Check | dict[str, Check]] = {
    ("dce", "applied"): _dce,
    ("narrow-inputs", "applied"): _narrowed,
    ("narrow-inputs", "declined"): {"read_whole": _narrow_declined, "slices_differ": _narrow_declined},
    ("head-chunk", "applied"): _chunked,
    ("head-chunk", "declined"): {"fused_kernel_serves": _fits},
    ("qsa-gather", "applied"): _gathered,
    ("qsa-pool-cache", "applied"): _pool_cache,
    ("raise-attention", "applied"): _raised,
    ("mla-absorb", "applied"): _absorbed,
    ("mla-absorb", "declined"): {
        "little_gain": _absorb_kept,
        "not_latent": _not_latent,
        "other_readers": _other_readers,
    },
    ("dsa-gather", "applied"): _dsa_gathered,
}
AFTER: dict[str, Callable[[Graph, Graph, _Context], None]] = {"dce": _dce_after, "narrow-inputs": _narrow_after}
# the reason codes of declines whose figures are not checked here (each precondition's decline is tested where it is)
UNCHECKED_DECLINES = frozenset({"interface", "unused", "too_many_rows", "no_candidates", "shape_mismatch", "disabled"})


def check_remarks(
    before: Graph,
    after: Graph,
    remarks: list[Remark],
    pass_: Pass | None = None,
    arrays: Mapping[str, np.ndarray] | None = None,
) -> int:
    """Check every measurable claim of ``remarks`` (``pass_``'s, run on ``before``) against ``before``/``after``.

    ``arrays`` (inputs by name) lets the checks evaluate values too. Returns the number of remarks checked.
    """
    checked, ctx = 0, _Context(pass_, arrays)
    for r in remarks:
        check = CHECKED.get((r.pass_name, r.kind))
        if check is None or (r.kind == "declined" and r.reason in UNCHECKED_DECLINES):
            continue
        if r.pass_name == "raise-attention" and r.rule != "attention":
            continue  # canonicalize's and the softmax rule's rewrites: checked by the differential tests
        if isinstance(check, dict):
            assert r.reason in check, f"a decline of a checked kind has no check (update tests/passes/claims.py): {r}"
            check = check[r.reason]
        try:
            check(before, after, r, ctx)
        except Exception as exc:  # a figure the remark lacks, a name the graphs lack: the claim is wrong too
            raise AssertionError(f"{r}\n  data {dict(r.data)}\n  does not hold: {type(exc).__name__}: {exc}") from exc
        checked += 1
    passes = {r.pass_name for r in remarks}
    for name, check_after in AFTER.items():
        if name in passes:
            check_after(before, after, ctx)
    return checked


def fuzzed(families: tuple[str, ...], n: int) -> list[Case]:
    """The first ``n`` graphs (seeds 0..n-1) of each of the fuzzer's ``families``, with their inputs."""
    return [FAMILIES[f](Choices(random.Random(seed))) for f in families for seed in range(n)]


def audit(
    pass_: Pass, cases: list[Case], before: Callable[[Graph], Graph] = lambda g: g, anchor: str | None = None
) -> Counter:
    """Run ``pass_`` on each case's graph (through ``before`` first) and check its remarks; counts per remark kind.

    ``anchor``: the op of the pass's rule; each node of that op (the candidates) gets exactly one remark.
    """
    counts: Counter = Counter()
    for case in cases:
        graph = before(case.graph)
        result = PassManager([pass_]).run(graph)
        candidates = sorted(n.name for n in graph.nodes() if n.op == anchor)
        if candidates:
            assert sorted(r.node for r in result.remarks) == candidates, "not one remark per candidate"
        counts["checked"] += check_remarks(graph, result.graph, result.remarks, pass_, case.arrays)
        counts.update(r.kind for r in result.remarks)
    return counts
