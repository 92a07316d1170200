"""Cache adapters: one module per cache kind, each registering what the router knows of its class.

:func:`adapter_for` finds a cache's adapter by its exact class; :data:`ADAPTERS` holds them all, keyed by the
class's module and name. Importing this package registers every built-in adapter: mlx-lm's ``KVCache``,
``QuantizedKVCache``, ``RotatingKVCache``, ``ChunkedKVCache``, ``BatchKVCache``, ``BatchRotatingKVCache`` and
``CacheList`` (its MLA calls), calls without a cache, mlx-vlm Qwen4-Exp's ``QSAKVCache``, ``QSAQuantizedKVCache``
and ``BatchQSAKVCache``, mlx-vlm's own ``KVCache``, ``RotatingKVCache``, ``ChunkedKVCache``, ``BatchKVCache``
(:mod:`.vlm`) and ``BatchRotatingKVCache``, MiniMax-M3's ``MiniMaxM3KVCache`` (:mod:`.minimax`), and the classes
no route reads (:mod:`.declined`).
"""

from . import (  # noqa: F401
    batch,
    batch_rotating,
    cache_list,
    chunked,
    declined,
    kv,
    minimax,
    qsa,
    qsa_batch,
    qsa_quantized,
    quantized,
    rotating,
    uncached,
    vlm,
)
from .base import ADAPTERS, CacheAdapter, HelperCall, Plan, QSACall, Routed, adapter_for, register

__all__ = ["ADAPTERS", "CacheAdapter", "HelperCall", "Plan", "QSACall", "Routed", "adapter_for", "register"]
