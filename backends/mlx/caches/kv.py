"""mlx-lm's ``KVCache``, and what every cache whose fetch is its buffer's first rows shares (:class:`Buffered`).

``update_and_fetch`` writes the new rows at ``offset`` into a buffer grown in steps of 256 rows and returns the
buffer's first ``offset`` rows. A call whose keys and values *are* what that fetch returned in this model call
(recorded by the patch this adapter installs), with the cache still holding that buffer and offset, has
``keys == cache.keys[..., :offset, :]`` by the cache's own code: its program gets the buffer cut to
:func:`~..buffers.buffer_rows` rows and a mask of the valid rows (one signature per cut length, not per token).
A buffer shorter than its cut is first grown to it (:func:`~..buffers.grow`: zero rows, as the cache grows it),
so the cuts, and the signatures, stay :func:`~..buffers.cuts_bound`'s few per doubling of the context.
A prefill (more than :data:`PREFILL_ROWS` query rows) attends its own keys instead (:func:`~..masks.own_keys`).
A call whose mask is a learned indexer's block selection, proven, is gathered (:mod:`~..selections`), at any
number of rows. A ``KVCache`` may hold an MLA latent: its MLA calls are :mod:`.mla`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnpass.passes import Decline

from .. import selections
from ..buffers import cut_plan
from ..calls import Patch, Routed, classes, depends_patch, fetch_recorder, key_rows, offset, received_decline
from ..masks import own_keys
from .base import MLX_LM, CacheAdapter, HelperCall, Plan, register
from .mla import LatentHolder

PREFILL_ROWS = 64  # more query rows on a KVCache: a prefill, given its own keys (one signature per length)


class Buffered(CacheAdapter):
    """A cache whose fetch is its buffer's first rows (:meth:`holds` says which), routed over the buffer's cut;
    ``grows``: a buffer shorter than the cut is grown to it (else the cut is at most the buffer: a ring's, a
    chunk's, bounded by the model); ``program`` and ``arguments``: the program over the cut and its arguments
    (None: :func:`~..buffers.over_cut`'s)."""

    grows = False
    program = "attention"
    arguments: Callable[[Any, int, bool], Routed] | None = None

    def patches(self) -> list[Patch]:
        fetching = (classes(self.module, self.name)[0], "update_and_fetch", fetch_recorder(offset))
        return [fetching, depends_patch(), *selections.patches()]

    def holds(self, keys: Any, cache: Any) -> bool:
        """Whether ``keys``, the cache's last fetch, are its buffer's first rows."""
        return key_rows(keys) == cache.offset <= key_rows(cache.keys)

    def own_keys(self, call: HelperCall) -> bool:
        """Whether the call attends its own keys rather than the buffer's cut."""
        return call.rows > PREFILL_ROWS

    def plan(self, call: HelperCall) -> Decline | Plan:
        found = received_decline(call, self.holds(call.keys, call.cache))
        if found is not None:
            return found
        selected = selections.selected_plan(call, self.grows)
        if selected is not None:
            return selected
        if not self.own_keys(call):
            return cut_plan(call, self.program, self.grows, type(self).arguments)
        return own_keys(call)


@register
class KVCache(LatentHolder, Buffered):
    """mlx-lm's plain cache; it may hold an MLA latent (:mod:`.mla`)."""

    module, name = MLX_LM, "KVCache"
    grows = True


__all__ = ["PREFILL_ROWS", "Buffered", "KVCache"]
