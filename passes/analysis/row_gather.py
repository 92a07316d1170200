"""Per-row gathers: query rows folded into the batch, one ``sdpa`` query row per batch entry, values at cells.

The layout steps the gather rewrites (``qsa-gather``, ``dsa-gather``) share: a
row gather reads, for every (stream, row), its own cells of a ``[B, H, T, D]``
cache with ``qsa_gather`` (``[B*S, H, W, D]``), so the query becomes
``[B*S, H, 1, D]`` (:func:`rows_to_batch`) and the result goes back to
``[B, H, S, D]`` (:func:`batch_to_rows`). A per-cell mask value of any shape
that broadcasts to ``[B, H, S, T]`` is read at the same cells by
:func:`gather_values` (``take_along_axis``), after :func:`gather_source`
brought it to rank 4 (a ``cast`` is moved after the gather, so only the
gathered cells are converted). Pure layout: every value is copied,
none computed.
"""

from __future__ import annotations

from attnpass.ir import DType

from ..infra.rewrite import Rewriter


def rows_to_batch(rw: Rewriter, x: str) -> str:
    """``[B, H, S, D]`` -> ``[B*S, H, 1, D]`` (row-major: stream outer, row inner)."""
    b, h, s, d = rw.type(x).shape
    return rw.reshape(rw.transpose(x, (0, 2, 1, 3)) if s > 1 else x, (b * s, h, 1, d), f"{x}_rows")


def batch_to_rows(rw: Rewriter, x: str, b: int, s: int, hint: str) -> str:
    """Inverse of :func:`rows_to_batch`: ``[B*S, H, 1, D]`` -> ``[B, H, S, D]``."""
    _bs, h, _one, d = rw.type(x).shape
    if s == 1:
        return rw.reshape(x, (b, h, 1, d), hint)
    return rw.transpose(rw.reshape(x, (b, s, h, d)), (0, 2, 1, 3), hint)


def gather_source(rw: Rewriter, value: str | None) -> tuple[str | None, DType | None]:
    """(``value`` as a rank-4 array to gather from, the dtype to cast to after the gather or None)."""
    if value is None:
        return None, None
    node, cast_to = rw.graph.node(value), None
    if node.op == "cast" and rw.type(node.inputs[0]).shape == node.type.shape:
        node, cast_to = rw.graph.node(node.inputs[0]), node.attrs["dtype"]
    shape = node.type.shape
    return rw.reshape(node.name, (1,) * (4 - len(shape)) + shape, "vis4"), cast_to


def gather_values(rw: Rewriter, value: str, cells: str, b: int, s: int, hint: str = "vis") -> str:
    """``value`` ``[b', h', s', T or 1]`` at each row's cells (``[B, S, W]``): ``[B*S, h', 1, W or 1]``.

    The cells are read first (``take_along_axis`` broadcasts the heads), so only ``[B, h', S, W]`` is
    laid out again, never the whole ``value``."""
    _vb, vh, _vs, vt = rw.type(value).shape
    if vt == 1:
        picked = rw.broadcast(value, (b, vh, s, 1))
    else:
        index = rw.reshape(cells, (b, 1, s, rw.type(cells).shape[-1]), f"{hint}_cells")
        picked = rw.op("take_along_axis", [value, index], {"axis": 3}, f"{hint}_gathered")  # [B, h', S, W]
    _b, _h, _s, width = rw.type(picked).shape
    if vh > 1 and s > 1:  # [B, S, h', W]: streams and rows outermost, as in the sdpa's batch
        picked = rw.transpose(picked, (0, 2, 1, 3))
    return rw.reshape(picked, (b * s, vh, 1, width), f"{hint}_rows" if vt == 1 else f"{hint}_gathered")


__all__ = ["batch_to_rows", "gather_source", "gather_values", "rows_to_batch"]
