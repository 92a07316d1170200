"""Benchmark (not a test): mlx-vlm Qwen4-Exp prompt prefill with and without ``attnpass.backends.mlx.optimize``.

Model: the random language model of ``qwen4_exp_decode.py`` (real attention
geometry: 24 query / 2 KV heads, head dim 256, indexer 4 x 128, budget 2048,
ratio 4; three Gated-DeltaNet layers then a QSA layer, per 4 ``--layers``).
For each prompt length one model call over the whole prompt from empty caches
(the prefill): the optimized model's first call compiles its program (timed
apart, "compile"), then ``--reps`` optimized calls, then ``--reps`` plain ones
(not interleaved: each call is long). The QSA prefill under ``optimize`` is qsa-gather's tiled
form (``prefill_tile`` rows per tile, attention over each row's ``W = 2051``
cells); plain mlx-vlm off Metal runs masked dense attention over the prompt.
Reported: prompt tokens/s of the whole call, and one QSA layer's attention
call alone at that length (the model's dispatch vs the routed program, given
the same queries, keys, values and selection).

    python benchmarks/qwen4_exp_prefill.py [--lengths 8192 32768] [--reps 1] [--layers 4] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen4_exp_decode import float32_moe, make_model

from attnpass.backends.mlx import optimize


def prefill(model, prompt) -> float:
    """Seconds of one model call over ``prompt`` from fresh caches (logits evaluated)."""
    cache = model.make_cache()
    start = time.perf_counter()
    mx.eval(model(prompt, cache=cache).logits)
    return time.perf_counter() - start


def qsa_layer_call(model, length: int, opt) -> tuple[float, float, float]:
    """(dispatch s, routed s, max |difference|) of the first QSA layer's attention call over ``length`` rows."""
    from mlx_vlm.models.qwen4_exp.qsa_kernel import dispatch_qsa_attention

    from attnpass.backends.mlx.lm import route_qsa

    layers = model.model.layers
    index = next(i for i, layer in enumerate(layers) if hasattr(getattr(layer, "self_attn", None), "indexer"))
    attention = layers[index].self_attn
    cache = model.make_cache()[index]
    x = mx.random.normal((1, length, model.args.hidden_size), key=mx.random.key(2)).astype(
        attention.q_proj.weight.dtype
    )
    with opt.active():
        selection = attention.indexer.select(x, cache, None)
        q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        queries, keys, values, _, _ = attention._prepare_projected_qkv(q, k, v, cache, None, None, None)
        mx.eval(queries, keys, values, selection.selected_blocks, selection.query_ends)
        options = {"cache": cache, "scale": attention.scale, "block_size": 4, "causal": True, "mask": None,
                   "mask_factory": lambda: attention.indexer.build_mask(selection)}  # fmt: skip
        args = (queries, keys, values, selection.selected_blocks, selection.query_ends)
        mx.eval(route_qsa(*args, **options))  # compile
        times = []
        for fn in (dispatch_qsa_attention, route_qsa):
            start = time.perf_counter()
            out = fn(*args, **options)
            mx.eval(out)
            times.append((time.perf_counter() - start, out))
    diff = float(mx.max(mx.abs(times[0][1].astype(mx.float32) - times[1][1].astype(mx.float32))).item())
    return times[0][0], times[1][0], diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-model", action="store_true", help="only the per-QSA-layer attention call")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    undo = float32_moe(dtype)
    model = make_model(args.layers, dtype)
    print(f"qwen4-exp prefill, {args.layers} layers, {args.dtype}, device {mx.default_device()}")
    print(
        "length | plain tok/s | optimized tok/s | ratio | compile s | QSA layer call: dispatch s / routed s (x) | max |diff|"
    )
    try:
        for length in args.lengths:
            prompt = mx.array(np.random.default_rng(0).integers(0, 512, (1, length)), dtype=mx.int32)
            plains, fasts, compile_s = [], [], float("nan")
            with optimize(model) as opt:
                d, r, diff = qsa_layer_call(model, length, opt)
                if not args.skip_model:
                    compile_s = prefill(model, prompt)
                    fasts = [prefill(model, prompt) for _ in range(args.reps)]
            plains = [prefill(model, prompt) for _ in range(0 if args.skip_model else args.reps)]
            plain = float(np.median(plains)) if plains else float("nan")
            fast = float(np.median(fasts)) if fasts else float("nan")
            print(
                f"{length} | {length / plain:.1f} | {length / fast:.1f} | {plain / fast:.2f}x | {compile_s:.1f} | "
                f"{d:.2f} / {r:.2f} ({d / r:.2f}x) | {diff:.2e}",
                flush=True,
            )
    finally:
        undo()


if __name__ == "__main__":
    main()
