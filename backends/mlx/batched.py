"""Batched caches under ``optimize``: mlx-lm's ``BatchKVCache`` (``batch_generate``, the server), mlx-vlm's ``BatchQSAKVCache``.

**The cache.** A ``BatchKVCache`` holds ``B`` left-padded streams in one buffer
``[B, H, capacity, D]`` grown in steps of 256 rows; ``_idx`` rows are written
(the same count for every stream), ``offset`` and ``left_padding`` are
per-stream arrays. ``update_and_fetch`` returns ``keys[..., :_idx, :]`` (and so
for values), and the model's mask (``make_mask``: causal, with each stream's
left padding masked out) covers those ``_idx`` keys.

**What the router proves** before it substitutes the buffer (else it declines by
name and mlx-lm's helper runs):

- the cache is exactly a ``BatchKVCache``; ``keys``/``values`` *are* the arrays
  its last ``update_and_fetch`` of this model call returned (recorded by
  :func:`record_fetch`), and it still holds that buffer and ``_idx``; so
  ``keys == cache.keys[..., :_idx, :]`` by ``BatchKVCache``'s own code;
- the mask is an array over ``_idx`` keys: the streams' left padding is only in
  the model's mask, so a call without one (``None`` or a string) is declined;
- every query row of a bool mask sees a key. A row that sees none (the padding
  rows of a left-padded prefill) is no stream's attention: mlx-lm's helper
  gives it a device-defined value (on CPU the mean of every value), which the
  padded buffer would change; such calls are declined (:data:`BLIND_ROW`).
  ``batch_generate`` prefills right-padded into empty caches and then decodes,
  so none of its calls has such a row. A mask that ``BatchKVCache.make_mask``
  returned in this model call (recorded by :func:`record_mask`) is
  ``create_causal_mask(N, offset=_idx, left_padding=...)`` by mlx-lm's code:
  row ``i`` of stream ``b`` sees key ``_idx + i`` unless its left padding is
  larger, so every row sees a key iff ``max(left_padding) <= _idx``, decided
  from the values read when it was made (no evaluation of the mask). Any other
  mask is evaluated: a host sync, which stalls MLX's asynchronous decode (the
  next step's graph is then built only after the previous step has computed;
  measured: a tiny bf16 llama's ``GenerationBatch`` decode at 0.76x plain
  tokens/s when every call evaluated its mask, ``benchmarks/mlx_lm_decode.py
  --batched``).

**The program's arguments**: the queries, the buffer cut to
:func:`~.router.buffer_rows` rows and the model's own mask extended over the
rows past ``_idx`` with masked-out keys (False, or ``-inf`` for an additive
mask): per stream, the same keys attended with the same weights as the
helper's call, whatever each stream's padding. Signatures are per cut length,
as with ``KVCache`` (:mod:`.lm`).

**mlx-vlm Qwen4-Exp's** ``BatchQSAKVCache`` wraps mlx-vlm's own
``BatchKVCache`` (``kv_cache``; the same code as mlx-lm's, recorded by
:func:`record_fetch` as well) beside the indexer's state. Its QSA calls take
the proofs of :mod:`.vlm` (the model's plan, its selection by identity, made
without left padding, over as many keys as the cache holds) with the inner
cache's fetch and ``_idx`` in place of a ``QSAKVCache``'s, then the same gather
program over the inner buffer, one per batch size: each stream's row gathers
its own selection's cells (``selection [B, S, K]``). What mlx-vlm 0.7.10 does
with a batch decides what reaches it: the model prefills a batch one stream
at a time on single-stream ``QSAKVCache`` caches (routed by :mod:`.vlm`) and
merges them; equal-length streams then decode with QSA calls on the
``BatchQSAKVCache`` (routed here), while left-padded (ragged) streams decode
through the model's ``left_padded_decode`` path, which attends each stream
densely and makes no QSA call, so there is nothing of theirs to route.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import router, vlm
from .router import ACTIVE, MLX_LM_CACHES, QWEN4_EXP, buffer_rows, classes, fetch_recorder, first_rows

NO_ARRAY_MASK = "a BatchKVCache call without an array mask (the streams' left padding is only in the model's mask)"
BLIND_ROW = (
    "a query row of the bool mask sees no key (a left-padded prefill's padding rows): "
    "mlx-lm's helper gives such a row a value of its own, the padded buffer would average its unwritten rows too"
)


def is_batch(cache: Any) -> bool:
    """Whether ``cache`` is exactly mlx-lm's ``BatchKVCache``."""
    return type(cache) is classes(MLX_LM_CACHES, "BatchKVCache")[0]


def written(cache: Any) -> int:
    """A ``BatchKVCache``'s write position: ``_idx``, the rows written for every stream."""
    return cache._idx


record_fetch = fetch_recorder(written)


