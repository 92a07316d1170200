"""mlx-vlm Qwen4-Exp's ``BatchQSAKVCache``: mlx-vlm's ``BatchKVCache`` (``kv_cache``) beside the indexer's state.

Its QSA calls take :class:`~.qsa.QSAKVCache`'s proofs with the inner cache's fetch and ``_idx`` in place of a
``QSAKVCache``'s offset, then the same gather program over the inner buffer, one per batch size: each stream's
row gathers its own selection's cells. mlx-vlm prefills a batch one stream at a time on single-stream caches and
merges them; equal-length streams then decode with QSA calls on this cache, while left-padded streams decode
through the model's ``left_padded_decode``, which makes no QSA call.
"""

from __future__ import annotations

from attnpass.passes import Decline

from ..routing import Patch, classes, fetch_decline, fetch_recorder
from .base import MLX_VLM, QWEN4_EXP, CacheAdapter, QSACall, Routed, register
from .batch import written
from .qsa import model_keeps, selection_decline, selection_patch


@register
class BatchQSAKVCache(CacheAdapter):
    module, name = QWEN4_EXP, "BatchQSAKVCache"
    clients = frozenset({"qsa"})

    def patches(self) -> list[Patch]:
        (inner,) = classes(MLX_VLM, "BatchKVCache")
        return [(inner, "update_and_fetch", fetch_recorder(written)), selection_patch()]

    def decline(self, call: QSACall) -> Decline | None:
        inner = call.cache.kv_cache
        return (
            model_keeps(call)
            or fetch_decline(call.keys, call.values, inner, call.recorded, written)
            or selection_decline(call, call.cache, inner._idx, call.recorded)
        )

    def route(self, call: QSACall) -> Routed:
        inner = call.cache.kv_cache
        arrays = (call.queries, inner.keys, inner.values, call.blocks, call.query_ends)
        return Routed("qsa_attention", (*arrays, call.options["scale"], call.options["block_size"]), list(arrays))


__all__ = ["BatchQSAKVCache"]
