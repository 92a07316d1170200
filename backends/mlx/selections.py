"""Learned selections: masks a model's indexer built from its top blocks or tokens, routed to a gather of them.

mlx-lm's MiniMax-M3 (``minimax_m3_vl``) builds, in ``Attention._block_mask``, a bool mask ``[B, Hq, L, S]``: per
selection head (``index_n_heads``, each serving ``Hq / index_n_heads`` query heads, the mask repeated over them)
and query row, the ``index_topk_blocks`` top blocks of ``index_block_size`` keys (the row's local blocks forced in),
widened to their keys and intersected with the causal cells; its helper call then attends all ``S`` keys under it.
mlx-vlm's MiniMax-M3 does the same off Metal (``MiniMaxM3Indexer.build_block_mask``: one selection shared by the
heads, ``[B, 1, L, S]``). Each builder is a row of :data:`BLOCK_MASKS`.

A call is routed to the ``selected_attention`` program (``dsa-gather`` then attends each row's cells only) when:

- its mask *is* what ``_block_mask`` returned in this model call (recorded by :func:`patches`; a call where every
  block fits the budget gets the model's own mask back and is not one), with the module's block size, top-k and
  selection heads;
- on its values (:func:`block_selection`, one evaluation): the mask is the same on every query head of a selection
  head, every row keeps at most ``top_k`` blocks and at least one key (the gathered softmax then weighs the same
  cells: ``dsa-gather``'s ``rows_have_keys``), and the ``top_k`` blocks gathered are fewer keys than the cut;
- the cache's buffer can be cut past the last block (a growing ``KVCache``: the cut is rounded up to whole blocks,
  so each row's cells are distinct rows of the cut, ``dsa-gather``'s ``selection_input`` promise).

Each row's cells are then its ``top_k`` most occupied blocks (every occupied one, and unoccupied ones to fill,
whose cells the mask hides), and the program attends ``where(cells selected, mask, False)``: on every cell what
the mask says, so the gather reads exactly the keys the model attends. Otherwise the call stays the cache's own
masked plan.

Token selections over an MLA latent (:func:`latent_plan`): mlx-vlm's LongCat-Flash-Sparse attends a call of a few
rows in the latent form (keys *are* values *are* the cached latent it fetched) under its rope scores masked to the
top-k tokens its ``Indexer`` returned (a row of :data:`TOKEN_INDEXERS`, recorded). When the mask is, on its values,
one recorded top-k of itself (every other cell at or below ``finfo.min``, a selected cell above it in every row),
the call goes to ``token_attention``: one gather of the latent per row. The same recorded top-k serves the MLA
programs (:mod:`.caches.mla`, :func:`recorded_top_k`): calls the model expands (LongCat's prefill, every multi-row
call of HunyuanV4 and mlx-vlm's DeepSeek-V3.2) go to ``dsa_attention``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .buffers import buffer_rows, first_rows, grow, words
from .calls import Call, Patch, Plan, Routed, key_rows, last_fetch, offset, recorder, unchanged_decline
from .masks import pad_last

SELECTIONS = "block selections"  # the notes of the block masks built in a call: id -> (mask, BlockSelection)


@dataclass(frozen=True)
class BlockSelection:
    """What a block-mask builder keeps: ``top_k`` blocks of ``block`` keys per row and selection head (``heads``)."""

    heads: int
    block: int
    top_k: int


def mlx_lm_block_mask(layer: Any, result: Any, x: Any, mask: Any, *_: Any) -> BlockSelection | None:
    """mlx-lm MiniMax-M3's ``Attention._block_mask``: one selection per index head, repeated over its query heads;
    the model's own ``mask`` handed back when every block fits the budget (no selection)."""
    if result is mask:
        return None
    return BlockSelection(layer.index_n_heads, layer.index_block_size, layer.index_topk_blocks)


def mlx_vlm_block_mask(indexer: Any, result: Any, block_indices: Any, *_: Any) -> BlockSelection | None:
    """mlx-vlm MiniMax-M3's ``MiniMaxM3Indexer.build_block_mask``: the blocks ``block_indices`` ``[B, L, K]``, one
    selection shared by every head, intersected with the model's mask (bool; an additive mask gives a float one,
    which the proof on values declines)."""
    return BlockSelection(1, indexer.block_size, block_indices.shape[-1])


