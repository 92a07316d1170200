"""Batched caches under ``optimize``: mlx-lm's ``BatchKVCache`` (``batch_generate``, the server).

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
  so none of its calls has such a row. Checking it evaluates the mask (a small
  array built from the padding, not from the model's activations).

**The program's arguments**: the queries, the whole buffer and the model's own
mask extended over the rows past ``_idx`` with masked-out keys (False, or
``-inf`` for an additive mask): per stream, the same keys attended with the
same weights as the helper's call, whatever each stream's padding. Signatures
are per buffer length, as with ``KVCache`` (:mod:`.lm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .router import ACTIVE, NOT_FETCHED

NO_ARRAY_MASK = "a BatchKVCache call without an array mask (the streams' left padding is only in the model's mask)"
BLIND_ROW = (
    "a query row of the bool mask sees no key (a left-padded prefill's padding rows): "
    "mlx-lm's helper gives such a row a value of its own, the padded buffer would average its unwritten rows too"
)


@dataclass(frozen=True)
class BatchFetch:
    """What one ``BatchKVCache.update_and_fetch`` returned, and the buffer and row count it left."""

    keys: Any
    values: Any
    buffer: tuple[Any, Any]
    rows: int  # the cache's _idx


def is_batch(cache: Any) -> bool:
    """Whether ``cache`` is exactly mlx-lm's ``BatchKVCache``."""
    from mlx_lm.models.cache import BatchKVCache

    return type(cache) is BatchKVCache


def record_fetch(update_and_fetch: Callable[..., Any]) -> Callable[..., Any]:
    """``BatchKVCache.update_and_fetch`` that also records its result in the active optimized call, if any."""

    def recording(cache: Any, keys: Any, values: Any) -> Any:
        result = update_and_fetch(cache, keys, values)
        call = ACTIVE.get()
        if call is not None:
            call.fetched[id(cache)] = (cache, BatchFetch(*result, (cache.keys, cache.values), cache._idx))
        return result

    recording.__wrapped__ = update_and_fetch  # type: ignore[attr-defined]
    return recording


def unroutable(keys: Any, values: Any, cache: Any, mask: Any, fetched: dict) -> str | None:
    """Why a ``BatchKVCache`` call cannot take the program (None when it can): see the module docstring."""
    held, fetch = fetched.get(id(cache), (None, None))
    if held is not cache or not isinstance(fetch, BatchFetch) or keys is not fetch.keys or values is not fetch.values:
        return NOT_FETCHED
    if cache.keys is not fetch.buffer[0] or cache.values is not fetch.buffer[1] or cache._idx != fetch.rows:
        return "the cache changed between update_and_fetch and the attention call"
    if mask is None or isinstance(mask, str):
        return NO_ARRAY_MASK
    if mask.shape[-1] != cache._idx:
        return f"the mask covers {mask.shape[-1]} keys, the BatchKVCache holds {cache._idx} rows"
    if _has_blind_row(mask):
        return BLIND_ROW
    return None


def _has_blind_row(mask: Any) -> bool:
    """Whether a bool mask has a query row with no visible key (evaluates the mask: it never reads the model's state)."""
    import mlx.core as mx

    return mask.dtype == mx.bool_ and not mx.all(mx.any(mask, axis=-1)).item()


def arguments(queries: Any, cache: Any, mask: Any, pad: Callable[[Any, int], Any]) -> tuple:
    """``(queries, keys, values, mask)``: the buffer, and the model's mask ``pad``-ded over its unwritten rows."""
    extra = cache.keys.shape[2] - cache._idx
    return queries, cache.keys, cache.values, pad(mask, extra) if extra else mask


__all__ = ["NO_ARRAY_MASK", "BatchFetch", "arguments", "is_batch", "record_fetch", "unroutable"]
