"""mlx-vlm Qwen4-Exp's ``QSAKVCache``: its QSA calls attended by a gather over the model's own selection.

``Qwen4ExpAttention`` calls ``dispatch_qsa_attention(queries, keys, values, selected_blocks, query_ends,
cache=..., causal=..., mask=...)``. A call is routed (the ``qsa_attention`` program over the cache's whole buffer,
rewritten by ``qsa-gather`` with the selection input promised) only when:

- ``keys``/``values`` *are* the arrays the cache's last ``update_and_fetch`` of this model call returned, and it
  still holds that buffer and offset (so ``keys == cache.keys[..., :offset, :]``);
- ``selected_blocks`` and ``query_ends`` *are* what the indexer's last selection for this cache returned
  (recorded), made without left padding, with the indexer's block size, over as many keys as the cache holds:
  what ``selection_input`` promises;
- ``causal`` with no mask (the model would attend ``qsa_mask(selection, query_ends - 1)``), and the model's own
  plan is not its indexed sparse kernel (Metal, float16/bfloat16), which keeps its calls.

The indexer itself stays the model's code. The one part of the cache's own code replaced, while an optimized call
runs, is where ``update_indexer`` keeps the raw indexer keys and positions: appended in place into buffers beside
the cache (:func:`buffered_indexer`) instead of concatenating the whole history every step, the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnpass.passes import Decline

from ..calls import ACTIVE, Call, Patch, classes, fetch_decline, fetch_recorder, offset, recorder
from ..clients import QSA_DISPATCH
from .base import MLX_VLM, QWEN4_EXP, CacheAdapter, Plan, QSACall, Routed, register

STEP = 256  # indexer buffer growth, as KVCache's


def model_keeps(call: QSACall) -> Decline | None:
    """Why the model's own dispatch keeps a QSA call: a mask combined with the selection, or its sparse kernel."""
    from mlx_vlm.models.qwen4_exp.qsa_kernel import QSAExecutionPlan, select_qsa_execution_plan

    options = call.options
    if not options["causal"] or options["mask"] is not None:
        return Decline("model_mask", "the model combined a mask with the selection (left padding or an array mask)")
    plan = select_qsa_execution_plan(
        call.queries, call.keys, call.values, call.blocks, call.query_ends, block_size=options["block_size"],
        causal=True, allow_sparse_decode=options.get("allow_sparse_decode", False),
    )  # fmt: skip
    if plan is QSAExecutionPlan.INDEXED_SPARSE_PREFILL:
        return Decline("model_kernel", "the model's indexed sparse kernel takes this call (Metal, float16/bfloat16)")
    return None


def selection_decline(call: QSACall, cache: Any, rows: int, recorded: Call) -> Decline | None:
    """None when the call's blocks and query ends are the indexer's last selection for ``cache`` over ``rows``."""
    held, selection, ratio = recorded.notes(SELECTIONS).get(id(cache), (None, None, None))
    if held is not cache or call.blocks is not selection.selected_blocks or call.query_ends is not selection.query_ends:
        message = "selected_blocks/query_ends are not the arrays this cache's indexer selection returned in this call"
        return Decline("not_selected", message)
    block_size = call.options["block_size"]
    if not selection.zero_padding:
        return Decline("qsa_form", "the selection was made with left padding")
    if block_size != ratio:
        message = f"block_size {block_size} is not the indexer's compress ratio {ratio}"
        return Decline("qsa_form", message, data={"block_size": block_size, "ratio": ratio})
    if selection.key_len != rows:
        message = f"the indexer selected over {selection.key_len} keys, the cache holds {rows}"
        return Decline("qsa_form", message, data={"selected_keys": selection.key_len, "keys": rows})
    return None


SELECTIONS = "qsa selections"  # the notes of the indexer's selections, by cache: id -> (cache, selection, ratio)


def note_selection(call: Call, selection: Any, indexer: Any, qk: Any, cache: Any, position_ids: Any) -> None:
    """What the indexer's ``select_from_projected`` returned, by cache, with its compress ratio."""
    if cache is not None and selection is not None:
        call.notes(SELECTIONS)[id(cache)] = (cache, selection, indexer.compress_ratio)


@dataclass
class IndexBuffer:
    """The indexer's raw keys and positions kept in buffers beside a ``QSAKVCache``; the cache holds views."""

    keys: Any  # [B, capacity, D]
    positions: Any  # [..., capacity]
    length: int
    view: tuple[Any, Any] | None  # the (index_keys, index_position_ids) the cache was given


