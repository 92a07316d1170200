"""mlx-vlm Qwen4-Exp's ``BatchQSAKVCache``: mlx-vlm's ``BatchKVCache`` (``kv_cache``) beside the indexer's state.

Its QSA calls take :class:`~.qsa.QSAKVCache`'s proofs with the inner cache's fetch and ``_idx`` in place of a
``QSAKVCache``'s offset, then the same gather program over the inner buffer, one per batch size: each stream's
row gathers its own selection's cells. mlx-vlm prefills a batch one stream at a time on single-stream caches and
merges them; equal-length streams then decode with QSA calls on this cache, while left-padded streams decode
through the model's ``left_padded_decode``, which makes no QSA call.
"""

from __future__ import annotations

from attnpass.passes import Decline

from ..calls import Patch, classes, fetch_decline, fetch_recorder
from ..clients import QSA_DISPATCH
from .base import MLX_VLM, QWEN4_EXP, CacheAdapter, Plan, QSACall, Routed, register
from .batch import written
from .qsa import model_keeps, selection_decline, selection_patch


@register
class BatchQSAKVCache(CacheAdapter):
    module, name = QWEN4_EXP, "BatchQSAKVCache"
    clients = frozenset({QSA_DISPATCH.name})

    def patches(self) -> list[Patch]:
        (inner,) = classes(MLX_VLM, "BatchKVCache")
        return [(inner, "update_and_fetch", fetch_recorder(written)), selection_patch()]

    def plan(self, call: QSACall) -> Decline | Plan:
        inner = call.cache.kv_cache
        found = (
            model_keeps(call)
            or fetch_decline(call.keys, call.values, inner, call.recorded, written)
            or selection_decline(call, call.cache, inner._idx, call.recorded)
        )
        return found or Plan("qsa_attention", inner._idx, lambda: self.routed(call))

    def routed(self, call: QSACall) -> Routed:
        """The gather program over the inner cache's buffer."""
        inner = call.cache.kv_cache
        arrays = (call.queries, inner.keys, inner.values, call.blocks, call.query_ends)
        return Routed("qsa_attention", (*arrays, call.options["scale"], call.options["block_size"]), list(arrays))


__all__ = ["BatchQSAKVCache"]
