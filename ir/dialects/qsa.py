"""The QSA dialect: Qwen Sparse Attention's indexer and selection ops (docs/semantics.md §3).

Family ``qsa``. Conventions shared by every op:

- cell ``c`` of a KV cache holds position ``c``; block ``b`` covers cells
  ``[b*ratio, (b+1)*ratio)``; for a query at position ``p`` the complete
  (visible) blocks are ``b < n_complete = (p + 1) // ratio`` and the *tail*
  is the cells ``n_complete*ratio .. p`` (0 to ratio-1 of them);
- a selection is int32 ``[B, S, K]``: distinct block ids ascending, then ``-1``
  for unused slots.

The gather side is two ops over the same operands and attributes, because a
node has one output: ``qsa_cells`` gives the cell index of every slot (a safe
``0`` where a slot is unused) and ``qsa_cell_valid`` says which slots are real.
For a selection made by ``qsa_select`` the valid slots enumerate exactly the
cells ``qsa_mask`` sets, each once. ``qsa_gather`` reads those cells of a
``[B, H, T, D]`` cache for every (stream, row, head) at once, the streams and
rows folded into the batch as an ``sdpa`` with one query row per batch entry
takes them; how a target gathers (MLX: one ``take`` on a flat view) is its own
lowering choice.

Runtime values outside the contract (block ids outside ``[-1, NB)``, positions
outside ``[0, kv_len)``) make the numpy reference raise; the MLX and JAX
lowerings never read out of bounds and drop such ids and cells instead.
"""

from __future__ import annotations

from attnpass.ir.core.registry import OpDef, attr, operand, register
from attnpass.ir.core.types import DType, ShapeError, TensorType

from .rules import FLOATS


def _need(op: str, t: TensorType, what: str, rank: int, dtypes: tuple[DType, ...]) -> None:
    if t.rank != rank:
        raise ShapeError(f"{op}: {what} must have rank {rank}, got {what}={t}")
    if t.dtype not in dtypes:
        valid = ", ".join(d.value for d in dtypes)
        raise ShapeError(f"{op}: {what} has dtype {t.dtype.value} ({what}={t}); valid: {valid}")


def _positive(op: str, name: str, value: int) -> None:
    if value < 1:
        raise ShapeError(f"{op}: attribute {name}={value} must be >= 1")


def _positions_match(op: str, rows: TensorType, positions: TensorType, what: str) -> None:
    _need(op, positions, "positions", 2, (DType.int32,))
    if positions.shape != rows.shape[:2]:
        raise ShapeError(f"{op}: positions {positions} must be [B, S] = {list(rows.shape[:2])} to match {what}={rows}")


def min_width(top_k_blocks: int, ratio: int) -> int:
    """Slots a gather needs: ``top_k_blocks`` whole blocks plus ``ratio - 1`` tail cells."""
    return top_k_blocks * ratio + ratio - 1


