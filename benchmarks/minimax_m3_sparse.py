"""Benchmark (not a test): one MiniMax-M3 sparse attention layer (mlx-lm), plain vs ``optimize``, paired.

The layer is mlx-lm's own ``minimax_m3_vl.Attention`` at the per-head geometry the issue measured: 16 query heads
over 1 KV head of 128, an indexer of 4 heads of 128, blocks of 128 keys, the top 16 (one forced local block);
hidden size ``--hidden`` (1024: the projections are not what is compared). Its two caches (keys/values, index keys)
are filled directly to each context with random rows through their own ``update_and_fetch``; each timed call is
one layer call of ``--rows`` rows (1: decode; 4: a speculative verify step; 256: a chunk on a warm cache), then both
caches are trimmed back, so every call sees the same context. Plain: mlx-lm attends all ``T`` keys under the block
mask (masked dense; on Metal too, mlx-lm calls no sparse kernel). ``optimize``: the same call routed to
``selected_attention``, which dsa-gather turns into a gather of each row's 16 x 128 selected keys
(backends/mlx/selections.py). The two run in turn, ``--reps`` pairs, the order alternating; the table reports each
median, the median of the pairs' ratios and the largest |difference| of the outputs. The physical bound: the gathered
call reads 2,048 keys per row and selection head instead of ``T``, so the attention's work falls by ``T / 2048``;
the indexer (the model's own code, ``T`` index keys per row on both sides) is what remains.

    python benchmarks/minimax_m3_sparse.py [--contexts 8192 32768 131072] [--rows 1 4] [--dtype float32 bfloat16]
        [--reps 5] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import minimax_m3_vl
from mlx_lm.models.cache import KVCache

from attnpass.backends.mlx import optimize

GEOMETRY = dict(
    num_attention_heads=16, num_key_value_heads=1, head_dim=128, index_n_heads=4, index_head_dim=128,
    index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
)  # fmt: skip


class OneLayer(nn.Module):
    """The attention layer as a model: ``optimize`` routes the calls made inside a model's ``__call__``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        args = minimax_m3_vl.TextArgs(hidden_size=hidden, **GEOMETRY)
        self.attention = minimax_m3_vl.Attention(args, 0)

    def __call__(self, x: mx.array, mask: object, cache: list) -> mx.array:
        return self.attention(x, mask, cache)


def filled(context: int, dtype: mx.Dtype) -> list:
    """The layer's two caches holding ``context`` random rows."""
    kv, index = KVCache(), KVCache()
    step = 8192
    for start in range(0, context, step):
        n = min(step, context - start)
        keys, values, index_keys = (mx.random.normal((1, 1, n, 128)).astype(dtype) for _ in range(3))
        kv.update_and_fetch(keys, values)
        index.update_and_fetch(index_keys, mx.zeros((1, 1, n, 0), dtype))
        mx.eval(kv.keys, kv.values, index.keys)
    return [kv, index]


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
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    a = parser.parse_args()
    print(f"MiniMax-M3 sparse layer, {GEOMETRY}, hidden {a.hidden}, {mx.default_device()}, load {os.getloadavg()}")
    print("| dtype | context | rows | plain ms | optimize ms | paired ratio | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    mx.random.seed(0)
    for dtype_name in a.dtype:
        dtype = getattr(mx, dtype_name)
        model, routed = OneLayer(a.hidden), OneLayer(a.hidden)
        model.set_dtype(dtype)
        routed.update(model.parameters())  # the same weights
        mx.eval(model.parameters())
        opt = optimize(routed)
        models = {"plain": model, "optimize": routed}
        for context in a.contexts:
            cache = filled(context, dtype)
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
                print(f"| {dtype_name} | {context} | {rows} | {plain:.1f} | {optimized:.1f} | {paired:.2f}x | "
                      f"{diff.max():.2e} |", flush=True)  # fmt: skip
        print(f"routed {opt.routed}, declined {dict(opt.declined)}")
        opt.restore()
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
