"""Benchmark (not a test): mlx-vlm Qwen4-Exp decode tokens/s with and without ``attnpass.backends.mlx.optimize``.

Model: a random ``mlx_vlm.models.qwen4_exp.language.LanguageModel`` with the
real attention geometry (24 query / 2 KV heads, head dim 256; QSA indexer 4
heads x 128, budget 2048 tokens, ratio 4, so 512 blocks) and the config's
hybrid pattern (``full_attention_interval`` 4: three Gated-DeltaNet layers,
then a QSA layer) over ``--layers`` layers; everything else small (hidden 256,
2 experts, vocabulary 512). For each depth every QSA layer's ``QSAKVCache`` is
filled directly with random keys, values and raw indexer keys at positions
``0 .. depth-1`` (no prefill; the linear layers start from zero state; the
indexer pools the blocks once, in the untimed first step, then one block per 4
steps, as it does after a prefill). Decode: ``--tokens`` greedy single-token
model calls after one untimed step (and both models decode once at depth 64
before any timing: mlx-vlm's compiled helpers trace on first use). Plain and optimized models (same seed)
decode in turn from fresh caches in each of ``--reps`` repetitions, ``--bursts``
bursts of ``--tokens`` calls each in alternating order (``paired.py``); the
table gives the bursts' median tokens/s and spread, the ratio of the medians
and the median of the pairs' ratios (paired), then the per-QSA-layer breakdown of one
decode step at that depth (each part evaluated on its own): the indexer's
selection, the q/k/v projections with the cache update, and the attention
call (the model's dispatch, or the routed gather program).

bfloat16: MLX's CPU ``GatherMM`` (the MoE blocks) is float32-only, so with
``--dtype bfloat16`` the MoE blocks run in float32 between casts, in both
variants; every attention and cache is bfloat16.

Quantized: ``--kv-bits 8`` adds a column per bit width: at every depth the same
filled caches are converted as mlx-vlm converts them (``QSAKVCache.to_quantized``
with ``--kv-group-size``, default 64: ``QSAQuantizedKVCache``, K/V packed, the
indexer state float) and decoded plain and optimized in the same interleaved
repetitions, right after the float cache; the table has one row per depth and
cache.

Batched: ``--streams`` equal-length streams (default 3; 1 for none) at one
depth (``--batch-depth``, default 8192), each stream's caches filled as above
with its own random state and merged as mlx-vlm merges a batch (a
``BatchQSAKVCache`` per QSA layer), then decoded together: tokens/s of all
streams, plain and optimized, and the ratio beside the one-stream ratio at that
depth (when that depth is in ``--depths``).

    python benchmarks/qwen4_exp_decode.py [--depths 1024 8192 32768] [--long] [--tokens 8] [--reps 3] [--bursts 2]
        [--dtype float32 bfloat16] [--layers 4] [--kv-bits 8] [--kv-group-size 64] [--streams 3]
        [--batch-depth 8192] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import mlx.core as mx
from mlx_vlm.models.qwen4_exp import config as vlm_config
from mlx_vlm.models.qwen4_exp import language
from paired import floor_lines, medians_ratio, paired_bursts, paired_ratio

from attnpass.backends.mlx import optimize


def make_model(layers: int, dtype, *, seed: int = 0) -> language.LanguageModel:
    """The random language model described in the module docstring."""
    config = vlm_config.TextConfig(
        model_type="qwen4_exp", hidden_size=256, num_hidden_layers=layers, num_attention_heads=24,
        num_key_value_heads=2, head_dim=256, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=2,
        num_experts_per_tok=1, shared_expert_intermediate_size=256, moe_intermediate_size=256, rms_norm_eps=1e-6,
        vocab_size=512, max_position_embeddings=262144, indexer_n_heads=4, indexer_head_dim=128,
        indexer_budget=2048, indexer_compress_ratio=4, hc_lowrank=32,
    )  # fmt: skip
    full = vlm_config.ModelConfig(text_config=config, vision_config=vlm_config.VisionConfig(), model_type="qwen4_exp")
    mx.random.seed(seed)
    model = language.LanguageModel(config, full)
    if dtype != mx.float32:
        model.set_dtype(dtype)
        for layer in model.layers:
            layer.mlp.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def float32_moe(dtype) -> Callable[[], None]:
    """Run the MoE blocks in float32 between casts (CPU GatherMM); returns the undo."""
    block = language.Qwen4ExpSparseMoeBlock
    call = block.__call__
    if dtype == mx.float32:
        return lambda: None

    def moe(self, x):
        return call(self, x.astype(mx.float32)).astype(x.dtype)

    block.__call__ = moe
    return lambda: setattr(block, "__call__", call)


def snapshot(model, depth: int, dtype, *, seed: int = 1) -> list:
    """Per QSA layer: (keys, values, raw indexer keys, positions) for ``depth`` random tokens."""
    mx.random.seed(seed)
    states = []
    for layer in model.layers:
        if layer.is_linear:
            states.append(None)
            continue
        attn = layer.self_attn
        kv = (1, attn.num_key_value_heads, depth, attn.head_dim)
        positions = mx.arange(depth, dtype=mx.int32)[None]
        raw = mx.random.normal((1, depth, attn.indexer.head_dim)).astype(dtype)
        states.append((mx.random.normal(kv).astype(dtype), mx.random.normal(kv).astype(dtype), raw, positions))
    mx.eval([s for s in states if s is not None])
    return states


def filled_cache(model, states: list, bits: int | None = None, group_size: int = 64) -> list:
    """The model's own caches holding ``states`` (QSA layers) and zero linear state; positions continue at depth.

    With ``bits``, each QSA cache converted as mlx-vlm converts it: ``QSAQuantizedKVCache`` (K/V packed, the
    indexer state float)."""
    cache = model.make_cache()
    for c, state in zip(cache, states):
        if state is not None:
            c.state = state
    model._rope_deltas, model._position_ids = mx.zeros((1, 1), dtype=mx.int32), None
    if bits is None:
        return cache
    quantized = [
        c.to_quantized(group_size=group_size, bits=bits) if isinstance(c, language.QSAKVCache) else c for c in cache
    ]
    mx.eval([c.keys for c in quantized if isinstance(c, language.QSAQuantizedKVCache)])
    return quantized


def batched_cache(model, states: list[list]) -> list:
    """One stream per entry of ``states``, each filled as :func:`filled_cache`, merged as mlx-vlm merges a batch.

    The streams are equal-length (no left padding): each QSA layer's ``BatchQSAKVCache`` decodes with QSA calls
    (mlx-vlm's left-padded decode attends densely and makes none).
    """
    streams = [filled_cache(model, s) for s in states]
    model._rope_deltas = mx.zeros((len(states), 1), dtype=mx.int32)
    return [type(layer[0]).merge(list(layer)) for layer in zip(*streams)]


def decoder(model, cache: list, streams: int = 1) -> Callable[[], int]:
    """A function running one greedy single-token model call (evaluated) and returning the tokens it gave (one per
    stream), after one untimed step."""
    token = mx.full((streams, 1), 7, dtype=mx.int32)

    def step() -> int:
        nonlocal token
        token = mx.argmax(model(token, cache=cache).logits[:, -1:], axis=-1)
        mx.eval(token)
        return streams

    step()
    return step


def paired_rates(models: dict, caches: Callable[[Any], list], args: argparse.Namespace, rep: int, streams: int = 1):
    """Tokens/s of each model per burst of ``args.tokens`` steps from fresh caches (``caches(model)``), the two in
    turn (:func:`paired.paired_bursts`; each step is evaluated, nothing is left in flight)."""
    steps = {variant: decoder(model, caches(model), streams) for variant, model in models.items()}
    return paired_bursts(steps, args.tokens, args.bursts, rep, lambda: None)


def breakdown(
    model, opt, states: list, dtype, bits: int | None = None, group_size: int = 64, repeats: int = 5
) -> dict[str, dict[str, float]] | None:
    """Median ms of one QSA layer's decode step, part by part, plain and optimized (see the module docstring).

    None at depths within the budget, where the indexer selects nothing and the layer runs dense attention.
    """
    index = next(i for i, s in enumerate(states) if s is not None)
    attn = model.layers[index].self_attn
    x = mx.random.normal((1, 1, attn.q_proj.weight.shape[1])).astype(dtype)
    names = ("select", "qkv", "attention")
    times: dict[str, dict[str, list[float]]] = {v: {p: [] for p in names} for v in ("plain", "optimize")}
    for variant in ("plain", "optimize"):
        cache = filled_cache(model, states, bits, group_size)[index]
        if attn.indexer.select(x, cache, None) is None:  # pools every block once, as the first decode step does
            return None
        cache.index_keys = cache.index_keys[:, : cache.offset]  # ... and takes back the key it appended
        cache.index_position_ids = cache.index_position_ids[..., : cache.offset]
        blocks = (cache.index_block_keys, cache.index_block_ratio)
        mx.eval(blocks[0])
        for _ in range(repeats):
            with opt.active() if variant == "optimize" else nullcontext():
                start = time.perf_counter()
                selection = attn.indexer.select(x, cache, None)
                mx.eval(selection.selected_blocks)
                mid = time.perf_counter()
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
                queries, keys, values, _, _ = attn._prepare_projected_qkv(q, k, v, cache, None, None, None)
                mx.eval(queries, keys, values)
                late = time.perf_counter()
                out = language.dispatch_qsa_attention(
                    queries, keys, values, selection.selected_blocks, selection.query_ends, cache=cache,
                    scale=attn.scale, block_size=attn.indexer.compress_ratio, causal=True, mask=None,
                    mask_factory=lambda s=selection: attn.indexer.build_mask(s), allow_sparse_decode=True,
                )  # fmt: skip
                mx.eval(out)
                end = time.perf_counter()
            for part, seconds in (("select", mid - start), ("qkv", late - mid), ("attention", end - late)):
                times[variant][part].append(seconds * 1e3)
            cache.trim(1)
            cache.index_block_keys, cache.index_block_ratio = blocks
    return {v: {p: statistics.median(t) for p, t in parts.items()} for v, parts in times.items()}


def batched_rates(models: dict, dtype, args: argparse.Namespace) -> dict[str, list[float]]:
    """Tokens/s of ``args.streams`` equal-length streams at ``args.batch_depth``, plain and optimized, alternating."""
    states = [snapshot(models["plain"], args.batch_depth, dtype, seed=1 + s) for s in range(args.streams)]
    rates: dict[str, list[float]] = {"plain": [], "optimize": []}
    for rep in range(args.reps):
        caches = lambda model: batched_cache(model, states)  # noqa: E731
        for variant, burst in paired_rates(models, caches, args, rep, args.streams).items():
            rates[variant] += burst
    print(f"  {args.streams} streams at depth {args.batch_depth}: x{paired_ratio(rates):.2f}", flush=True)
    return rates


def kind_name(bits: int | None, dtype_name: str) -> str:
    """The cache column: the float dtype, or the bit width of a quantized cache."""
    return dtype_name if bits is None else f"{bits}-bit"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run(dtype_name: str, args: argparse.Namespace) -> None:
    dtype = getattr(mx, dtype_name)
    undo = float32_moe(dtype)
    try:
        models = {"plain": make_model(args.layers, dtype), "optimize": make_model(args.layers, dtype)}
        opt = optimize(models["optimize"])
        qsa = sum(not layer.is_linear for layer in models["plain"].layers)
        print(f"\n== {dtype_name}: mlx {mx.__version__}, device {mx.default_device()}, {args.layers} layers "
              f"({qsa} QSA), pipeline {opt.pipeline}")  # fmt: skip
        print(f"load average before: {load()}")
        for model in models.values():  # mlx-vlm's compiled helpers are traced on first use: not in a timed run
            decoder(model, filled_cache(model, snapshot(model, 64, dtype)))()
        rows = []
        kinds = [None, *args.kv_bits]  # the float cache, then each quantized one
        for depth in args.depths:
            states = snapshot(models["plain"], depth, dtype)
            for bits in kinds:
                rates: dict[str, list[float]] = {"plain": [], "optimize": []}
                for rep in range(args.reps):
                    caches = lambda model, s=states, b=bits: filled_cache(model, s, b, args.kv_group_size)  # noqa: E731
                    for variant, burst in paired_rates(models, caches, args, rep).items():
                        rates[variant] += burst
                parts = breakdown(models["optimize"], opt, states, dtype, bits, args.kv_group_size)
                rows.append((depth, kind_name(bits, dtype_name), rates, parts))
                plain, fast = (statistics.median(rates[v]) for v in rates)
                print(f"  depth {depth}, {kind_name(bits, dtype_name)} cache: plain {plain:.2f}, optimize {fast:.2f} "
                      f"tok/s: x{fast / plain:.2f} (paired x{paired_ratio(rates):.2f})", flush=True)  # fmt: skip
            del states
        batch = batched_rates(models, dtype, args) if args.streams > 1 else None
        print(f"load average after: {load()}\n")
        print(f"{'depth':>7} {'cache':>6} {'plain tok/s':>20} {'optimize tok/s':>20} {'ratio':>6} {'paired':>6}   "
              "QSA layer ms (plain / optimize)")  # fmt: skip
        print(f"{'':>7} {'':>6} {'median (min-max)':>20} {'median (min-max)':>20} {'':>6} {'':>6}   "
              "select, qkv+update, attention")  # fmt: skip
        for depth, kind, rates, parts in rows:
            cells = [f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" for r in rates.values()]
            split = "dense: within the budget, no QSA call"
            if parts is not None:
                split = ", ".join(f"{parts['plain'][p]:.1f} / {parts['optimize'][p]:.1f}" for p in parts["plain"])
            print(f"{depth:>7} {kind:>6} {cells[0]:>20} {cells[1]:>20} {medians_ratio(rates):>6.2f} "
                  f"{paired_ratio(rates):>6.2f}   {split}")  # fmt: skip
        if batch is not None:
            single = {depth: rates for depth, kind, rates, _ in rows if kind == dtype_name}.get(args.batch_depth)
            one = "" if single is None else f" (one stream: x{paired_ratio(single):.2f})"
            cells = [f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" for r in batch.values()]
            print(f"{args.streams} streams at depth {args.batch_depth}, tok/s of all streams: plain {cells[0]}, "
                  f"optimize {cells[1]}: x{paired_ratio(batch):.2f}{one}")  # fmt: skip
        measured = [r for *_, r, _ in rows] + ([batch] if batch is not None else [])
        print(f"\n{floor_lines([paired_ratio(r) for r in measured], [medians_ratio(r) for r in measured])}")
        print(f"\nrouted {opt.routed}, declined {dict(opt.declined)}, traces {opt.traces}")
        opt.restore()
    finally:
        undo()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--long", action="store_true", help="add depth 131072")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3, help="repetitions, each from fresh caches")
    parser.add_argument("--bursts", type=int, default=2, help="bursts of --tokens steps per model and repetition")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-bits", type=int, nargs="*", default=[], help="quantized cache columns (e.g. 8)")
    parser.add_argument("--kv-group-size", type=int, default=64)
    parser.add_argument("--streams", type=int, default=3, help="batched column: equal-length streams (1: none)")
    parser.add_argument("--batch-depth", type=int, default=8192, help="the batched column's one depth")
    parser.add_argument("--quick", action="store_true", help="depths 1024 and 8192, 2 tokens, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.depths, args.tokens, args.reps = [1024, 8192], 2, 1
    if args.long:
        args.depths = [*args.depths, 131072]
    for dtype_name in args.dtype:
        run(dtype_name, args)


if __name__ == "__main__":
    main()
