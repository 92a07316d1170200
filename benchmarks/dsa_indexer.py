"""Benchmark (not a test): where a DSA indexer call's time goes on MLX's CPU, and what an exact fused form saves.

Issue 31 item 4 asks whether the indexer's selection can be computed with less work and the same selected set,
ties included. The selection is ``argpartition`` of the scores, so "the same set" needs the scores bit for bit.
This times, for ``--rows`` query rows over ``--context`` keys (DeepSeek-V3.2's indexer: 64 heads of dim 128,
top 2,048, float32, random q, keys and head weights):

- ``model``: the op sequence of mlx-lm's ``deepseek_v32.Indexer`` for more than one row (one batched
  ``q @ k^T`` into ``[64, L, T]``, ``maximum(., 0)``, times the head weights, the 64 head slices summed one by
  one, then ``argpartition`` and the last 2,048);
- ``tiled``: the same ops per head and per tile of ``--tile`` keys, each tile evaluated before the next, so no
  ``[64, L, T]`` array exists (the fused form item 4 names), with whether its scores and its top-k are the
  model form's bit for bit;
- ``matmul``: the batched ``q @ k^T`` alone, every exact form's floor, and numpy's matmul of the same shape
  (the CPU's BLAS: what this CPU can do).

    python benchmarks/dsa_indexer.py [--rows 256] [--context 32768] [--tile 4096] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

HEADS, DIM, TOPK = 64, 128, 2048


def model_scores(q: mx.array, k: mx.array, w: mx.array) -> mx.array:
    """``[1, 1, L, T]``: mlx-lm's multi-row op order (batched matmul, relu, weights, heads summed in order)."""
    scores = mx.maximum(q @ k.swapaxes(-1, -2), 0) * w
    return sum(scores[:, h : h + 1] for h in range(HEADS))


def tiled_scores(q: mx.array, k: mx.array, w: mx.array, tile: int) -> mx.array:
    """The same ops per head and per key tile, each tile evaluated before the next: no ``[64, L, T]`` array."""
    tiles = []
    for start in range(0, k.shape[2], tile):
        keys = k[:, :, start : start + tile].swapaxes(-1, -2)
        total = 0
        for h in range(HEADS):
            total = total + mx.maximum(q[:, h : h + 1] @ keys, 0) * w[:, h : h + 1]
        mx.eval(total)
        tiles.append(total)
    return mx.concatenate(tiles, axis=-1)


def top_k(scores: mx.array) -> mx.array:
    return mx.argpartition(scores, kth=-TOPK, axis=-1)[..., -TOPK:]


def best_seconds(run: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` runs of ``run`` (which evaluates what it computes)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--tile", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    rows, keys = args.rows, args.context
    mx.random.seed(0)
    q, k = mx.random.normal((1, HEADS, rows, DIM)), mx.random.normal((1, 1, keys, DIM))
    w = mx.random.normal((1, HEADS, rows, 1)) * DIM**-0.5
    mx.eval(q, k, w)
    print(f"DSA indexer, {HEADS} heads x {DIM}, top {TOPK}, float32, {rows} rows over {keys} keys, MLX "
          f"{mx.__version__} on {mx.default_device()}, load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
    model = model_scores(q, k, w)
    tiled = tiled_scores(q, k, w, args.tile)
    mx.eval(model, tiled)
    same_scores = np.array_equal(np.array(model).view(np.uint32), np.array(tiled).view(np.uint32))
    same_set = np.array_equal(np.array(top_k(model)), np.array(top_k(tiled)))
    seconds = {
        "model": best_seconds(lambda: mx.eval(top_k(model_scores(q, k, w))), args.reps),
        "tiled": best_seconds(lambda: mx.eval(top_k(tiled_scores(q, k, w, args.tile))), args.reps),
        "matmul": best_seconds(lambda: mx.eval(q @ k.swapaxes(-1, -2)), args.reps),
    }
    qn, kn = np.array(q).reshape(HEADS * rows, DIM), np.array(k).reshape(keys, DIM)
    numpy_matmul = best_seconds(lambda: qn @ kn.T, args.reps)
    flops = 2 * HEADS * rows * keys * DIM
    for name, s in seconds.items():
        print(f"  {name:7} {s:8.2f} s  ({s / seconds['model']:4.0%} of the model form, {flops / s / 1e9:5.1f} GFLOP/s)")
    print(
        f"  numpy   {numpy_matmul:8.2f} s  (the same matmul with the CPU's BLAS: {flops / numpy_matmul / 1e9:.1f} GFLOP/s)"
    )
    print(f"tiled scores bit for bit the model form's: {same_scores}; top-{TOPK} identical: {same_set}")
    print(f"at most saved by any exact form that keeps MLX's matmul: {1 - seconds['matmul'] / seconds['model']:.0%}")


if __name__ == "__main__":
    main()
