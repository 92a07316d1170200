"""DSA gather: attention masked to each row's ``K`` indexed cells -> attention over those cells only.

Pattern (docs/mla.md): ``sdpa(q, k, v, mask)`` whose mask is a token selection
(:func:`~..analysis.token_selection.match_token_selection`: ``where(put_along_axis(false, idx, true, axis=-1),
m, fill)``, the bool selection itself, or ``where(sel, cells, False)`` with bool ``cells`` (a block selection
widened to its tokens), ``idx`` ``i32 [B, 1, L, K]``, fill at or below ``finfo.min``), with no
causal kind or window (the gathered cells lose their positions; sinks and soft-cap are kept). The indices must
be distinct per row (an ``argpartition``, or the caller's ``selection_input``) and, for a finite fill, every row
must have a key (the caller's ``rows_have_keys``); otherwise the masked form is kept with the reason.

Rewrite: each row's cells are ``idx`` ``[B, L, K]``; one ``qsa_gather`` of K and one of V (one in all when
``k is v``, the absorbed latent of ``mla-absorb``) read ``[B*rows, Hk, K, D]``, ``m`` is read at the same cells
(``take_along_axis``), and one ``sdpa`` attends each row (folded into the batch) to its own cells, reshaped back
to ``[B, H, L, Dv]``. The rows go in tiles of at most ``tile_bytes`` gathered bytes (at least one row per
tile), each its own gather and sdpa, concatenated along the rows; ``tile_bytes=0`` gathers all rows at once.
Exact in the cells attended: every row sees exactly its selected cells, each once, and an unselected cell
weighs exactly 0 on the masked path; the softmax sums over ``K`` cells instead of ``T`` (another order: not
bit-exact). ``enabled=None`` reads ``ATTNPASS_DSA_GATHER`` at each run. One remark per sdpa.

A bool mask proven false wherever a value-cutoff selection is (MaxText's DSA indexer; token_selection) is
gathered at ``argtopk(cast(sel, int32), K)`` (every selected cell, then unselected ones the gathered mask keeps at
weight 0); a selection of one row per stream (``[B, 1, T]``: MaxText folds the query heads into the rows) is
gathered once and attended by all the stream's rows (``shared_cells``); a row whose gathered mask has no key gets
V's mean over all ``T`` cells, what the masked call computes for it. K or V concatenated from parts (a cache's
prefill and decode halves along the keys, a latent beside its rope key along the features) is gathered part by
part, so the ``[T, D]`` concat is never built (the same values copied).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from attnpass.ir import DType, Graph, Node, require_int

from ..analysis.row_gather import batch_to_rows, gather_source, gather_values, rows_to_batch
from ..analysis.token_selection import TokenSelection, check_promises, match_token_selection
from ..infra.base import Remarks
from ..infra.policy import SwitchedPass
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules

ENV_VAR = "ATTNPASS_DSA_GATHER"


@dataclass(frozen=True)
class _Match:
    selection: TokenSelection
    tile: int  # query rows per tile
    figures: dict
    shared: bool = False  # one set of cells per stream, attended by all its rows (a value cutoff's [B, 1, T])


@register_pass
@dataclass(frozen=True)
class DSAGather(SwitchedPass):
    """Rewrite attention masked to a per-row token selection into a gather of those tokens + attention."""

    name: ClassVar[str] = "dsa-gather"
    env_var: ClassVar[str] = ENV_VAR
    tile_bytes: int = 0
    selection_input: str | None = None
    rows_have_keys: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int("DSAGather", "tile_bytes", self.tile_bytes, minimum=0, meaning="0 gathers all rows at once")
        check_promises("DSAGather", self.selection_input, self.rows_have_keys)

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        rule = Rule("dsa-gather", "sdpa", self._match, _rewrite, _describe)
        return bool(apply_rules(graph, [rule], remarks, decline_all=self.disabled()))

    def _match(self, graph: Graph, node: Node) -> _Match | Decline:
        """The selection and the tiling, or why the masked form is kept."""
        if node.attrs["causal"] != "none" or node.attrs.get("window"):
            return Decline(
                "unsupported_variant",
                f"sdpa has causal={node.attrs['causal']!r}, window={node.attrs.get('window')}: gathered cells lose "
                "the positions these read; write them into the mask",
            )
        found = match_token_selection(
            graph, node, selection_input=self.selection_input, rows_have_keys=self.rows_have_keys
        )
        if isinstance(found, Decline):
            return found
        (b, h, rows, _d), k, v = graph.node(node.q).type.shape, graph.node(node.k), graph.node(node.v)
        arrays = [k] if k.name == v.name else [k, v]
        row_bytes = sum(found.top_k * x.type.shape[1] * x.type.shape[3] * np.dtype(x.type.dtype.numpy).itemsize
                        for x in arrays) * b  # fmt: skip
        shared = found.selected is not None and rows > 1 and math.prod(graph.node(found.selected).type.shape[:-1]) == b
        tile = rows if not self.tile_bytes or shared else max(1, min(rows, self.tile_bytes // row_bytes))
        tiles = -(-rows // tile)
        figures = {
            **found.figures, "streams": b, "rows": rows, "heads": h, "kv_heads": k.type.shape[1],
            "gathered_arrays": len(arrays), "row_bytes": row_bytes, "tile": tile, "tiles": tiles,
            "tile_bytes": self.tile_bytes, "gathered_bytes": tile * row_bytes,
            "flop_ratio": found.top_k / found.kv_len, "shared_cells": shared,
        }  # fmt: skip
        if shared:
            figures["gathered_bytes"] = row_bytes
        return _Match(found, tile, figures, shared)


def _describe(m: _Match) -> tuple[str, dict]:
    f, s = m.figures, m.selection
    kv = "the shared K/V (k is v)" if f["gathered_arrays"] == 1 else "K and V"
    fill = "False" if s.fill is None else f"{s.fill:g}"
    values = "the bool selection" if s.values is None else f"where(selection, {s.values}, {fill})"
    keys = {"bool": "a bool selection", "neg_inf": "a -inf fill", "promised": "rows_have_keys, promised",
            "fallback": "no proof: a row without one gets the masked call's mean of V over all T"}[s.keys]  # fmt: skip
    distinct = {"argpartition": "an argpartition", "promised": "selection_input, promised",
                "argtopk": "argtopk(cast(selection, int32), K)"}[s.distinct]  # fmt: skip
    if s.selected is not None:
        values = (
            f"bool {s.values}, false wherever the value-cutoff selection {s.selected} (at most K cells per row: "
            "top_k's, ties by rank) is, gathered at argtopk(selection)"
        )
    if m.shared:
        kv += " (one set of cells per stream, [B, Hk, K, D], attended by all its rows)"
    return (
        f"gather: each of {f['streams']} x {f['rows']} row(s) attends its K={s.top_k} indexed cells of T={s.kv_len} "
        f"(FLOP ratio {f['flop_ratio']:.4f}); mask {values}; {f['tiles']} tile(s) of {f['tile']} row(s), one "
        f"qsa_gather of {kv} [B*tile, {f['kv_heads']}, K, D] ({f['gathered_bytes']} bytes, tile_bytes="
        f"{f['tile_bytes']}) and one sdpa each; indices distinct by {distinct}, every row has a key by {keys}; "
        "exact in the cells attended, summed in another order; the masked path is now dead (run dce)"
    ), f


def _rewrite(rw: Rewriter, m: _Match) -> None:
    """One gather per K/V array and one sdpa per tile of rows, concatenated along the rows."""
    b, _h, rows, _d = rw.type(rw.anchor.q).shape
    s = m.selection
    indices = s.indices
    if indices is None:  # a value cutoff: every selected cell (at most K), ranked first, then the lowest others
        ranked = rw.cast(s.selected, DType.int32, "selected_int")
        indices = rw.op("argtopk", [ranked], {"k": s.top_k, "axis": rw.type(ranked).rank - 1}, "selected_cells")
    values = gather_source(rw, s.values)
    mean = _mean_value(rw) if s.keys == "fallback" and rw.anchor.sinks is None else None
    if m.shared:
        rw.replace_matched(_attend_shared(rw, rw.reshape(indices, (b, 1, s.top_k), "cells"), values, mean))
        return
    cells = rw.reshape(indices, (b, rows, s.top_k), "cells")
    outs = [_attend(rw, m, cells, values, r0, min(r0 + m.tile, rows), mean) for r0 in range(0, rows, m.tile)]
    rw.replace_matched(rw.concat(outs, 2, "sdpa_tiled"))


def _attend_shared(rw: Rewriter, cells: str, values: tuple, mean: str | None) -> str:
    """Every row of a stream over the stream's one set of cells (``[B, 1, K]``): one gather, the rows unfolded."""
    node = rw.anchor
    b = rw.type(node.q).shape[0]
    k_rows = _gather(rw, node.k, cells, "kv_gathered" if node.k == node.v else "k_gathered")
    v_rows = k_rows if node.k == node.v else _gather(rw, node.v, cells, "v_gathered")
    operands = {"q": node.q, "k": k_rows, "v": v_rows, "sinks": node.sinks}
    value, cast_to = values
    mask = gather_values(rw, value, cells, b, 1, "mask")  # [B, h', 1, K]: one mask row for every query row
    operands["mask"] = mask if cast_to is None else rw.cast(mask, cast_to, "mask_gathered")
    out = rw.op("sdpa", {n: x for n, x in operands.items() if x is not None}, dict(node.attrs), "sdpa_gather")
    return out if mean is None else _keyless_rows(rw, out, operands["mask"], mean, b, 1)