# (module, class, method) of each block-mask builder -> what it keeps, read off its owner, result and arguments
BLOCK_MASKS: dict[tuple[str, str, str], Callable[..., BlockSelection | None]] = {
    ("mlx_lm.models.minimax_m3_vl", "Attention", "_block_mask"): mlx_lm_block_mask,
    ("mlx_vlm.models.minimax_m3_vl.language", "MiniMaxM3Indexer", "build_block_mask"): mlx_vlm_block_mask,
}


def block_mask_recorder(reads: Callable[..., BlockSelection | None]) -> Callable[..., Any]:
    """The recorder of one builder: each mask it returns in an optimized call, with what ``reads`` says it keeps."""

    def note(call: Call, result: Any, owner: Any, *args: Any, **kwargs: Any) -> None:
        found = None if result is None or isinstance(result, str) else reads(owner, result, *args, **kwargs)
        if found is not None:
            call.notes(SELECTIONS)[id(result)] = (result, found)

    return recorder(note)


def patches() -> list[Patch]:
    """The recorders of the block-mask builders and token indexers of the model modules imported."""
    found: list[Patch] = []
    for (module, owner, method), reads in BLOCK_MASKS.items():
        if module in sys.modules:
            found.append((getattr(importlib.import_module(module), owner), method, block_mask_recorder(reads)))
    for module, owner, method in TOKEN_INDEXERS:
        if module in sys.modules:
            found.append((getattr(importlib.import_module(module), owner), method, recorder(note_token_selection)))
    return found


TOKEN_SELECTIONS = "token selections"  # the notes of the top-k indices an indexer returned in a call: id -> idx

# (module, class, method) of each token indexer: it returns each row's top-k key positions, [B, 1, L, K], distinct
# (an argpartition's last K) and below the keys it scored (the cache's fetch), or None (every key fits)
TOKEN_INDEXERS = (
    ("mlx_vlm.models.longcat_flash_sparse.language", "Indexer", "__call__"),
    ("mlx_vlm.models.deepseek_v32.language", "Indexer", "__call__"),
    ("mlx_vlm.models.hy_v4.indexer", "HyV4Indexer", "__call__"),
)


def note_token_selection(call: Call, result: Any, *_: Any, **__: Any) -> None:
    """The top-k an indexer returned (None: every key fits, nothing to note)."""
    if result is not None:
        call.notes(TOKEN_SELECTIONS)[id(result)] = result


def latent_plan(call: Any) -> Plan | None:
    """The ``token_attention`` plan of an absorbed latent call (keys *are* values *are* the cache's last fetched
    keys: MLA's latent, the queries already in its space) whose additive mask is, on its values, a top-k an indexer
    returned in this call (:func:`selection_holds`: every unselected cell at or below ``finfo.min``,
    every row a selected cell above it), over the buffer's cut (at most the buffer); None otherwise."""
    cache, keys = call.cache, call.keys
    fetch = last_fetch(cache, call.recorded)
    if keys is not call.values or fetch is None or keys is not fetch.keys or call.sinks is not None:
        return None
    n = key_rows(keys)
    if unchanged_decline(cache, fetch, offset, call.recorded) is not None or not n == cache.offset <= key_rows(
        cache.keys
    ):
        return None
    mask = call.mask
    if mask is None or isinstance(mask, str) or mask.ndim != 4 or mask.shape[2:] != (call.rows, n):
        return None
    length = buffer_rows(n, key_rows(cache.keys))
    idx = recorded_top_k(call, n)
    return None if idx is None else Plan("attention", length, lambda: _latent_routed(call, length, idx))


def recorded_top_k(call: Any, n: int) -> Any:
    """The last top-k a token indexer returned in this call (:data:`TOKEN_INDEXERS`) that the call's mask, over
    ``n`` keys, selects (:func:`selection_holds`); None if none does."""
    mask = call.mask
    for idx in reversed(call.recorded.notes(TOKEN_SELECTIONS).values()):
        if idx.shape[:3] == (mask.shape[0], 1, call.rows) and selection_holds(mask, idx, n):
            return idx
    return None


def _latent_routed(call: Any, length: int, idx: Any) -> Routed:
    """The ``token_attention`` arguments over the latent buffer cut to ``length`` rows."""
    latent = first_rows(call.cache.keys, length)
    mask = pad_last(call.mask, length - key_rows(call.keys))
    arrays = [call.queries, latent, mask, words(idx)]
    return Routed("token_attention", (*arrays, call.scale), arrays)


