"""A module whose two attention calls share one fetch of its cache, as layers sharing their KV do: optimize()
routes this module's helper (mlx-lm's ``scaled_dot_product_attention``, the name it replaces here).

``SharedKV()(queries, keys, values, cache, mask)`` makes the mask first (``mask()``, as a model makes it from the
cache before the fetch), puts the new k/v through ``cache.update_and_fetch`` and calls the helper twice on what it
returned (each on a copy of the queries: mlx-lm's quantized helper scales them in place); ``received`` holds the
k/v and mask the helper was given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

SCALE = 0.125


class SharedKV(nn.Module):
    received: tuple[Any, Any, Any]

    def __call__(
        self, queries: Any, keys: Any, values: Any, cache: Any, mask: Callable[[], Any]
    ) -> tuple[Any, Any]:  # fmt: skip
        made = mask()
        keys, values = cache.update_and_fetch(keys, values)
        object.__setattr__(self, "received", (keys, values, made))  # not a parameter: outside nn.Module's dict
        return tuple(
            scaled_dot_product_attention(mx.array(queries), keys, values, cache=cache, scale=SCALE, mask=made)
            for _ in range(2)
        )