def _parts(rw: Rewriter, x: str) -> tuple[int, list[str]] | None:
    """``(axis, parts)`` when ``[B, H, T, D]`` ``x`` is a concat along the keys (2) or the features (3), seen
    through a reshape that keeps the last axis (its parts reshaped alike); None otherwise."""
    node = rw.graph.node(x)
    shape = node.type.shape
    if node.op == "reshape":
        src = rw.graph.node(node.inputs[0])
        last = src.type.rank - 1
        if src.op == "concat" and src.attrs["axis"] % src.type.rank == last and src.type.shape[-1] == shape[-1]:
            return 3, [rw.reshape(p, shape[:-1] + (rw.type(p).shape[-1],), f"{p}_parts") for p in src.inputs]
        return None
    if node.op == "concat" and node.attrs["axis"] % 4 in (2, 3) and len(node.inputs) > 1:
        return node.attrs["axis"] % 4, list(node.inputs)
    return None


def _gather(rw: Rewriter, x: str, cells: str, hint: str) -> str:
    """``qsa_gather(x, cells)``, read from the parts of a concatenated ``x`` (a cache's halves, a latent beside its
    rope key) so that the whole ``[B, H, T, D]`` concat is never built: each part at its own cells (clamped into
    it) and the right one picked per cell. The same values, copied, not computed."""
    split = _parts(rw, x)
    if split is None:
        return rw.op("qsa_gather", [x, cells], hint=hint)
    axis, parts = split
    if axis == 3:
        return rw.concat([_gather(rw, p, cells, hint) for p in parts], 3, hint)
    first, rest = parts[0], parts[1:]
    n, tail = rw.type(first).shape[2], rw.type(x).shape[2] - rw.type(first).shape[2]
    rest = rest[0] if len(rest) == 1 else rw.concat(rest, 2, f"{x}_rest")
    head = rw.op("minimum", [cells, rw.scalar(n - 1, DType.int32, "last_cell")], hint="cells_head")
    shifted = rw.op("sub", [cells, rw.scalar(n, DType.int32, "cells_before")], hint="cells_rest")
    shifted = rw.op("minimum", [rw.op("maximum", [shifted, rw.scalar(0, DType.int32, "zero")]),
                                rw.scalar(tail - 1, DType.int32, "last_cell")], hint="cells_rest")  # fmt: skip
    ga, gb = _gather(rw, first, head, hint), _gather(rw, rest, shifted, hint)
    bs, _h, w, _d = rw.type(ga).shape
    inside = rw.reshape(rw.op("less", [cells, rw.scalar(n, DType.int32, "cells_before")]), (bs, 1, w, 1), "in_head")
    return rw.op("where", [inside, ga, gb], hint=hint)


