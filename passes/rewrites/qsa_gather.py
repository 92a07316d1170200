"""QSA gather: masked sparse attention -> gather the selected cells, dense attention over ``W`` of them.

Pattern (docs/semantics.md §3.3): ``sdpa(q, k, v, mask=M)`` (or ``quantized_sdpa`` over MLX's packed K/V)
with ``M`` a ``qsa_mask(sel, pos)`` or ``where(qsa_mask(sel, pos), vis, -inf)``; ``sel`` is
``qsa_select(block_scores, pos)`` or the graph input named by ``selection_input``, whose caller promises
that per row the ids in ``[0, n_complete)`` are distinct. Check (each decline says which failed, with its
figures): no ``causal`` or other variant, one ``pos`` and ``ratio``, ``kv_len`` the cache length, block
scores within the cache, a constant ``-inf``, at most ``max_rows`` rows per stream (or ``prefill_tile >
0``) and a deep enough cache, ``n_kv >= min_depth_factor * W`` with ``W = K*ratio + ratio - 1`` rounded up
to ``pad_multiple``.

Rewrite: ``qsa_cells``/``qsa_cell_valid`` give each row ``W`` slots; one ``qsa_gather`` per K/V array reads
every row's cells for every KV head (``[B*S, Hkv, W, .]``, rows folded into the batch) and one ``sdpa``
(``quantized_sdpa``: same attributes) attends each row to its own cells; ``vis`` is gathered at the same
cells, invalid slots are masked, the scale is kept. A prefill is cut into tiles of ``prefill_tile`` rows,
each its own gather and call, concatenated along the rows (the per-device tile is ``prefill_tile`` in
:data:`~..analysis.devices.DEVICES`). The masked path is left for :class:`DeadCodeElimination`.

Exact up to reduction order: the valid slots are exactly the cells ``qsa_mask`` sets, each once, and every
other cell weighs ``exp(-inf) = 0``; a bool ``logical_and`` visibility is kept masked, since a row it empties
is the mean of V over all cells (docs/semantics.md §3.5; why per-row tiles and not a tile's union of cells:
docs/qsa.md, "Prefill"). ``enabled=None`` reads ``ATTNPASS_QSA_GATHER`` at each run (false/off/no/0 keep the
masked path). One remark per sdpa, in topological order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import DType, Graph, Node, require_int
from attnpass.ir.dialects import min_width
from attnpass.ir.dialects.attention import sdpa_variants

from ..analysis.row_gather import batch_to_rows, gather_source, gather_values, rows_to_batch
from ..infra.base import Remarks
from ..infra.policy import SwitchedPass
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules

ENV_VAR = "ATTNPASS_QSA_GATHER"
RULES = {"sdpa": "qsa-gather", "quantized_sdpa": "qsa-gather-quantized"}  # rule name per anchor op


@dataclass(frozen=True)
class _Match:
    select: Node
    form: str  # "qsa_mask" | "where"
    vis: str | None
    ratio: int
    top_k: int
    width: int
    n_kv: int
    streams: int
    rows: int
    given: bool  # the selection is the promised selection_input, not a qsa_select
    positions: str  # what the qsa_mask reads (for a qsa_select: its positions too)
    tile: int  # rows per tile: ``rows`` (one tile) for decode and verify
    quantized: bool  # a quantized_sdpa: K and V are (words, scales, biases) each


def _kv_and_mask(node: Node) -> tuple[list[str], str | None]:
    """The K/V operands of an ``sdpa`` (k, v) or a ``quantized_sdpa`` (kq, ks, kb, vq, vs, vb), and its mask."""
    return [node.operand(name) for name in node.opdef.required[1:]], node.mask


def _is_neg_inf_constant(node: Node) -> bool:
    return node.op == "constant" and all(v == -math.inf for v in node.attrs["value"])


@register_pass
@dataclass(frozen=True)
class QSAGather(SwitchedPass):
    """Rewrite decode-shaped masked QSA attention into gather + dense attention over ``W`` cells."""

    name: ClassVar[str] = "qsa-gather"
    env_var: ClassVar[str] = ENV_VAR
    max_rows: int = 8
    min_depth_factor: float = 2
    pad_multiple: int = 1
    selection_input: str | None = None
    prefill_tile: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int("QSAGather", "max_rows", self.max_rows)
        require_int("QSAGather", "prefill_tile", self.prefill_tile, minimum=0, meaning="0 keeps prefill masked")
        require_int("QSAGather", "pad_multiple", self.pad_multiple)
        if self.selection_input is not None and not (
            isinstance(self.selection_input, str) and self.selection_input.isidentifier()
        ):
            raise ValueError(
                f"QSAGather: selection_input must be a graph input's name or None, got {self.selection_input!r}"
            )
        depth = self.min_depth_factor
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth < math.inf:
            raise ValueError(f"QSAGather: min_depth_factor must be a finite number >= 0, got {depth!r}")

    def width(self, top_k_blocks: int, ratio: int) -> int:
        """``K*ratio + ratio - 1`` rounded up to ``pad_multiple``."""
        need = min_width(top_k_blocks, ratio)
        return -(-need // self.pad_multiple) * self.pad_multiple

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        off, present = self.disabled(), {n.op for n in graph.nodes()}
        anchors = [op for op in RULES if op in present] or ["sdpa"]  # one rule per anchor op the graph holds
        rules = [Rule(RULES[op], op, self._match, _rewrite, self._describe) for op in anchors]
        return any([apply_rules(graph, [rule], remarks, decline_all=off) for rule in rules])

    # ------------------------------------------------------------------ check

    def _match(self, graph: Graph, node: Node) -> _Match | Decline:
        """The matched pattern, or why the masked path is kept (with the numbers)."""
        if node.op == "sdpa":
            variants = sdpa_variants(node)
            if variants:
                return _kept("unsupported_variant", f"sdpa has {variants}; the QSA gather form has none of them")
            if node.attrs["causal"] != "none":
                return _kept(
                    "unsupported_variant",
                    f"sdpa has causal={node.attrs['causal']!r}; the pattern needs causality inside the qsa_mask",
                )
        kv, mask = _kv_and_mask(node)
        if mask is None:
            return _kept("mask_not_selection", f"{node.op} has no mask, so it is not a masked QSA attention")
        q, k = graph.node(node.q).type, graph.node(kv[0]).type
        (b, _hq, s, _d), t = q.shape, k.shape[2]
        found = _split_mask(graph, graph.node(mask))
        if isinstance(found, Decline):
            return found
        form, qmask, vis = found
        selection = graph.node(qmask.selection)
        ratio = qmask.attrs["ratio"]
        given = selection.op == "input" and selection.name == self.selection_input
        if not given and selection.op != "qsa_select":
            return _kept(
                "qsa_form",
                f"the selection {selection.name} of {qmask.name} is {selection.op}, not qsa_select over block scores"
                + (f" nor the promised selection_input {self.selection_input}" if self.selection_input else ""),
            )
        if not given:
            if selection.attrs["ratio"] != ratio:
                return _kept(
                    "qsa_form",
                    f"ratio differs: {selection.name} has ratio={selection.attrs['ratio']}, {qmask.name} ratio={ratio}",
                )
            if selection.positions != qmask.positions:
                return _kept(
                    "qsa_form",
                    f"positions differ: {selection.name} reads {selection.positions}, "
                    f"{qmask.name} reads {qmask.positions}",
                )
        top_k = selection.type.shape[-1]
        if qmask.attrs["kv_len"] != t:
            return _kept(
                "shape_mismatch",
                f"{qmask.name} has kv_len={qmask.attrs['kv_len']} but the cache k has n_kv={t}",
                kv_len=qmask.attrs["kv_len"], n_kv=t,
            )  # fmt: skip
        if qmask.type.shape != (b, 1, s, t):
            return _kept(
                "shape_mismatch",
                f"{qmask.name} is {qmask.type}, expected [B, 1, S, n_kv] = {[b, 1, s, t]} from q and k",
            )
        n_blocks = graph.node(selection.block_scores).type.shape[-1] if not given else 0
        if n_blocks * ratio > t:
            return _kept(
                "shape_mismatch",
                f"block scores cover {n_blocks} blocks x ratio {ratio} = {n_blocks * ratio} cells > n_kv={t}",
                blocks=n_blocks,
                ratio=ratio,
                n_kv=t,
            )
        if s > self.max_rows and not self.prefill_tile:
            return _kept(
                "too_many_rows",
                f"prefill-shaped: {s} query rows per stream > max_rows={self.max_rows} (decode, verify only)",
                rows=s,
                max_rows=self.max_rows,
            )
        width = self.width(top_k, ratio)
        if t < self.min_depth_factor * width:
            return _kept(
                "little_gain",
                f"shallow cache: n_kv={t} < min_depth_factor*W = {self.min_depth_factor}*{width} = "
                f"{self.min_depth_factor * width:g} "
                f"(W = {top_k}*{ratio} + {ratio - 1}, pad_multiple={self.pad_multiple})",
                **self._figures(top_k, ratio, width, t),
            )
        tile = s if s <= self.max_rows else min(s, self.prefill_tile)
        quantized = node.op == "quantized_sdpa"
        return _Match(selection, form, vis, ratio, top_k, width, t, b, s, given, qmask.positions, tile, quantized)

    def _figures(self, top_k: int, ratio: int, width: int, n_kv: int) -> dict:
        """The figures of the width ``W`` and the depth check, by name."""
        return {
            "top_k": top_k, "ratio": ratio, "tail": ratio - 1, "cells": min_width(top_k, ratio), "width": width,
            "pad_multiple": self.pad_multiple, "n_kv": n_kv, "min_depth_factor": self.min_depth_factor,
        }  # fmt: skip

    def _describe(self, m: _Match) -> tuple[str, dict]:
        figures = {
            **self._figures(m.top_k, m.ratio, m.width, m.n_kv), "streams": m.streams, "rows": m.rows,
            "visibility": "none" if m.vis is None else m.form, "selection_input": m.given, "quantized": m.quantized,
        }  # fmt: skip
        vis = "none" if m.vis is None else f"{m.form} with {m.vis}"
        given = f"; selection: graph input {m.select.name}, distinct ids promised by the caller" if m.given else ""
        gathers, last, attention = ("K and V", "D", "sdpa")
        if m.quantized:  # the same plan over the packed cache: every K/V array gathered, one quantized_sdpa
            gathers, last, attention = ("the K and V words, scales and biases", "words|groups", "quantized_sdpa")
            given += "; quantized K/V: only the gathered cells' packed rows are read, none dequantized beforehand"
        if m.rows > self.max_rows:
            tiles = -(-m.rows // m.tile)
            figures.update(tiles=tiles, tile=m.tile, prefill_tile=self.prefill_tile, max_rows=self.max_rows)
            figures.update(tile_cells=m.tile * m.width, flop_ratio=m.width / m.n_kv)
            return (
                f"prefill tiled: {m.streams} stream(s) x {m.rows} rows in {tiles} tile(s) of {m.tile} row(s) "
                f"(prefill_tile={self.prefill_tile}, rows > max_rows={self.max_rows}); per tile one qsa_gather each "
                f"of {gathers} [B*tile, Hkv, W, {last}] = {m.tile * m.width} cells per stream and one {attention}; "
                f"top {m.top_k} blocks x ratio {m.ratio} + {m.ratio - 1} tail = {min_width(m.top_k, m.ratio)} "
                f"cells, W={m.width} (pad_multiple={self.pad_multiple}); attention width n_kv={m.n_kv} -> "
                f"{m.width} per row, FLOP ratio vs dense W/n_kv = {m.width / m.n_kv:.4f}; visibility: {vis}; "
                "the masked path is now dead (run dce)" + given
            ), figures
        figures.update(tiles=1, batched=m.streams * m.rows)
        return (
            f"gather: top {m.top_k} blocks x ratio {m.ratio} + {m.ratio - 1} tail = {min_width(m.top_k, m.ratio)} "
            f"cells, W={m.width} (pad_multiple={self.pad_multiple}); attention width n_kv={m.n_kv} -> {m.width} "
            f"(n_kv >= {self.min_depth_factor}*W); {m.streams} stream(s) x {m.rows} row(s), "
            f"one qsa_gather each of {gathers} [B*S, Hkv, W, {last}] and one {attention} over {m.streams * m.rows} row(s); "
            f"visibility: {vis}; the masked path is now dead (run dce)" + given
        ), figures


def _kept(reason: str, why: str, **figures: object) -> Decline:
    """A decline with code ``reason`` whose words start with "masked path kept: ", and its figures."""
    return Decline(reason, f"masked path kept: {why}", data=figures)


def _split_mask(graph: Graph, mask: Node) -> tuple[str, Node, str | None] | Decline:
    """(form, qsa_mask node, visibility value or None), or why the mask is not a QSA selection."""
    if mask.op == "qsa_mask":
        return "qsa_mask", mask, None
    if mask.op == "logical_and":
        return _kept(
            "rows_without_keys",
            f"mask {mask.name} is a bool logical_and: a row it hides completely attends no key and is the mean "
            "of V over all n_kv cells, which a gather over W cells cannot reproduce; write the visibility as "
            "where(qsa_mask, vis, -inf) (such a row is then NaN on both paths)",
        )
    if mask.op == "where":
        cond, vis, other = (graph.node(i) for i in mask.inputs)
        if cond.op != "qsa_mask":
            return _kept(
                "mask_not_selection",
                f"mask {mask.name} is where({cond.op} {cond.name}, ...): the condition is not a qsa_mask",
            )
        if not _is_neg_inf_constant(other):
            return _kept(
                "mask_not_selection",
                f"mask {mask.name} is where({cond.name}, {vis.name}, {other.op} {other.name}): "
                "the else branch is not a constant -inf",
            )
        return "where", cond, vis.name
    what = f"graph input {mask.name}" if mask.op == "input" else f"{mask.op} {mask.name}"
    return _kept("mask_not_selection", f"the mask is {what}, not qsa_mask or where(qsa_mask, visibility, -inf)")


# ---------------------------------------------------------------------- rewrite


def _rewrite(rw: Rewriter, m: _Match) -> None:
    """Replace the matched sdpa by one ``qsa_gather`` each of K and V and one sdpa per tile of rows."""
    t = rw.type(_kv_and_mask(rw.anchor)[0][0]).shape[2]
    sel, positions = m.select.name, m.positions
    attrs = {"ratio": m.ratio, "width": m.width, "kv_len": t}
    cells = rw.op("qsa_cells", [sel, positions], attrs)
    valid = rw.op("qsa_cell_valid", [sel, positions], attrs)
    vis = gather_source(rw, m.vis)
    outs = [_attend(rw, m, cells, valid, vis, r0, min(r0 + m.tile, m.rows)) for r0 in range(0, m.rows, m.tile)]
    rw.replace_matched(outs[0] if len(outs) == 1 else rw.concat(outs, 2, "sdpa_tiled"))


def _attend(
    rw: Rewriter, m: _Match, cells: str, valid: str, vis_source: tuple[str | None, DType | None], r0: int, r1: int
) -> str:
    """Rows ``[r0, r1)`` attended over their own cells: one ``qsa_gather`` per K/V array and one sdpa (or
    quantized_sdpa)."""
    q, kv_arrays = rw.anchor.q, _kv_and_mask(rw.anchor)[0]
    b, s = rw.type(q).shape[0], r1 - r0
    if s < m.rows:  # a prefill tile: its rows of q, cells, validity and visibility
        q = rw.slice_axis(q, 2, r0, r1, hint="q_tile")
        cells = rw.slice_axis(cells, 1, r0, r1, hint="cells_tile")
        valid = rw.slice_axis(valid, 1, r0, r1, hint="valid_tile")
    valid = rw.reshape(valid, (b * s, 1, 1, m.width), "cell_ok")
    hints = ("kq", "ks", "kb", "vq", "vs", "vb") if m.quantized else ("k", "v")
    kv = [rw.op("qsa_gather", [x, cells], hint=f"{hint}_gathered") for x, hint in zip(kv_arrays, hints)]
    mask = valid
    vis, vis_cast = vis_source
    if vis is not None:
        if s < m.rows and rw.type(vis).shape[2] != 1:
            vis = rw.slice_axis(vis, 2, r0, r1, hint="vis_tile")
        vis = gather_values(rw, vis, cells, b, s)
        if vis_cast is not None:
            vis = rw.op("cast", [vis], {"dtype": vis_cast}, "vis_gathered")
        mask = rw.op("where", [valid, vis, rw.scalar(-math.inf, rw.type(vis).dtype, "neg_inf")], hint="gather_mask")
    operands = {**dict(zip(rw.anchor.opdef.required, [rows_to_batch(rw, q), *kv])), "mask": mask}
    if m.quantized:  # the same attributes: scale, group size, bits, precision
        out = rw.op("quantized_sdpa", operands, dict(rw.anchor.attrs), "sdpa_gather")
    else:
        sdpa_attrs = {"scale": rw.anchor.attrs["scale"], "causal": "none"}
        out = rw.op("sdpa", operands, sdpa_attrs, "sdpa_gather")
    return batch_to_rows(rw, out, b, s, "sdpa_gather")


__all__ = ["ENV_VAR", "QSAGather"]
