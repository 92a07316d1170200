"""Benchmark (not a test): one learned-sparse attention layer, plain vs ``optimize``, paired.

``--family minimax_m3``: mlx-lm's own ``minimax_m3_vl.Attention`` at the per-head geometry the issue measured: 16
query heads over 1 KV head of 128, an indexer of 4 heads of 128, blocks of 128 keys, the top 16 (one forced local
block). Plain: mlx-lm attends all ``T`` keys under the block mask (masked dense; on Metal too, mlx-lm calls no sparse
kernel); ``optimize`` routes the call to ``selected_attention``, a gather of each row's 16 x 128 selected keys.
``--family longcat``: mlx-vlm's ``LongcatFlashMLA`` (an index owner) at LongCat-Flash's per-head geometry with 16
heads: latent 512 + rope 64, nope 128, value 128, an indexer of 16 heads of 128 keeping the top 2,048 tokens. Plain:
a call of a few rows on a warm cache attends the whole latent (absorbed) under the top-k mask; ``optimize`` routes
it to ``token_attention``, one gather of the latent per row (a decode row the model gathers itself).
``--family hy_v4``: mlx-vlm's ``HyV4Attention`` (an index owner) at HunyuanV4's per-head geometry with 4 heads:
latent 512 + rope 64, nope 192, value 256, sinks, an indexer of 32 heads of 128 keeping the top 2,048. Plain: a
call of several rows expands the whole latent to per-head keys and values and attends all of them under the top-k
mask; ``optimize`` routes it to ``dsa_attention`` (absorbed, then gathered).

Hidden size ``--hidden`` (1024: the projections are not what is compared). The layer's caches are filled directly to
each context with random rows through their own ``update_and_fetch``; each timed call is one layer call of ``--rows``
rows (1: decode; 4: a speculative verify step; 256: a chunk on a warm cache), then the caches are trimmed back, so
every call sees the same context. The two run in turn, ``--reps`` pairs, the order alternating; the table reports
each median, the median of the pairs' ratios and the largest |difference| of the outputs. The physical bound: the
gathered call reads 2,048 keys per row (and, for MiniMax, index head) instead of ``T``, so the attention's work falls
by ``T / 2048``; the indexer (the model's own code, ``T`` index keys per row on both sides) is what remains
(backends/mlx/selections.py, docs/sparse_selections.md).

    python benchmarks/sparse_layers.py [--family hy_v4 longcat minimax_m3] [--contexts 8192 32768 131072] [--rows 1 4]
        [--dtype float32 bfloat16] [--reps 5] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from attnpass.backends.mlx import optimize

GEOMETRY = {
    "minimax_m3": dict(
        num_attention_heads=16, num_key_value_heads=1, head_dim=128, index_n_heads=4, index_head_dim=128,
        index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
    ),
    "longcat": dict(
        num_attention_heads=16, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, index_n_heads=16, index_head_dim=128, index_topk=2048, attention_method="LSA",
    ),
    "hy_v4": dict(
        num_attention_heads=4, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, qk_nope_head_dim=192,
        v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048, num_hidden_layers=1, indexer_types=["full"],
    ),
}  # fmt: skip
LATENT = {"longcat": (512, 64, 128), "hy_v4": (512, 64, 128)}  # latent, rope key and index key widths


class OneLayer(nn.Module):
    """The attention layer as a model: ``optimize`` routes the calls made inside a model's ``__call__``."""

    def __init__(self, family: str, hidden: int) -> None:
        super().__init__()
        self.family = family
        if family == "minimax_m3":
            from mlx_lm.models import minimax_m3_vl

            self.attention = minimax_m3_vl.Attention(minimax_m3_vl.TextArgs(hidden_size=hidden, **GEOMETRY[family]), 0)
        elif family == "longcat":
            from mlx_vlm.models.longcat_flash_sparse import language
            from mlx_vlm.models.longcat_flash_sparse.config import ModelConfig

            config = ModelConfig(hidden_size=hidden, **GEOMETRY[family])
            self.attention = language.LongcatFlashMLA(config, is_index_owner=True)
        else:
            from mlx_vlm.models.hy_v4 import language
            from mlx_vlm.models.hy_v4.config import ModelConfig

            self.attention = language.HyV4Attention(ModelConfig(hidden_size=hidden, **GEOMETRY[family]), 0)

    def __call__(self, x: mx.array, mask: object, cache: list) -> mx.array:
        if self.family == "minimax_m3":
            return self.attention(x, mask, cache)
        if isinstance(mask, str):  # mlx-vlm's model passes its causal mask as an array
            n = cache[0].offset + x.shape[1]
            mask = mx.arange(n)[None] <= mx.arange(n - x.shape[1], n)[:, None]
        if self.family == "longcat":
            return self.attention(x, mask, cache[0], cache[1])[0]
        return self.attention(x, mask, cache)[0]

    def filled(self, context: int, dtype: mx.Dtype) -> list:
        """The layer's two caches holding ``context`` random rows."""
        if self.family == "minimax_m3":
            from mlx_lm.models.cache import KVCache

            shapes = ((1, 1, 128), (1, 1, 128), (1, 1, 128), (1, 1, 0))
        else:
            from mlx_vlm.models.cache import CacheList, KVCache
            from mlx_vlm.models.hy_v4.cache import HyV4KVCache

            shapes = ((1, 1, LATENT[self.family][0]), (1, 1, 64), (1, 1, 128), (1, 1, 0))
        caches = [KVCache(), KVCache()] if self.family != "hy_v4" else [HyV4KVCache(), HyV4KVCache()]
        for start in range(0, context, 8192):
            n = min(8192, context - start)
            arrays = [mx.random.normal((a, b, n, d)).astype(dtype) for a, b, d in shapes]
            caches[0].update_and_fetch(arrays[0], arrays[1])
            caches[1].update_and_fetch(arrays[2], arrays[3])
            mx.eval([c.keys for c in caches], caches[0].values)
        return caches if self.family != "hy_v4" else CacheList(*caches)


