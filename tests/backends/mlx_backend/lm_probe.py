"""A one-attention module in mlx-lm's style, for the router tests: optimize() routes this module's helper.

``Probe()(queries, keys, values, cache, mask)`` puts the new k/v through the
cache as mlx-lm's models do (``update_and_fetch``; a ``CacheList``'s first
cache; nothing for a cache without one, or with ``fetch=False``), runs
``between(cache)`` if given, and calls mlx-lm's ``scaled_dot_product_attention``,
the name ``optimize`` replaces in this module. ``mask`` may be a function of
the number of keys the helper receives (built after the fetch, as models build
masks from the cache). ``received`` holds the k/v and mask the helper was given.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import CacheList

SCALE = 0.125


def key_rows(keys: Any) -> int:
    """Rows of keys as the helper receives them (a quantized cache gives a tuple of arrays)."""
    return (keys[0] if isinstance(keys, tuple) else keys).shape[-2]


class Probe(nn.Module):
    received: tuple[Any, Any, Any]

    def __call__(
        self, queries: Any, keys: Any, values: Any, cache: Any, mask: Any = None, *,
        fetch: bool = True, between: Callable[[Any], None] | None = None, sinks: Any = None,
    ) -> Any:  # fmt: skip
        if fetch and isinstance(cache, CacheList):
            keys, values = cache[0].update_and_fetch(keys, values)
        elif fetch and hasattr(cache, "update_and_fetch"):
            keys, values = cache.update_and_fetch(keys, values)
        if between is not None:
            between(cache)
        if callable(mask):
            mask = mask(key_rows(keys))
        object.__setattr__(self, "received", (keys, values, mask))  # not a parameter: outside nn.Module's dict
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=SCALE, mask=mask, sinks=sinks)


def spy_run(run: Callable[..., Any], substituted: list) -> Callable[..., Any]:
    """``OptimizedModel._run`` that also keeps every routed call's program and arguments in ``substituted``."""

    def spy(self: Any, routed: Any, *rest: Any) -> Any:
        substituted.append(routed)
        return run(self, routed, *rest)

    return spy
