"""mlx-vlm Qwen4-Exp's ``QSAQuantizedKVCache``: K/V as packed words, scales and biases; the indexer float.

The proofs are :class:`~.qsa.QSAKVCache`'s, array by array. The model's dispatch has no sparse plan for packed
K/V: it builds the selection's mask over the whole cache and runs mlx-vlm's quantized helper over every row. The
program is ``qsa_quantized_attention`` over the buffer's six arrays (the words viewed as int32), one signature per
buffer length, group size and bits; ``qsa-gather`` gathers each row's cells of the six arrays and attends them
with one ``quantized_sdpa``: only the selected cells' packed rows are read, nothing is dequantized.
"""

from __future__ import annotations

from attnpass.passes import Decline

from ..buffers import words
from .base import MLX_VLM, QWEN4_EXP, Plan, QSACall, Routed, register
from .qsa import QSAKVCache


@register
class QSAQuantizedKVCache(QSAKVCache):
    module, name = QWEN4_EXP, "QSAQuantizedKVCache"
    fetched_by = (MLX_VLM, "QuantizedKVCache")

    def plan(self, call: QSACall) -> Decline | Plan:
        found = super().plan(call)
        return found if isinstance(found, Decline) else Plan("qsa_quantized_attention", found.rows, found.build)

    def routed(self, call: QSACall) -> Routed:
        cache = call.cache
        arrays = (call.queries, *[words(a) for a in (*cache.keys, *cache.values)], call.blocks, call.query_ends)
        statics = (call.options["scale"], call.options["block_size"], cache.group_size, cache.bits)
        return Routed("qsa_quantized_attention", (*arrays, *statics), list(arrays))


__all__ = ["QSAQuantizedKVCache"]
