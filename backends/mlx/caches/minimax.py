"""mlx-vlm MiniMax-M3's ``MiniMaxM3KVCache``: an mlx-vlm ``KVCache`` (``kv_cache``) beside the index keys.

Its ``update_and_fetch`` is its ``kv_cache``'s, so a helper call over it is that ``KVCache``'s call, routed by
:class:`~.vlm.VLMKVCache` with the same proofs (the fetch recorded on the inner cache) and programs; the sparse
layers' block masks (``MiniMaxM3Indexer.build_block_mask``) are gathered (:mod:`~..selections`). Its batched twin
stays declined (:mod:`.declined`).
"""

from __future__ import annotations

import dataclasses
from attnpass.passes import Decline

from ..calls import Patch
from .base import CacheAdapter, HelperCall, Plan, register
from .vlm import VLMKVCache

MINIMAX_M3 = "mlx_vlm.models.minimax_m3_vl.language"


@register
class MiniMaxM3KVCache(CacheAdapter):
    """The inner ``kv_cache``'s route."""

    module, name = MINIMAX_M3, "MiniMaxM3KVCache"
    inner = VLMKVCache()

    def patches(self) -> list[Patch]:
        return self.inner.patches()

    def plan(self, call: HelperCall) -> Decline | Plan:
        return self.inner.plan(dataclasses.replace(call, cache=call.cache.kv_cache))


__all__ = ["MINIMAX_M3", "MiniMaxM3KVCache"]
