"""mlx-lm's ``KVCache``, and what every cache whose fetch is its buffer's first rows shares (:class:`Buffered`).

``update_and_fetch`` writes the new rows at ``offset`` into a buffer grown in steps of 256 rows and returns the
buffer's first ``offset`` rows. A call whose keys and values *are* what that fetch returned in this model call
(recorded by the patch this adapter installs), with the cache still holding that buffer and offset, has
``keys == cache.keys[..., :offset, :]`` by the cache's own code: its program gets the buffer cut to
:func:`~..routing.buffer_rows` rows and a mask of the valid rows (one signature per cut length, not per token).
A buffer shorter than its cut is first grown to it (:func:`~..routing.grow`: zero rows, as the cache grows it),
so the cuts, and the signatures, stay :func:`~..routing.cuts_bound`'s few per doubling of the context.
A prefill (more than :data:`PREFILL_ROWS` query rows) attends its own keys instead (:func:`~.base.own_keys`).
A ``KVCache`` may hold an MLA latent: its MLA calls are :mod:`.mla`'s.
"""

from __future__ import annotations

from typing import Any

from attnpass.passes import Decline

from ..routing import Patch, buffer_rows, classes, fetch_decline, fetch_recorder, first_rows, grow, offset
from .base import (
    MLX_LM, CacheAdapter, HelperCall, Routed, mask_keys_decline, masked, own_keys, register, string_mask_decline,
)  # fmt: skip
from .mla import LatentHolder

PREFILL_ROWS = 64  # more query rows on a KVCache: a prefill, given its own keys (one signature per length)


def key_rows(keys: Any) -> int:
    """The rows of a cache's keys: an array's, or a quantized cache's (words, scales, biases)."""
    return (keys[0] if isinstance(keys, (tuple, list)) else keys).shape[2]


class Buffered(CacheAdapter):
    """A cache whose fetch is its buffer's first rows (:meth:`holds` says which), routed over the buffer's cut;
    ``grows``: a buffer shorter than the cut is grown to it (else the cut is at most the buffer: a ring's, a
    chunk's, bounded by the model)."""

    grows = False

    def patches(self) -> list[Patch]:
        return [(classes(self.module, self.name)[0], "update_and_fetch", fetch_recorder(offset))]

    def holds(self, keys: Any, cache: Any) -> bool:
        """Whether ``keys``, the cache's last fetch, are its buffer's first rows."""
        return key_rows(keys) == cache.offset <= key_rows(cache.keys)

    def own_keys(self, call: HelperCall) -> bool:
        """Whether the call attends its own keys rather than the buffer's cut."""
        return call.rows > PREFILL_ROWS

    def decline(self, call: HelperCall) -> Decline | None:
        n, cache = key_rows(call.keys), call.cache
        found = string_mask_decline(call) or fetch_decline(call.keys, call.values, cache, call.recorded)
        found = found or mask_keys_decline(call, n)
        if found is None and not self.holds(call.keys, cache):
            length = key_rows(cache.keys)
            message = f"{self.name}: the keys ({n} rows) are not the buffer's valid prefix ({length} rows)"
            found = Decline("not_prefix", message, data={"rows": n, "buffer_rows": length})
        return found

    def route(self, call: HelperCall) -> Routed:
        if self.own_keys(call):
            return own_keys(call)
        cache, n = call.cache, key_rows(call.keys)
        length = self.cut(call)
        if self.grows:
            grow(cache, length, call.recorded)
        mask = call.masks.over_buffer(call.mask, call.rows, n, length)
        return masked(call, first_rows(cache.keys, length), first_rows(cache.values, length), mask)

    def most_rows(self, call: HelperCall) -> int:
        return self.cut(call)

    def cut(self, call: HelperCall) -> int:
        """The rows of the buffer's cut a decode call's program is given."""
        return buffer_rows(key_rows(call.keys), None if self.grows else key_rows(call.cache.keys))


@register
class KVCache(LatentHolder, Buffered):
    """mlx-lm's plain cache; it may hold an MLA latent (:mod:`.mla`)."""

    module, name = MLX_LM, "KVCache"
    grows = True


__all__ = ["PREFILL_ROWS", "Buffered", "KVCache", "key_rows"]