def one_call(model: OneLayer, x: mx.array, cache: list) -> tuple[float, mx.array]:
    """Seconds of one layer call of ``x``'s rows on ``cache``, then the caches trimmed back; and its output."""
    mask = None if x.shape[1] == 1 else "causal"
    start = time.perf_counter()
    out = model(x, mask, cache)
    mx.eval(out)
    seconds = time.perf_counter() - start
    for c in cache:
        c.trim(x.shape[1])
    return seconds, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", default=sorted(GEOMETRY), choices=sorted(GEOMETRY))
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    a = parser.parse_args()
    print(f"hidden {a.hidden}, {mx.default_device()}, load {os.getloadavg()}")
    print("| family | dtype | context | rows | plain ms | optimize ms | paired ratio | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    mx.random.seed(0)
    for family, dtype_name in ((f, d) for f in a.family for d in a.dtype):
        dtype = getattr(mx, dtype_name)
        model, routed = OneLayer(family, a.hidden), OneLayer(family, a.hidden)
        model.set_dtype(dtype)
        routed.update(model.parameters())  # the same weights
        mx.eval(model.parameters())
        opt = optimize(routed)
        models = {"plain": model, "optimize": routed}
        for context in a.contexts:
            cache = model.filled(context, dtype)
            for rows in a.rows:
                x = mx.random.normal((1, rows, a.hidden)).astype(dtype)
                times: dict[str, list[float]] = {"plain": [], "optimize": []}
                outs = {}
                for rep in range(a.reps + 1):  # the first pair warms up (and traces), untimed
                    for variant in ("plain", "optimize") if rep % 2 == 0 else ("optimize", "plain"):
                        seconds, outs[variant] = one_call(models[variant], x, cache)
                        if rep:
                            times[variant].append(seconds)
                diff = np.abs(
                    np.array(outs["plain"].astype(mx.float32)) - np.array(outs["optimize"].astype(mx.float32))
                )
                paired = statistics.median(p / o for p, o in zip(times["plain"], times["optimize"]))
                plain, optimized = (statistics.median(times[v]) * 1e3 for v in ("plain", "optimize"))
                print(f"| {family} | {dtype_name} | {context} | {rows} | {plain:.1f} | {optimized:.1f} | {paired:.2f}x | "
                      f"{diff.max():.2e} |", flush=True)  # fmt: skip
        print(f"{family} {dtype_name}: routed {opt.routed}, declined {dict(opt.declined)}")
        opt.restore()
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
