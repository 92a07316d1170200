"""mlx-lm's ``CacheList``: a container of caches, routed only where its first entry holds an MLA latent.

deepseek_v32 and glm_moe_dsa hand the helper a ``CacheList(KVCache, KVCache)``: the latent cache, then the
indexer's. A call that is an MLA call of the first entry (:func:`~.mla.involved`), whose adapter holds latents,
is that entry's MLA call, with the other entries as companions (the indexer cache whose top-k :mod:`.mla` may
read); every other call is declined as before (``cache_unrouted``): the client's keys come from one of the
entries, or are built from what they hold.
"""

from __future__ import annotations

from typing import Any

from attnpass.passes import Decline

from .base import MLX_LM, CacheAdapter, HelperCall, register, registered
from .declined import LIST
from .mla import LatentHolder, involved


class Entries(CacheAdapter):
    """A container whose calls no route reads."""

    def plan(self, call: Any) -> Decline:
        return Decline("cache_unrouted", f"{self.name}: {LIST}", data={"cache": self.name})


@register
class CacheList(LatentHolder, Entries):
    module, name = MLX_LM, "CacheList"

    def latent(self, call: HelperCall) -> tuple[Any, tuple] | None:
        caches = tuple(call.cache.caches)
        if caches and isinstance(registered(caches[0]), LatentHolder) and involved(call, caches[0]):
            return caches[0], caches[1:]
        return None


__all__ = ["CacheList", "Entries"]