def _infer_pool(ts, *, ratio):
    (keys,) = ts
    _positive("qsa_pool", "ratio", ratio)
    if keys.rank < 2 or keys.dtype not in FLOATS:
        raise ShapeError(f"qsa_pool: raw_keys must be a float tensor [..., T, D] of rank >= 2, got {keys}")
    return TensorType(keys.shape[:-2] + (keys.shape[-2] // ratio, keys.shape[-1]), keys.dtype)


def _infer_block_scores(ts):
    q, keys = ts
    _need("qsa_block_scores", q, "idx_q", 4, FLOATS)
    _need("qsa_block_scores", keys, "block_keys", 3, FLOATS)
    (b, s, _h, d), (bk, nb, dk) = q.shape, keys.shape
    if b != bk or d != dk:
        raise ShapeError(
            f"qsa_block_scores: idx_q [B, S, Hi, Di] and block_keys [B, NB, Di] disagree on B or Di: "
            f"idx_q={q} block_keys={keys}"
        )
    return TensorType((b, s, nb), DType.float32)


def _infer_select(ts, *, ratio, top_k_blocks):
    scores, positions = ts
    _positive("qsa_select", "ratio", ratio)
    _positive("qsa_select", "top_k_blocks", top_k_blocks)
    _need("qsa_select", scores, "block_scores", 3, (DType.float32,))
    _positions_match("qsa_select", scores, positions, "block_scores")
    b, s, _nb = scores.shape
    return TensorType((b, s, top_k_blocks), DType.int32)


def _infer_selection_user(op: str, selection: TensorType, positions: TensorType, ratio: int, kv_len: int) -> None:
    _positive(op, "ratio", ratio)
    _positive(op, "kv_len", kv_len)
    _need(op, selection, "selection", 3, (DType.int32,))
    _positions_match(op, selection, positions, "selection")


def _infer_mask(ts, *, ratio, kv_len):
    selection, positions = ts
    _infer_selection_user("qsa_mask", selection, positions, ratio, kv_len)
    b, s, _k = selection.shape
    return TensorType((b, 1, s, kv_len), DType.bool)


def _gather_rule(op: str, dtype: DType):
    def infer(ts, *, ratio, width, kv_len):
        selection, positions = ts
        _infer_selection_user(op, selection, positions, ratio, kv_len)
        b, s, k = selection.shape
        need = min_width(k, ratio)
        if width < need:
            raise ShapeError(
                f"{op}: width={width} is too small for selection={selection} at ratio={ratio}: "
                f"need K*ratio + ratio - 1 = {need} slots ({k} blocks and the tail)"
            )
        return TensorType((b, s, width), dtype)

    return infer


def _infer_gather(ts):
    x, cells = ts
    if x.rank != 4:
        raise ShapeError(f"qsa_gather: x must be [B, H, T, D] (rank 4), got x={x}")
    _need("qsa_gather", cells, "cells", 3, (DType.int32,))
    (b, h, _t, d), (bc, s, w) = x.shape, cells.shape
    if bc != b:
        raise ShapeError(f"qsa_gather: cells must be [B, S, W] with the B={b} of x={x}, got cells={cells}")
    return TensorType((b * s, h, w, d), x.dtype)


register(
    OpDef(
        "qsa_pool",
        (operand("raw_keys"),),
        _infer_pool,
        {"ratio": attr("int")},
        "qsa",
        "Pooled block keys: float32 mean over each complete block of `ratio` rows along axis -2 "
        "(a trailing partial block is dropped), cast back to the operand dtype. [..., T, D] -> [..., T//ratio, D].",
    )
)
register(
    OpDef(
        "qsa_block_scores",
        (operand("idx_q"), operand("block_keys")),
        _infer_block_scores,
        {},
        "qsa",
        "Indexer block scores in float32: sum over heads h of relu(idx_q[b,s,h] . block_keys[b,n]), divided "
        "by sqrt(Di). idx_q [B, S, Hi, Di], block_keys [B, NB, Di] -> f32[B, S, NB].",
    )
)
register(
    OpDef(
        "qsa_select",
        (operand("block_scores"), operand("positions")),
        _infer_select,
        {"ratio": attr("int"), "top_k_blocks": attr("int")},
        "qsa",
        "Block selection: among the visible blocks b < (p + 1) // ratio keep the top min(K, n_complete) by "
        "score (ties: lower block id wins; NaN ranks as -inf). -> i32[B, S, K]: ids ascending, then -1.",
    )
)
register(
    OpDef(
        "qsa_mask",
        (operand("selection"), operand("positions")),
        _infer_mask,
        {"ratio": attr("int"), "kv_len": attr("int")},
        "qsa",
        "The masked form: bool[B, 1, S, kv_len] = (cells of the selected blocks | tail cells) & (cell <= p).",
    )
)
register(
    OpDef(
        "qsa_cells",
        (operand("selection"), operand("positions")),
        _gather_rule("qsa_cells", DType.int32),
        {"ratio": attr("int"), "width": attr("int"), "kv_len": attr("int")},
        "qsa",
        "The gather form's cell indices i32[B, S, width]: slot j*ratio+i is cell selection[j]*ratio+i, then "
        "ratio-1 tail slots n_complete*ratio+t, then padding; unused slots hold the safe cell 0.",
    )
)
register(
    OpDef(
        "qsa_cell_valid",
        (operand("selection"), operand("positions")),
        _gather_rule("qsa_cell_valid", DType.bool),
        {"ratio": attr("int"), "width": attr("int"), "kv_len": attr("int")},
        "qsa",
        "Companion of qsa_cells: bool[B, S, width], True where the slot holds a selected or tail cell "
        "(a selected block b < n_complete, a tail cell <= p, and always cell < kv_len).",
    )
)
register(
    OpDef(
        "qsa_gather",
        (operand("x"), operand("cells")),
        _infer_gather,
        {},
        "qsa",
        "Every row's cells of a cache: x [B, H, T, D] at cells i32[B, S, W] -> [B*S, H, W, D], "
        "out[b*S + s, h, w] = x[b, h, cells[b, s, w]]; cells must lie in [0, T).",
    )
)

__all__ = ["min_width"]
