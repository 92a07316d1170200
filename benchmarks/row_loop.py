"""Benchmark (not a test): GLM-5-Next's 2-8-row attention, mlx-vlm's own one-row loop vs one batched call, paired.

mlx-vlm's ``Glm5NextAttention._attend`` (inference mode) runs a call of ``2 <= L <= 8`` rows (a speculative verify
step) as ``L`` one-row calls: each row gathers its top-k latent cells (``take_along_axis``), embeds its query into
the latent space (``embed_q``), calls mlx-vlm's attention helper over those cells and un-embeds the output. Each of
those calls is already a gather in the latent form, so ``optimize`` declines them by code (``mla_absorbed``: one query
row the model attends in the latent form itself), and the router, which sees one helper call at a time, has no batch
to form. What batching the rows could still gain is measured here: the same arrays through one batched call (all
rows' cells gathered at once, rows folded into the batch, one ``embed_q``, one attention, one ``unembed_out``: the
same function, compared bit for bit) against the model's own ``_attend``, at GLM-5-Next's per-head geometry (latent
512, query/key 256 and value 256 per head, top 2,048 cells) with ``--heads`` heads (64 in the model; 16 by default so
CPU runs fit). The physical bound: both read the same ``L x 2,048`` cells and do the same FLOPs; batching saves only
the per-call dispatch and the ``L - 1`` extra passes over the weights of ``embed_q`` and ``unembed_out``.

    python benchmarks/row_loop.py [--contexts 8192 32768] [--rows 4] [--heads 16] [--reps 7] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import mlx.core as mx


def attention(heads: int) -> Any:
    """mlx-vlm's ``Glm5NextAttention`` at GLM-5-Next's per-head geometry with ``heads`` heads, random weights, in
    inference mode (its loop runs only there), float32."""
    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import Glm5NextAttention

    config = TextConfig(num_attention_heads=heads, num_key_value_heads=heads, hidden_size=1024, num_hidden_layers=1)
    mx.random.seed(0)
    layer = Glm5NextAttention(config, 0)
    layer.eval()
    mx.eval(layer.parameters())
    return layer


def batched(layer: Any, q: Any, latent: Any, topk: Any) -> Any:
    """``layer._attend``'s function for ``q`` ``[B, H, L, Dq]`` over the cells ``topk`` ``[B, L, K]`` of ``latent``
    ``[B, 1, T, R]`` as one call: every row's cells gathered at once, the rows folded into the batch; ``[B, L, H * Dv]``
    as ``_attend`` returns it."""
    from mlx_vlm.models.base import scaled_dot_product_attention

    b, h, rows, _ = q.shape
    k = topk.shape[-1]
    valid = (topk >= 0) & (topk < latent.shape[2])
    safe = mx.clip(topk, 0, max(latent.shape[2] - 1, 0))
    cells = mx.take_along_axis(latent, safe[:, None, :, :, None].reshape(b, 1, rows * k, 1), axis=2)
    cells = cells.reshape(b, rows, k, -1).reshape(b * rows, 1, k, -1)
    query = layer.embed_q(q).transpose(0, 2, 1, 3).reshape(b * rows, h, 1, -1)
    mask = valid.reshape(b * rows, 1, 1, k)
    out = scaled_dot_product_attention(query, cells, cells, cache=None, scale=layer.scale, mask=mask)
    return layer.unembed_out(out).reshape(b, rows, -1)  # [B, L, H * Dv], as ``_attend`` returns it


def case(layer: Any, context: int, rows: int, dtype: Any) -> tuple[Any, ...]:
    """Random queries ``[1, H, rows, Dq]``, a latent of ``context`` rows and each row's 2,048 distinct cells."""
    mx.random.seed(context + rows)
    q = mx.random.normal((1, layer.num_heads, rows, layer.q_head_dim)).astype(dtype)
    latent = mx.random.normal((1, 1, context, layer.kv_lora_rank)).astype(dtype)
    keep = min(2048, context)
    topk = mx.stack([mx.random.permutation(context)[:keep] for _ in range(rows)])[None].astype(mx.int32)
    mx.eval(q, latent, topk)
    return q, latent, topk


def timed(fn: Any) -> float:
    """Seconds of one evaluated call."""
    start = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--rows", type=int, nargs="+", default=[4])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    from mlx_lm.models.cache import KVCache

    layer = attention(args.heads)
    print(f"mlx {mx.__version__}; GLM-5-Next attention, {args.heads} heads; load {os.getloadavg()[0]:.1f}")
    print(" dtype     context rows  loop ms  batched ms  paired ratio  bits")
    for name in args.dtype:
        for context in args.contexts:
            for rows in args.rows:
                q, latent, topk = case(layer, context, rows, getattr(mx, name))
                calls = {
                    "loop": lambda: layer._attend(q, latent, latent[:, :, -rows:], topk, KVCache(), None)[0],
                    "batched": lambda: batched(layer, q, latent, topk),
                }
                loop, one = (f() for f in calls.values())
                bits = mx.uint32 if name == "float32" else mx.uint16
                same = bool(mx.array_equal(loop.view(bits), one.view(bits)).item())
                times: dict[str, list[float]] = {k: [] for k in calls}
                for rep in range(args.reps):
                    for k in calls if rep % 2 == 0 else reversed(list(calls)):
                        times[k].append(timed(calls[k]))
                ratio = statistics.median(a / b for a, b in zip(times["loop"], times["batched"]))
                loop_ms, one_ms = (statistics.median(times[k]) * 1e3 for k in calls)
                print(f"{name:>8} {context:>9} {rows:>4} {loop_ms:>8.1f} {one_ms:>11.1f} {ratio:>13.2f}  "
                      f"{'bit for bit' if same else 'DIFFERENT'}")  # fmt: skip
    print(f"load after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
