"""mlx-lm's ``RotatingKVCache``: the sliding-window layers of gemma3, cohere2, gpt_oss, exaone4, ...

``update_and_fetch`` returns the buffer itself, or its first ``offset`` rows while the buffer is longer. A decode
step attends the buffer as it is (a full ring in its rotated order: every row it holds is in the window, and the
model's mask, if any, is over that order) with the rows past the keys masked out; a step of several rows (which
concatenates and trims the ring) attends its own keys, its mask proven a window (:func:`~.base.own_keys`).
"""

from __future__ import annotations

from typing import Any

from .base import MLX_LM, HelperCall, register
from ..calls import key_rows
from .kv import Buffered


@register
class RotatingKVCache(Buffered):
    module, name = MLX_LM, "RotatingKVCache"

    def holds(self, keys: Any, cache: Any) -> bool:
        return keys is cache.keys or key_rows(keys) == cache.offset < key_rows(cache.keys)

    def own_keys(self, call: HelperCall) -> bool:
        return call.rows > 1


__all__ = ["RotatingKVCache"]