def fetch_reason(keys: Any, values: Any, cache: Any, fetched: dict) -> str | None:
    """None when ``keys``/``values`` are the batch cache's last fetch and it still holds that buffer; else why not."""
    return router.fetch_reason(keys, values, cache, fetched, written)


def record_mask(make_mask: Callable[..., Any]) -> Callable[..., Any]:
    """A patch of ``BatchKVCache.make_mask`` that also records, in the active optimized call, whether every query
    row of the mask it returned sees a key (:func:`sees_every_row`, from the cache's padding read now)."""

    def recording(cache: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = make_mask(cache, N, return_array=return_array, **kwargs)
        call = ACTIVE.get()
        if call is not None and set(kwargs) <= {"window_size"}:
            window = kwargs.get("window_size")
            if window is None or window >= 1:  # a row's own position is in its window
                call.masks[id(mask)] = (mask, sees_every_row(cache._idx, cache.left_padding.tolist()))
        return mask

    recording.__wrapped__ = make_mask  # type: ignore[attr-defined]
    return recording


def sees_every_row(written: int, left_padding: list[int]) -> bool:
    """Whether every query row of ``create_causal_mask(N, offset=written, left_padding=...)`` sees a key: row
    ``i`` of stream ``b`` sees keys ``left_padding[b] .. written + i``, so the first row is the test."""
    return max(left_padding, default=0) <= written


def unroutable(keys: Any, values: Any, cache: Any, mask: Any, fetched: dict, masks: dict) -> str | None:
    """Why a ``BatchKVCache`` call cannot take the program (None when it can): see the module docstring."""
    reason = fetch_reason(keys, values, cache, fetched)
    if reason is not None:
        return reason
    if mask is None or isinstance(mask, str):
        return NO_ARRAY_MASK
    if mask.shape[-1] != cache._idx:
        return f"the mask covers {mask.shape[-1]} keys, the BatchKVCache holds {cache._idx} rows"
    if _has_blind_row(mask, masks):
        return BLIND_ROW
    return None


def _has_blind_row(mask: Any, masks: dict) -> bool:
    """Whether a bool mask has a query row with no visible key: as recorded when ``make_mask`` made it, else
    :func:`_evaluated_blind_row`."""
    made, sees = masks.get(id(mask), (None, False))
    if made is mask:
        return not sees
    return _evaluated_blind_row(mask)


def _evaluated_blind_row(mask: Any) -> bool:
    """Whether a bool mask has a query row with no visible key, by evaluating it (a host sync)."""
    import mlx.core as mx

    return mask.dtype == mx.bool_ and not mx.all(mx.any(mask, axis=-1)).item()


def arguments(queries: Any, cache: Any, mask: Any, pad: Callable[[Any, int], Any]) -> tuple:
    """``(queries, keys, values, mask)``: the buffer's first :func:`~.router.buffer_rows` rows, and the model's
    mask ``pad``-ded over the unwritten ones among them."""
    length = buffer_rows(cache._idx, cache.keys.shape[2])
    extra = length - cache._idx
    keys, values = (first_rows(a, length) for a in (cache.keys, cache.values))
    return queries, keys, values, pad(mask, extra) if extra else mask


def is_qsa_batch(cache: Any) -> bool:
    """Whether ``cache`` is exactly mlx-vlm Qwen4-Exp's ``BatchQSAKVCache``."""
    return type(cache) is classes(QWEN4_EXP, "BatchQSAKVCache")[0]


def unprovable_qsa(
    queries: Any, keys: Any, values: Any, blocks: Any, query_ends: Any, cache: Any, block_size: int,
    causal: bool, mask: Any, allow_sparse_decode: bool, fetched: dict, selections: dict,
) -> str | None:  # fmt: skip
    """Why a ``BatchQSAKVCache`` call cannot take the gather program (None when it can): see the module docstring."""
    reason = vlm.model_keeps(queries, keys, values, blocks, query_ends, block_size, causal, mask, allow_sparse_decode)
    if reason is not None:
        return reason
    reason = fetch_reason(keys, values, cache.kv_cache, fetched)
    return reason or vlm.selection_reason(blocks, query_ends, cache, block_size, cache.kv_cache._idx, selections)


def qsa_buffer(cache: Any) -> tuple[Any, Any]:
    """The ``(keys, values)`` buffers a QSA cache holds: its own, or its inner ``BatchKVCache``'s."""
    holder = cache.kv_cache if is_qsa_batch(cache) else cache
    return holder.keys, holder.values


__all__ = [
    "BLIND_ROW", "NO_ARRAY_MASK", "arguments", "fetch_reason", "is_batch", "is_qsa_batch", "qsa_buffer",
    "record_fetch", "record_mask", "sees_every_row", "unprovable_qsa", "unroutable", "written",
]  # fmt: skip