def selection_holds(mask: Any, idx: Any, n: int) -> bool:
    """Whether the additive ``mask`` ``[B, H|1, L, n]`` is, on its values, the head-shared selection ``idx``
    ``[B, 1, L, K]`` (K < n) of itself: every cell outside the selection at or below ``finfo.min`` (so
    ``where(selected, mask, finfo.min)`` attends as ``mask`` does) and in every row a selected cell above it (the
    gathered softmax then weighs the same cells)."""
    import mlx.core as mx

    if idx.ndim != 4 or idx.shape[:3] != (mask.shape[0], 1, mask.shape[2]) or idx.shape[3] >= n:
        return False
    b, _, rows, k = idx.shape
    low = mx.array(mx.finfo(mask.dtype).min, mask.dtype)
    selected = mx.put_along_axis(mx.zeros((b, 1, rows, n), mx.bool_), idx, mx.array(True), axis=-1)
    outside = mx.any(mx.logical_and(mx.logical_not(selected), mask > low))
    kept = mx.take_along_axis(mask, mx.broadcast_to(idx, (*mask.shape[:3], k)), axis=-1)
    every_row = mx.all(kept.max(axis=-1) > low)
    mx.eval(outside, every_row)
    return not outside.item() and every_row.item()


def selected_plan(call: Any, grows: bool) -> Plan | None:
    """The ``selected_attention`` plan of a helper call whose mask is a recorded block selection that holds on
    its values, over the cache's buffer cut rounded up to whole blocks; None otherwise."""
    held, found = call.recorded.notes(SELECTIONS).get(id(call.mask), (None, None))
    if found is None or held is not call.mask or call.sinks is not None:
        return None
    n = key_rows(call.keys)
    blocks = -(-n // found.block)
    length = -(-buffer_rows(n) // found.block) * found.block
    if not grows and length > key_rows(call.cache.keys) or found.top_k * found.block >= length:
        return None
    cells = block_selection(call.mask, found, blocks)
    if cells is None:
        return None
    return Plan("attention", length, lambda: _routed(call, length, *cells))


def block_selection(mask: Any, found: BlockSelection, blocks: int) -> tuple[Any, Any] | None:
    """``(mask per selection head [B, H, L, S], each row's cells [B, H, L, top_k * block])`` when ``mask`` holds
    as :class:`BlockSelection` says on its values (the module docstring), else None."""
    import mlx.core as mx

    b, hq, rows, n = mask.shape
    if mask.dtype != mx.bool_ or hq % found.heads:
        return None
    group = hq // found.heads
    per_head = mask[:, ::group] if group > 1 else mask
    padded = pad_last(per_head, blocks * found.block - n) if blocks * found.block > n else per_head
    occupied = padded.reshape(b, found.heads, rows, blocks, found.block).any(axis=-1)
    same = mx.array_equal(mx.repeat(per_head, group, axis=1), mask) if group > 1 else mx.array(True)
    fits = mx.all(occupied.sum(axis=-1) <= found.top_k)
    keyed = mx.all(occupied.any(axis=-1))
    mx.eval(same, fits, keyed)
    if not (same.item() and fits.item() and keyed.item()):
        return None
    top = mx.argpartition(-occupied.astype(mx.int32), kth=found.top_k - 1, axis=-1)[..., : found.top_k]
    cells = top.astype(mx.int32)[..., None] * found.block + mx.arange(found.block, dtype=mx.int32)
    return per_head, cells.reshape(b, found.heads, rows, found.top_k * found.block)


def _routed(call: Any, length: int, per_head: Any, cells: Any) -> Routed:
    """The ``selected_attention`` arguments over the buffer cut to ``length`` rows (grown to them first)."""
    cache = call.cache
    grow(cache, length, call.recorded)
    keys, values = first_rows(cache.keys, length), first_rows(cache.values, length)
    mask = pad_last(per_head, length - key_rows(call.keys))
    arrays = [call.queries, keys, values, mask, cells]
    return Routed("selected_attention", (*arrays, call.scale), arrays)


__all__ = [
    "BLOCK_MASKS", "SELECTIONS", "BlockSelection", "block_mask_recorder", "block_selection", "mlx_lm_block_mask",
    "TOKEN_INDEXERS", "TOKEN_SELECTIONS", "latent_plan", "mlx_vlm_block_mask", "note_token_selection", "patches",
    "recorded_top_k", "selected_plan", "selection_holds",
]  # fmt: skip
