"""mlx-lm's ``ChunkedKVCache``: llama4's chunked attention layers.

``update_and_fetch`` returns the buffer's first ``offset - start_position`` rows (the current chunk's). A decode
step attends the buffer's cut; a step of several rows attends its own keys, its mask proven a chunk
(:func:`~.base.own_keys`: the cache starts mid-chunk, so the keys before the first one any row sees are left out
and chunks count from key 0).
"""

from __future__ import annotations

from typing import Any

from .base import MLX_LM, HelperCall, register
from ..calls import key_rows
from .kv import Buffered


@register
class ChunkedKVCache(Buffered):
    module, name = MLX_LM, "ChunkedKVCache"

    def holds(self, keys: Any, cache: Any) -> bool:
        return key_rows(keys) == cache.offset - cache.start_position <= key_rows(cache.keys)

    def own_keys(self, call: HelperCall) -> bool:
        return call.rows > 1


__all__ = ["ChunkedKVCache"]
