"""Benchmark (not a test): mlx-lm decode tokens/s with and without ``attnpass.backends.mlx.optimize``.

Model: :func:`attnpass.models.tiny_lm` (llama, 24 query / 2 KV heads, head dim
128, GQA 12, 2 layers, hidden 256), on the default MLX device. For each
context the KV cache is filled with random keys and values through mlx-lm's
own ``KVCache.update_and_fetch`` (the prefill is excluded) and, for each
``--kv-bits`` width other than 0, quantized by mlx-lm's ``to_quantized``
(group size 64: the ``QuantizedKVCache`` that ``kv_bits`` with
``quantized_kv_start=0`` decodes on), then
``mlx_lm.generate.generate_step`` decodes ``--tokens`` tokens greedily; the
first token (which pays any trace) is not timed. The plain and the optimized
model alternate within every repetition (in alternating order) and the table
reports medians, their ratio and the spread (min-max) of each, then the
breakdown: one layer's decode attention call at that context, mlx-lm's
helper over the valid keys vs the routed attnpass program over the cache
buffer. The two models have the same weights (same seed); one ``optimize``
handle serves the whole run, so the trace counts are its totals after each
context (the breakdown's calls count as routed). The load average is printed
before and after: on a busy machine compare ratios, not absolute rates.

    python benchmarks/mlx_lm_decode.py [--contexts 1024 8192 32768] [--tokens 16] [--reps 5]
        [--dtype bfloat16] [--kv-bits 0 4 8] [--pipeline TEXT] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

from attnpass.backends.mlx import optimize
from attnpass.models import tiny_lm


def filled_cache(model, context: int, dtype, bits: int = 0) -> list:
    """mlx-lm's prompt cache for ``model`` holding ``context`` random tokens in every layer, quantized to
    ``bits`` (group size 64) unless 0."""
    cache = make_prompt_cache(model)
    for layer, c in zip(model.layers, cache):
        attn = layer.self_attn
        shape = (1, attn.n_kv_heads, context, attn.head_dim)
        c.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
    if bits:
        cache = [c.to_quantized(group_size=64, bits=bits) for c in cache]
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    return cache


def decode_rate(model, cache: list, tokens: int) -> float:
    """Tokens/s of ``generate_step`` over ``tokens`` decode steps after the first."""
    steps = generate_step(mx.array([7]), model, prompt_cache=cache, max_tokens=tokens + 1)
    next(steps)
    start = time.perf_counter()
    count = sum(1 for _ in steps)
    return count / (time.perf_counter() - start)


def attention_ms(model, opt, context: int, dtype, bits: int = 0, repeats: int = 7) -> dict[str, float]:
    """Median ms of one decode-step attention call at ``context`` + 1 keys: mlx-lm's helper, the routed program."""
    attn = model.layers[0].self_attn
    cache = filled_cache(model, context, dtype, bits)[0]
    row = (1, attn.n_kv_heads, 1, attn.head_dim)
    q = mx.random.normal((1, attn.n_heads, 1, attn.head_dim)).astype(dtype)
    calls = {
        "plain": lambda: base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=attn.scale, mask=None),
        "optimize": lambda: opt.attend(q, keys, values, cache, attn.scale, None, None),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    with opt.active():  # as in a model call: the router substitutes the buffer only for k/v it saw the cache return
        keys, values = cache.update_and_fetch(mx.random.normal(row).astype(dtype), mx.random.normal(row).astype(dtype))
        for rep in range(repeats):
            for name in ("plain", "optimize") if rep % 2 == 0 else ("optimize", "plain"):
                call = calls[name]
                mx.eval(call())
                start = time.perf_counter()
                mx.eval(call())
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--kv-bits", type=int, nargs="+", default=[0], choices=[0, 4, 8], help="cache widths (0: unquantized)"
    )
    parser.add_argument("--pipeline", default=None, help="attnpass pipeline text (default: the device's)")
    parser.add_argument("--quick", action="store_true", help="contexts 256 and 1024, 4 tokens, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.tokens, args.reps = [256, 1024], 4, 1
    dtype = getattr(mx, args.dtype)
    models = {"plain": tiny_lm("llama", dtype=args.dtype), "optimize": tiny_lm("llama", dtype=args.dtype)}
    opt = optimize(models["optimize"], args.pipeline)  # same seed, same weights: only the attention route differs
    print(f"mlx {mx.__version__}, device {mx.default_device()}, {args.dtype}, pipeline {opt.compiled.pipeline}")
    print(f"load average before: {load()}")
    rows = []
    for bits in args.kv_bits:
        for context in args.contexts:
            rates: dict[str, list[float]] = {"plain": [], "optimize": []}
            for rep in range(args.reps):
                for variant in ("plain", "optimize") if rep % 2 == 0 else ("optimize", "plain"):
                    cache = filled_cache(models[variant], context, dtype, bits)
                    rates[variant].append(decode_rate(models[variant], cache, args.tokens))
            ms = attention_ms(models["optimize"], opt, context, dtype, bits)
            rows.append((bits, context, rates, ms, opt.traces))
            plain, fast = (statistics.median(rates[v]) for v in rates)
            print(
                f"  kv {bits or '-'} context {context}: plain {plain:.2f}, optimize {fast:.2f} tok/s: "
                f"x{fast / plain:.2f}",
                flush=True,
            )
    print(f"load average after: {load()}\n")
    head = f"{'kv bits':>7} {'context':>8} {'plain tok/s':>20} {'optimize tok/s':>20} {'ratio':>6}"
    print(f"{head} {'attention ms':>17} {'traces':>7}")
    print(f"{'':>7} {'':>8} {'median (min-max)':>20} {'median (min-max)':>20} {'':>6} {'plain  optimize':>17}")
    for bits, context, rates, ms, traces in rows:
        plain, fast = (statistics.median(rates[v]) for v in rates)
        cells = [f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" for r in rates.values()]
        attention = f"{ms['plain']:.1f} {ms['optimize']:>9.1f}"
        line = f"{bits or '-':>7} {context:>8} {cells[0]:>20} {cells[1]:>20} {fast / plain:>6.2f}"
        print(f"{line} {attention:>17} {traces:>7}")
    print()
    opt.explain()


if __name__ == "__main__":
    main()
