"""mlx-lm's ``QuantizedKVCache`` (``kv_bits``): K and V as MLX's packed words, scales and biases.

The proof is :class:`~.kv.KVCache`'s, array by array (the fetch is three tuples' first ``offset`` rows). The
program is mlx-lm's own quantized helper over the buffer's six arrays cut to :func:`~..buffers.buffer_rows`
rows (grown to them first, as :class:`~.kv.KVCache`'s; the words viewed as int32 of the same bits), raised to
``quantized_sdpa`` and lowered GQA-folded; the group size and bits are part of its signature. A prefill takes the
same program (its keys are the cache's packed words). Attention sinks are declined: mlx-lm's quantized helper
refuses them.
"""

from __future__ import annotations

from typing import Any

from attnpass.passes import Decline

from ..buffers import first_rows, grow, words
from .base import MLX_LM, HelperCall, Plan, Routed, register
from .kv import Buffered


def over_cut(call: Any, length: int, grows: bool) -> Routed:
    """The quantized program's arguments: the buffer's six arrays cut to ``length`` rows (grown first)."""
    cache = call.cache
    grow(cache, length, call.recorded)
    mask = call.masks.over_buffer(call.mask, call.rows, cache.offset, length)
    arrays = (call.queries, *(first_rows(a, length) for a in (*cache.keys, *cache.values)), mask)
    args = (*arrays, call.scale, cache.group_size, cache.bits)
    return Routed("quantized_attention", args, [words(a) for a in arrays])


@register
class QuantizedKVCache(Buffered):
    module, name = MLX_LM, "QuantizedKVCache"
    grows = True
    program = "quantized_attention"
    arguments = staticmethod(over_cut)

    def plan(self, call: HelperCall) -> Decline | Plan:
        found = super().plan(call)
        if isinstance(found, Plan) and call.sinks is not None:
            return Decline("quantized_sinks", "attention sinks on a QuantizedKVCache (mlx-lm's helper refuses them)")
        return found

    def own_keys(self, call: HelperCall) -> bool:
        return False  # a prefill too: its keys are the cache's packed words


__all__ = ["QuantizedKVCache"]
