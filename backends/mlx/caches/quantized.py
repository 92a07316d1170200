"""mlx-lm's ``QuantizedKVCache`` (``kv_bits``): K and V as MLX's packed words, scales and biases.

The proof is :class:`~.kv.KVCache`'s, array by array (the fetch is three tuples' first ``offset`` rows). The
program is mlx-lm's own quantized helper over the buffer's six arrays cut to :func:`~..routing.buffer_rows`
rows (grown to them first, as :class:`~.kv.KVCache`'s; the words viewed as int32 of the same bits), raised to
``quantized_sdpa`` and lowered GQA-folded; the group size and bits are part of its signature. Attention sinks
are declined: mlx-lm's quantized helper refuses them.
"""

from __future__ import annotations

from attnpass.passes import Decline

from ..routing import first_rows, grow, words
from .base import MLX_LM, HelperCall, Routed, register
from .kv import Buffered


@register
class QuantizedKVCache(Buffered):
    module, name = MLX_LM, "QuantizedKVCache"
    grows = True

    def decline(self, call: HelperCall) -> Decline | None:
        found = super().decline(call)
        if found is None and call.sinks is not None:
            return Decline("quantized_sinks", "attention sinks on a QuantizedKVCache (mlx-lm's helper refuses them)")
        return found

    def route(self, call: HelperCall) -> Routed:
        cache = call.cache
        length = self.cut(call)
        grow(cache, length, call.recorded)
        mask = call.masks.over_buffer(call.mask, call.rows, cache.offset, length)
        arrays = (call.queries, *(first_rows(a, length) for a in (*cache.keys, *cache.values)), mask)
        args = (*arrays, call.scale, cache.group_size, cache.bits)
        return Routed("quantized_attention", args, [words(a) for a in arrays])

    def policy(self, call: HelperCall) -> str:
        return "quantized"


__all__ = ["QuantizedKVCache"]
