"""mlx-vlm's own caches (``mlx_vlm.models.cache``) under mlx-vlm's attention helper: mlx-lm's adapters, re-keyed.

mlx-vlm's ``KVCache``, ``RotatingKVCache``, ``ChunkedKVCache`` and ``BatchKVCache`` write and fetch as mlx-lm's
classes of the same names do (the same buffer steps, offsets, rings and masks; their fetch returns the buffer's
first valid rows as a slice where mlx-lm's returns the buffer itself when it is full, which the proofs read alike),
so each is routed by the mlx-lm adapter of its name, with the same proofs and programs; so is its ``CacheList``
(MLA calls of its first entry) and HunyuanV4's ``HyV4KVCache`` (a ``KVCache`` growing by doubling). mlx-vlm's quantized
caches are declined (:mod:`.declined`): its quantized helper aligns the mask to the scores otherwise than
mlx-lm's, whose computation the quantized program is.
"""

from __future__ import annotations

from .base import MLX_VLM, register
from .batch import BatchKVCache
from .cache_list import CacheList
from .chunked import ChunkedKVCache
from .kv import Buffered
from .mla import LatentHolder
from .rotating import RotatingKVCache


@register
class VLMKVCache(LatentHolder, Buffered):
    """mlx-vlm's plain cache; it may hold an MLA latent (:mod:`.mla`, with mlx-vlm's ``MultiLinear``)."""

    module, name = MLX_VLM, "KVCache"
    grows = True


@register
class VLMCacheList(CacheList):
    """mlx-vlm's container: routed only where its first entry holds an MLA latent (deepseek_v32, HunyuanV4)."""

    module = MLX_VLM


@register
class HyV4KVCache(VLMKVCache):
    """HunyuanV4's cache: an mlx-vlm ``KVCache`` whose buffer grows by doubling; its fetch is the buffer's
    first ``offset`` rows, as ``KVCache``'s."""

    module, name = "mlx_vlm.models.hy_v4.cache", "HyV4KVCache"


@register
class VLMRotatingKVCache(RotatingKVCache):
    module = MLX_VLM


@register
class VLMChunkedKVCache(ChunkedKVCache):
    module = MLX_VLM


@register
class VLMBatchKVCache(BatchKVCache):
    module = MLX_VLM


__all__ = ["HyV4KVCache", "VLMBatchKVCache", "VLMCacheList", "VLMChunkedKVCache", "VLMKVCache", "VLMRotatingKVCache"]