def _total(rw: Rewriter, x: str) -> str:
    """float32 sum of ``[B, H, T, D]`` ``x`` over the keys, ``[B, H, 1, D]``, from a concat's parts."""
    split = _parts(rw, x)
    if split is not None:
        axis, parts = split
        sums = [_total(rw, p) for p in parts]
        return rw.concat(sums, 3, "v_sum") if axis == 3 else functools.reduce(lambda a, b: rw.op("add", [a, b]), sums)
    wide = rw.cast(x, DType.float32, "v_wide") if rw.type(x).dtype is not DType.float32 else x
    return rw.op("sum", [wide], {"axes": (2,), "keepdims": True}, "v_sum")


def _mean_value(rw: Rewriter) -> str:
    """V's mean over all T cells, ``[B, Hkv, 1, Dv]`` in V's dtype (summed in float32): what the masked
    call computes for a row whose mask has no key (every score filled alike)."""
    vt = rw.type(rw.anchor.v)
    mean = rw.op(
        "div", [_total(rw, rw.anchor.v), rw.scalar(float(vt.shape[2]), DType.float32, "kv_len")], hint="v_mean"
    )
    return rw.cast(mean, vt.dtype, "v_mean") if vt.dtype is not DType.float32 else mean


def _keyless_rows(rw: Rewriter, out: str, mask: str, mean: str, b: int, s: int) -> str:
    """``out`` ``[B, H, s, Dv]`` with the rows whose gathered ``mask`` ``[B*s, h', 1, K]`` has no key set to
    ``mean`` (``[B, Hkv, 1, Dv]``), as the masked call computes them."""
    _b, h, rows, dv = rw.type(out).shape
    hm, hkv = rw.type(mask).shape[1], rw.type(mean).shape[1]
    count = rw.op("max", [rw.cast(mask, DType.int32, "mask_int")], {"axes": (3,), "keepdims": True})
    has = rw.op("less", [rw.scalar(0, DType.int32, "zero"), count], hint="has_key")  # [B*s, h', 1, 1]
    has = rw.reshape(has, (b, s, hm, 1))
    has = rw.transpose(has, (0, 2, 1, 3)) if hm > 1 and s > 1 else rw.reshape(has, (b, hm, s, 1))
    grouped = rw.reshape(out, (b, hkv, h // hkv, rows, dv))
    has = rw.reshape(has, (b, 1, 1, s, 1) if hm == 1 else (b, hkv, h // hkv, s, 1))  # s is rows, or 1: shared
    kept = rw.op("where", [has, grouped, rw.reshape(mean, (b, hkv, 1, 1, dv))], hint="keyless_mean")
    return rw.reshape(kept, (b, h, rows, dv), "sdpa_gather")


def _attend(rw: Rewriter, m: _Match, cells: str, values: tuple, r0: int, r1: int, mean: str | None) -> str:
    """Rows ``[r0, r1)`` attended over their own cells (a row without a key: ``mean``, when given)."""
    node = rw.anchor
    q, k, v = node.q, node.k, node.v
    b, rows = rw.type(q).shape[0], rw.type(q).shape[2]
    s = r1 - r0
    if s < rows:
        q = rw.slice_axis(q, 2, r0, r1, hint="q_tile")
        cells = rw.slice_axis(cells, 1, r0, r1, hint="cells_tile")
    k_rows = rw.op("qsa_gather", [k, cells], hint="kv_gathered" if k == v else "k_gathered")
    v_rows = k_rows if k == v else rw.op("qsa_gather", [v, cells], hint="v_gathered")
    operands = {"q": rows_to_batch(rw, q), "k": k_rows, "v": v_rows, "sinks": node.sinks}
    value, cast_to = values
    if value is not None:
        if s < rows and rw.type(value).shape[2] != 1:
            value = rw.slice_axis(value, 2, r0, r1, hint="mask_tile")
        mask = gather_values(rw, value, cells, b, s, "mask")
        operands["mask"] = mask if cast_to is None else rw.cast(mask, cast_to, "mask_gathered")
    out = rw.op("sdpa", {n: x for n, x in operands.items() if x is not None}, dict(node.attrs), "sdpa_gather")
    out = batch_to_rows(rw, out, b, s, "sdpa_gather")
    return out if mean is None else _keyless_rows(rw, out, operands["mask"], mean, b, s)


__all__ = ["DSAGather", "ENV_VAR"]
