"""The cache classes mlx-lm and mlx-vlm ship that no route reads: one row each, with the reason.

Every call with one of them runs the client's own function, counted under ``cache_unrouted`` with the row's
reason (tests/backends/mlx_backend/test_caches.py checks that every shipped class has an adapter or a row here). Routing
one of them is a new adapter module in this package, and its row leaves this table.
"""

from __future__ import annotations

from typing import Any

from attnpass.passes import Decline

from ..clients import CLIENTS
from .base import MLX_LM, MLX_VLM, CacheAdapter, register

NO_PREFIX = "its fetch is not a buffer's valid prefix the program could read (no proof written for it)"
LIST = "a container of caches: the client's keys come from one of them, or are built from what they hold"
ROWS: dict[tuple[str, str], str] = {
    (MLX_LM, "ConcatenateKVCache"): "its keys are a fresh concatenation every step: no buffer to key signatures on",
    (MLX_LM, "ArraysCache"): "state arrays of a recurrent layer (no keys and values)",
    **{
        (MLX_VLM, name): f"mlx-vlm's {name}: its quantized helper aligns the mask to the scores otherwise than "
        "mlx-lm's, whose computation the quantized program is"
        for name in ("QuantizedKVCache", "BatchQuantizedKVCache")
    },
    (MLX_VLM, "ConcatenateKVCache"): "its keys are a fresh concatenation every step: no buffer to key signatures on",
    (MLX_VLM, "BufferedRotatingKVCache"): f"a ring with a staging buffer: {NO_PREFIX}",
    (MLX_VLM, "SimpleKVCache"): f"mlx-vlm's SimpleKVCache: {NO_PREFIX}",
    (MLX_VLM, "StaticPrefixKVCache"): f"a fixed prefix beside a growing cache: {NO_PREFIX}",
    **{
        ("mlx_vlm.turboquant", name): f"mlx-vlm's {name}: fused TurboQuant kernels over its own packed state "
        f"(the helper's own route): {NO_PREFIX}"
        for name in ("TurboQuantKVCache", "BatchTurboQuantKVCache", "HybridQuantKVCache")
    },
    (MLX_VLM, "ArraysCache"): "state arrays of a recurrent layer (no keys and values)",
    (MLX_VLM, "PoolingCache"): "pooled states of a compressing layer (no keys and values per position)",
    (MLX_VLM, "BatchPoolingCache"): "pooled states of a compressing layer (no keys and values per position)",
    ("mlx_vlm.models.unlimited_ocr.language", "RingSlidingKVCache"): f"a sliding ring of unlimited_ocr: {NO_PREFIX}",
    **{
        ("mlx_vlm.models.minimax_m3_vl.language", name): f"MiniMax-M3's {name} (a KV cache beside an index-key "
        f"cache for its own sparse selection): {NO_PREFIX}"
        for name in ("MiniMaxM3BatchKVCache",)
    },
}


class Unrouted(CacheAdapter):
    """A cache class no route reads: every call declined with its row's reason."""

    clients = frozenset(CLIENTS)
    why: str

    def plan(self, call: Any) -> Decline:
        return Decline("cache_unrouted", f"{self.name}: {self.why}", data={"cache": self.name})


for (_module, _name), _why in ROWS.items():
    register(type(_name, (Unrouted,), {"module": _module, "name": _name, "why": _why, "__module__": __name__}))


__all__ = ["ROWS", "Unrouted"]