def buffered_indexer(update_indexer: Callable[..., Any]) -> Callable[..., Any]:
    """``update_indexer`` that appends into a buffer (in place) instead of concatenating, when active.

    Under an optimized call the keys and positions are written into buffers grown by :data:`STEP` rows, and the
    cache gets the views ``buffer[:, :length]``: the same values as the concatenation. Whenever the cache no
    longer holds the views it was given (trimmed, loaded, a plain call in between) or a write would change shape
    or dtype, the model's own update runs and the buffers are rebuilt from its result.
    """

    def update(cache: Any, keys: Any, position_ids: Any) -> Any:
        if ACTIVE.get() is None:
            return update_indexer(cache, keys, position_ids)
        buffer, n = cache.__dict__.get("_attnpass_index"), keys.shape[1]
        if buffer is None or not _appendable(buffer, cache, keys, position_ids):
            index_keys, positions = update_indexer(cache, keys, position_ids)
            buffer = cache._attnpass_index = _rebuild(index_keys, positions)
        else:
            buffer.view = cache.index_keys = cache.index_position_ids = None  # the buffers' only readers now
            start = buffer.length
            buffer.keys[:, start : start + n] = keys
            buffer.positions[..., start : start + n] = position_ids.astype(buffer.positions.dtype)
            buffer.length = start + n
        view = (buffer.keys[:, : buffer.length], buffer.positions[..., : buffer.length])
        cache.index_keys, cache.index_position_ids = buffer.view = view
        return view

    update.__wrapped__ = update_indexer  # type: ignore[attr-defined]
    return update


def _same_after_concat() -> set[tuple[Any, Any]]:
    """(new, held) position dtypes whose concatenation keeps the held dtype."""
    import mlx.core as mx

    return {(mx.int32, mx.int32), (mx.int64, mx.int64), (mx.int32, mx.int64)}


def _appendable(buffer: IndexBuffer, cache: Any, keys: Any, positions: Any) -> bool:
    """The cache holds the buffers' views and the new rows fit them (shape, dtype, capacity) as concat would."""
    held = buffer.view is not None and cache.index_keys is buffer.view[0] and cache.index_position_ids is buffer.view[1]
    return (
        held
        and buffer.length + keys.shape[1] <= buffer.keys.shape[1]
        and keys.shape[0] == buffer.keys.shape[0] and keys.shape[2:] == buffer.keys.shape[2:]
        and keys.dtype == buffer.keys.dtype
        and positions.shape[:-1] == buffer.positions.shape[:-1]
        and (positions.dtype, buffer.positions.dtype) in _same_after_concat()
    )  # fmt: skip


def _rebuild(index_keys: Any, positions: Any) -> IndexBuffer:
    """Buffers holding ``index_keys`` and ``positions``, with room for at least :data:`STEP` more rows."""
    import mlx.core as mx

    length = index_keys.shape[1]
    capacity = (length // STEP + 2) * STEP
    keys = mx.zeros((index_keys.shape[0], capacity, *index_keys.shape[2:]), dtype=index_keys.dtype)
    keys[:, :length] = index_keys
    held = mx.zeros((*positions.shape[:-1], capacity), dtype=positions.dtype)
    held[..., :length] = positions
    return IndexBuffer(keys, held, length, None)


def selection_patch() -> Patch:
    """The recorder of the indexer's selections, which every QSA adapter's proof reads."""
    (indexer,) = classes(QWEN4_EXP, "Qwen4ExpQSAIndexer")
    return (indexer, "select_from_projected", recorder(note_selection))


@register
class QSAKVCache(CacheAdapter):
    module, name = QWEN4_EXP, "QSAKVCache"
    clients = frozenset({QSA_DISPATCH.name})
    fetched_by = (MLX_VLM, "KVCache")  # the class whose update_and_fetch the cache inherits

    def patches(self) -> list[Patch]:
        fetching, own = classes(*self.fetched_by)[0], classes(self.module, self.name)[0]
        recorder = (fetching, "update_and_fetch", fetch_recorder(offset))
        return [recorder, (own, "update_indexer", buffered_indexer), selection_patch()]

    def plan(self, call: QSACall) -> Decline | Plan:
        cache = call.cache
        found = (
            model_keeps(call)
            or fetch_decline(call.keys, call.values, cache, call.recorded)
            or selection_decline(call, cache, cache.offset, call.recorded)
        )
        return found or Plan("qsa_attention", cache.offset, lambda: self.routed(call))

    def routed(self, call: QSACall) -> Routed:
        """The gather program over the cache's whole buffer and the model's own selection."""
        arrays = (call.queries, call.cache.keys, call.cache.values, call.blocks, call.query_ends)
        return Routed("qsa_attention", (*arrays, call.options["scale"], call.options["block_size"]), list(arrays))


__all__ = [
    "SELECTIONS", "IndexBuffer", "QSAKVCache", "buffered_indexer", "model_keeps", "note_selection",
    "selection_decline",
]  # fmt: skip
