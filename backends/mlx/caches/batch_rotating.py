"""mlx-lm's and mlx-vlm's ``BatchRotatingKVCache``: ``B`` left-padded streams in one ring per layer (batched
generation over sliding-window layers, or with ``max_kv_size``).

The ring ``[B, H, length, D]`` grows in steps of 256 rows up to ``max_size``. A one-row step writes in place
(rotating once the ring is full) and returns the ring's first ``_offset`` rows while it is shorter than the ring,
else the ring itself in its rotated order; a step of several rows puts the ring in temporal order, trims it and
appends, and returns the new ring itself. Each stream's left padding, its window and the rotation are only in
the model's mask, which ``make_mask`` builds over the fetched rows in the fetch's order.

A call is routed when its keys and values are the cache's fetch in this model call, the ring unchanged since
(its arrays, ``_offset``, ``_idx`` and rotation), the fetch the ring's first rows (:meth:`holds`), and its mask
an array over the fetched rows in which every query row sees a key (:func:`~.batch.blind_row_decline`; a mask
``make_mask`` returned is decided from the padding it was made with, :func:`sees_every_row`, without
evaluating it). Each stream's program then gets its rows of the ring's cut (:func:`~..buffers.buffer_rows` of the
fetched rows, at most the ring) and of the model's mask, masked out over the cut's rows past the fetch: it reads
exactly the keys and values mlx-lm's helper received, under the same mask, so each stream attends its own valid
window (the same proof as :class:`~.batch.BatchKVCache`'s, the ring's order being the fetch's).
"""

from __future__ import annotations

from typing import Any

from attnpass.passes import Decline

from ..buffers import buffer_rows, first_rows
from ..calls import Patch, Plan, classes, fetch_recorder, key_rows, received_decline, recorder
from ..masks import pad_last
from .base import MLX_LM, MLX_VLM, CacheAdapter, HelperCall, register
from .batch import array_mask_decline, blind_row_decline, mask_note, per_stream


def ring_position(cache: Any) -> tuple[int, int, bool]:
    """A ring's write position: the rows written (``_offset``), its write index and whether it has rotated."""
    return cache._offset, cache._idx, cache.rotated


def in_place(cache: Any, rows: int) -> bool:
    """Whether mlx-lm's ring writes a call of ``rows`` query rows in place (its ``make_mask`` reads the same)."""
    return rows == 1


def sees_every_row(cache: Any, rows: int, in_place: Any = in_place) -> bool:
    """Whether every query row of ``cache.make_mask(rows, ...)`` sees a key: query row ``i`` sees the keys from its
    stream's left padding (as the mask shifts it for a trim and a rotation) up to position ``offset + i``, so the
    first row is the test, as for a flat batch."""
    offset = min(cache.max_size - 1, cache._offset)
    shift = max(cache._idx - cache.max_size + int(not in_place(cache, rows)), 0)
    rotated = in_place(cache, rows) and (cache.rotated or cache._idx >= cache.max_size)
    return max(cache.left_padding.tolist(), default=0) - shift - int(rotated) <= offset


@register
class BatchRotatingKVCache(CacheAdapter):
    module, name = MLX_LM, "BatchRotatingKVCache"
    in_place = staticmethod(in_place)

    def patches(self) -> list[Patch]:
        cls = classes(self.module, self.name)[0]
        sees = mask_note(lambda cache, rows: sees_every_row(cache, rows, self.in_place))
        return [(cls, "update_and_fetch", fetch_recorder(ring_position)), (cls, "make_mask", recorder(sees))]

    def holds(self, keys: Any, cache: Any) -> bool:
        """Whether the fetch ``keys`` is the ring's first rows: the ring itself, or its first ``_offset`` rows."""
        return keys is cache.keys or key_rows(keys) == cache._offset <= key_rows(cache.keys)

    def plan(self, call: HelperCall) -> Decline | Plan:
        cache, n = call.cache, key_rows(call.keys)
        found = received_decline(call, self.holds(call.keys, cache), ring_position)
        found = found or array_mask_decline(call, n) or blind_row_decline(call)
        if found is not None:
            return found
        length = buffer_rows(n, key_rows(cache.keys))

        def build() -> Any:
            keys, values = first_rows(cache.keys, length), first_rows(cache.values, length)
            return per_stream(call, keys, values, pad_last(call.mask, length - n) if length > n else call.mask)

        return Plan("attention", length, build)


@register
class VLMBatchRotatingKVCache(BatchRotatingKVCache):
    """mlx-vlm's ring: mlx-lm's, but a one-row call while right padding is being tracked (``_lengths``, set by
    ``prepare``) goes through the concatenating path, in its ``update_and_fetch`` and ``make_mask`` alike."""

    module = MLX_VLM
    in_place = staticmethod(lambda cache, rows: rows == 1 and cache._lengths is None)


__all__ = ["BatchRotatingKVCache", "VLMBatchRotatingKVCache", "in_place", "ring_position", "sees_every_row"]
