"""Benchmark (not a test): mlx-lm decode tokens/s with and without ``attnpass.backends.mlx.optimize``.

Model: :func:`attnpass.models.tiny_lm` (llama, 24 query / 2 KV heads, head dim
128, GQA 12, 2 layers, hidden 256), on the default MLX device, in each
``--dtype``. For each context the KV cache is filled with random keys and
values through mlx-lm's own ``KVCache.update_and_fetch`` (the prefill is
excluded) and, for each ``--kv-bits`` width other than 0, quantized by mlx-lm's
``to_quantized`` (group size 64: the ``QuantizedKVCache`` that ``kv_bits`` with
``quantized_kv_start=0`` decodes on), then ``mlx_lm.generate.generate_step``
decodes greedily. ``--batched`` adds a row per context for
batched generation: a ``BatchKVCache`` of 3 streams left-padded by 0, 5 and 11
rows, decoded by mlx-lm's ``GenerationBatch.next`` (``batch_generate``'s decode
step; tokens/s counts every stream's tokens). The first token (which pays any
trace) is not timed. Each of ``--reps`` repetitions fills fresh caches for the
plain and the optimized model, which then decode in turn, ``--bursts`` bursts of
``--tokens`` steps each, the order alternating: a pair of bursts covers the same
positions moments apart, under the same load. The table reports the medians of
the bursts' tokens/s, their ratio, the median of the pairs' ratios (paired)
and the spread (min-max) of each, then the breakdown: one layer's decode
attention call at that context, mlx-lm's helper over the valid keys vs the
routed attnpass program (for a declined signature: the helper behind the
router's checks, which is then all the column measures), and the minimum of each ratio over all rows against the
0.95 floor (issue 21: never below 0.95x plain). ``--min-keys 0`` routes every
depth (optimize's ``min_keys``; by default a short context keeps mlx-lm's helper
on CPU, ``SHORT_CONTEXT``): with ``--tokens 1 --reps 1 --bursts 1 --call-reps 41`` the
breakdown alone measures the per-call costs behind ``MIN_KEYS``. The two models have the same
weights (same seed); one ``optimize`` handle per dtype serves the whole run,
so the trace counts are its totals after each row (the breakdown's calls
count as routed). The load average is printed before and after: on a busy
machine compare ratios, not absolute rates. ``--control`` leaves the second
model plain as well (nothing optimized, same code on both sides): its ratios
measure the method's noise at the same settings.

    python benchmarks/mlx_lm_decode.py [--contexts 1024 8192 32768] [--tokens 16] [--reps 5] [--bursts 4]
        [--dtype bfloat16 float32] [--kv-bits 0 4 8] [--batched] [--pipeline TEXT] [--quick]
        [--min-keys N] [--call-reps 7] [--control]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, generate_step, generation_stream
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

# the module (``mlx_lm.generate``, the package's attribute, is its function of that name)
mlx_lm_generate = importlib.import_module("mlx_lm.generate")
from mlx_lm.sample_utils import make_sampler
from paired import floor_lines, medians_ratio, paired_bursts, paired_ratio

from attnpass.backends.mlx import optimize
from attnpass.backends.mlx.clients import MLX_LM_HELPER
from attnpass.models import tiny_lm

BATCH = "batch"  # the --batched rows' cache kind
PADDING = [0, 5, 11]  # the batched rows' streams: left padding of each


def filled_cache(model, context: int, dtype, kind: int | str = 0) -> list:
    """mlx-lm's prompt cache for ``model`` holding ``context`` random tokens in every layer: quantized to ``kind``
    bits (group size 64) unless 0; a ``BatchKVCache`` of ``len(PADDING)`` left-padded streams for :data:`BATCH`."""
    batch = kind == BATCH
    cache = [BatchKVCache(PADDING) for _ in model.layers] if batch else make_prompt_cache(model)
    for layer, c in zip(model.layers, cache):
        attn = layer.self_attn
        shape = (len(PADDING) if batch else 1, attn.n_kv_heads, context, attn.head_dim)
        c.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
    if kind and not batch:
        cache = [c.to_quantized(group_size=64, bits=kind) for c in cache]
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    return cache


def decoder(model, cache: list, tokens: int) -> Callable[[], int]:
    """A function running one decode step of ``model`` on ``cache`` and returning the tokens it gave, after the
    first step (which pays any trace) has run: ``generate_step``, or for a ``BatchKVCache`` ``GenerationBatch.next``
    (a token of every stream). At most ``tokens`` steps."""
    if isinstance(cache[0], BatchKVCache):
        streams = len(PADDING)
        if "stop_sequences" in inspect.signature(GenerationBatch).parameters:  # mlx-lm 0.32: no stop sequence
            stops = {"stop_sequences": [mlx_lm_generate.StopSequences()] * streams}
        else:  # mlx-lm 0.31: a state machine of no stop per stream
            stops = {"state_machines": [mlx_lm_generate.SequenceStateMachine({}, initial="normal")] * streams}
        batch = GenerationBatch(  # its constructor runs the first step
            model=model, uids=list(range(streams)), inputs=mx.array([7] * streams), prompt_cache=cache,
            tokens=[[] for _ in range(streams)], samplers=None, fallback_sampler=make_sampler(0.0),
            logits_processors=[[] for _ in range(streams)], max_tokens=[tokens + 2] * streams, **stops,
        )  # fmt: skip
        return lambda: len(batch.next())
    steps = generate_step(mx.array([7]), model, prompt_cache=cache, max_tokens=tokens + 1)
    next(steps)

    def one() -> int:
        next(steps)
        return 1

    return one


def paired_rates(models: dict, context: int, dtype, kind: int | str, tokens: int, bursts: int, rep: int) -> dict:
    """Tokens/s of each model per burst of ``tokens`` decode steps from fresh caches of ``context`` tokens, the two
    in turn (:func:`paired.paired_bursts`); after each burst the generation stream is synchronized, untimed (the
    step a burst leaves in flight is no other burst's)."""
    steps = {v: decoder(m, filled_cache(m, context, dtype, kind), tokens * bursts) for v, m in models.items()}
    return paired_bursts(steps, tokens, bursts, rep, lambda: mx.synchronize(generation_stream))


def attention_ms(model, opt, context: int, dtype, kind: int | str = 0, repeats: int = 7) -> dict[str, float]:
    """Median ms of one decode-step attention call at ``context`` + 1 keys: mlx-lm's helper, the routed program."""
    attn = model.layers[0].self_attn
    cache = filled_cache(model, context, dtype, kind)[0]
    streams = len(PADDING) if kind == BATCH else 1
    row = (streams, attn.n_kv_heads, 1, attn.head_dim)
    q = mx.random.normal((streams, attn.n_heads, 1, attn.head_dim)).astype(dtype)
    calls = {
        "plain": lambda: base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=attn.scale, mask=mask),
        "optimize": lambda: opt.attend(MLX_LM_HELPER, q, keys, values, cache, attn.scale, mask),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    with opt.active():  # as in a model call: the router substitutes the buffer only for k/v it saw the cache return
        mask = cache.make_mask(1) if kind == BATCH else None  # the model makes it before the fetch
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
    parser.add_argument("--reps", type=int, default=5, help="repetitions, each from fresh caches")
    parser.add_argument("--bursts", type=int, default=4, help="bursts of --tokens steps per model and repetition")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--kv-bits", type=int, nargs="+", default=[0], choices=[0, 4, 8], help="cache widths (0: unquantized)"
    )
    parser.add_argument("--batched", action="store_true", help=f"add a {len(PADDING)}-stream BatchKVCache row")
    parser.add_argument("--pipeline", default=None, help="attnpass pipeline text (default: the device's)")
    parser.add_argument("--min-keys", type=int, default=None, help="optimize's min_keys (default: MIN_KEYS on CPU)")
    parser.add_argument("--call-reps", type=int, default=7, help="repetitions of the per-call breakdown")
    parser.add_argument(
        "--control", action="store_true", help="leave the second model plain too: the ratios' noise, nothing routed"
    )
    parser.add_argument("--quick", action="store_true", help="contexts 256 and 1024, 1 repetition of 2 bursts of 4")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.tokens, args.reps, args.bursts = [256, 1024], 4, 1, 2
    kinds = [*args.kv_bits, *([BATCH] if args.batched else [])]
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    print(f"load average before: {load()}")
    rows, handles = [], []
    for name in args.dtype:
        dtype = getattr(mx, name)
        models = {"plain": tiny_lm("llama", dtype=name), "optimize": tiny_lm("llama", dtype=name)}
        opt = None if args.control else optimize(models["optimize"], args.pipeline, min_keys=args.min_keys)
        if opt is not None:  # same seed, same weights: only the attention route differs
            handles.append((name, opt))
        for kind in kinds:
            for context in args.contexts:
                rates: dict[str, list[float]] = {"plain": [], "optimize": []}
                for rep in range(args.reps):
                    for variant, burst in paired_rates(
                        models, context, dtype, kind, args.tokens, args.bursts, rep
                    ).items():
                        rates[variant] += burst
                if opt is None:  # the control: no route to time
                    ms, traces = {"plain": float("nan"), "optimize": float("nan")}, 0
                else:
                    ms, traces = attention_ms(models["optimize"], opt, context, dtype, kind, args.call_reps), opt.traces
                rows.append((name, kind, context, rates, ms, traces))
                plain, fast = (statistics.median(rates[v]) for v in rates)
                print(
                    f"  {name} {cache_name(kind)} context {context}: plain {plain:.2f}, optimize {fast:.2f} tok/s: "
                    f"x{fast / plain:.2f} (paired x{paired_ratio(rates):.2f})",
                    flush=True,
                )
    print(f"load average after: {load()}\n")
    head = f"{'dtype':>8} {'cache':>7} {'context':>8} {'plain tok/s':>20} {'optimize tok/s':>20} {'ratio':>6}"
    print(f"{head} {'paired':>6} {'attention ms':>17} {'traces':>7}")
    blank = f"{'':>8} {'':>7} {'':>8}"
    print(f"{blank} {'median (min-max)':>20} {'median (min-max)':>20} {'':>6} {'':>6} {'plain  optimize':>17}")
    ratios, paired = [], []
    for name, kind, context, rates, ms, traces in rows:
        ratios.append(medians_ratio(rates))
        paired.append(paired_ratio(rates))
        cells = [f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" for r in rates.values()]
        attention = f"{ms['plain']:.2f} {ms['optimize']:>9.2f}"
        line = f"{name:>8} {cache_name(kind):>7} {context:>8} {cells[0]:>20} {cells[1]:>20} {ratios[-1]:>6.2f}"
        print(f"{line} {paired[-1]:>6.2f} {attention:>17} {traces:>7}")
    print(f"\n{floor_lines(paired, ratios)}\n")
    for name, opt in handles:
        print(f"{name}: pipeline {opt.pipeline}")
        opt.explain()


def cache_name(kind: int | str) -> str:
    """A row's cache: ``-`` (KVCache), ``kv4``/``kv8`` (QuantizedKVCache), ``batch`` (BatchKVCache)."""
    return kind if kind == BATCH else f"kv{kind}" if kind else "-"


if __name__ == "__main__":
    main()
