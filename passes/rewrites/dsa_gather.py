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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from attnpass.ir import Graph, Node, require_int

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
        tile = rows if not self.tile_bytes else max(1, min(rows, self.tile_bytes // row_bytes))
        tiles = -(-rows // tile)
        figures = {
            **found.figures, "streams": b, "rows": rows, "heads": h, "kv_heads": k.type.shape[1],
            "gathered_arrays": len(arrays), "row_bytes": row_bytes, "tile": tile, "tiles": tiles,
            "tile_bytes": self.tile_bytes, "gathered_bytes": tile * row_bytes,
            "flop_ratio": found.top_k / found.kv_len,
        }  # fmt: skip
        return _Match(found, tile, figures)


def _describe(m: _Match) -> tuple[str, dict]:
    f, s = m.figures, m.selection
    kv = "the shared K/V (k is v)" if f["gathered_arrays"] == 1 else "K and V"
    fill = "False" if s.fill is None else f"{s.fill:g}"
    values = "the bool selection" if s.values is None else f"where(selection, {s.values}, {fill})"
    keys = {"bool": "a bool selection", "neg_inf": "a -inf fill", "promised": "rows_have_keys, promised"}[s.keys]
    distinct = {"argpartition": "an argpartition", "promised": "selection_input, promised"}[s.distinct]
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
    cells = rw.reshape(m.selection.indices, (b, rows, m.selection.top_k), "cells")
    values = gather_source(rw, m.selection.values)
    outs = [_attend(rw, m, cells, values, r0, min(r0 + m.tile, rows)) for r0 in range(0, rows, m.tile)]
    rw.replace_matched(rw.concat(outs, 2, "sdpa_tiled"))


def _attend(rw: Rewriter, m: _Match, cells: str, values: tuple, r0: int, r1: int) -> str:
    """Rows ``[r0, r1)`` attended over their own cells."""
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
    return batch_to_rows(rw, out, b, s, "sdpa_gather")


__all__ = ["DSAGather", "ENV_VAR"]
