"""Benchmark (not a test): mlx-lm's speculative generation of MiniMax-M3 on a long cache, plain vs ``optimize``, paired.

The model is mlx-lm's own ``minimax_m3_vl.Model`` (the sweep's tiny configuration, its text configuration set to the
per-head geometry of ``benchmarks/sparse_layers.py``: 16 query heads over 1 KV head of 128, an indexer of 4 heads of
128, blocks of 128 keys, the top 16 with 1 forced local block), hidden ``--hidden``, ``--layers`` layers, every one
sparse, vocabulary 512. The draft is :func:`attnpass.models.tiny_lm` (llama, 2 layers, the same vocabulary). Each
repetition fills fresh caches of the model to ``T`` random rows (keys, values and index keys, through their own
``update_and_fetch``; the draft's cache starts empty), then ``mlx_lm.generate.speculative_generate_step`` makes
``--tokens`` tokens with ``--draft`` drafted per verify step (each verify step is a ``draft + 1``-row call of every
layer; greedy, so both sides accept the same drafts), plain and optimized in turn, the order alternating. The table
reports each side's median seconds, the median of the pairs' ratios and whether the tokens are identical. Plain
attends all ``T`` keys under the block mask in every layer; ``optimize`` gathers each row's 16 x 128 selected keys
(backends/mlx/selections.py), so the attention's work falls by ``T / 2048`` and the model's own indexer (``T`` index
keys per row, both sides) is what remains. ``--mode greedy`` times ``generate_step`` (one row per step) instead.

    python benchmarks/sparse_speculative.py [--contexts 8192 32768] [--dtype float32 bfloat16] [--tokens 12]
        [--draft 3] [--reps 3] [--layers 1] [--hidden 1024] [--mode speculative greedy]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from attnpass.backends.mlx import optimize
from attnpass.models import tiny_lm

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = dict(
    num_attention_heads=16, num_key_value_heads=1, head_dim=128, index_n_heads=4, index_head_dim=128,
    index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
)  # fmt: skip
VOCAB = 512


def model(layers: int, hidden: int, dtype: str) -> Any:
    """mlx-lm's MiniMax-M3 at :data:`GEOMETRY`, every layer sparse, in inference mode, weights seeded."""
    spec = importlib.util.spec_from_file_location("mlx_lm_sweep", ROOT / "examples" / "mlx_lm_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sweep  # its dataclasses look their module up
    spec.loader.exec_module(sweep)
    module = importlib.import_module("mlx_lm.models.minimax_m3_vl")
    args = sweep.tiny_args("minimax_m3_vl", module)
    text = args["text_config"]
    text.update(GEOMETRY, hidden_size=hidden, num_hidden_layers=layers, vocab_size=VOCAB)
    for key in ("layer_types", "mlp_layer_types", "moe_layer_freq", "sparse_attention_freq"):
        if isinstance(text.get(key), list):
            text[key] = (text[key] * layers)[:layers]
    text["sparse_attention_freq"] = [1] * layers
    mx.random.seed(0)
    built = module.Model(module.ModelArgs.from_dict(args))
    built.set_dtype(getattr(mx, dtype))
    built.eval()
    mx.eval(built.parameters())
    assert all(layer.self_attn.is_sparse_attn for layer in built.layers), "a layer is not sparse"
    return built


def filled(built: Any, draft: Any, context: int, dtype: str) -> list:
    """The model's caches holding ``context`` random rows (seeded: every repetition the same), the draft's empty."""
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(context)
    caches = make_prompt_cache(built)
    for cache in caches:
        keys, index = cache[0], cache[1]
        for start in range(0, context, 8192):
            n = min(8192, context - start)
            k, v, i = (mx.random.normal((1, 1, n, 128)).astype(getattr(mx, dtype)) for _ in range(3))
            keys.update_and_fetch(k, v)
            index.update_and_fetch(i, mx.zeros((1, 1, n, 0), i.dtype))
        mx.eval(keys.keys, keys.values, index.keys)
    return caches + make_prompt_cache(draft)


def generate(built: Any, draft: Any, cache: list, args: argparse.Namespace) -> tuple[float, list[int]]:
    """Seconds to make ``args.tokens`` tokens on ``cache``, and the tokens."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    prompt = mx.array([3, 17])
    start = time.perf_counter()
    if args.mode == "speculative":
        steps = speculative_generate_step(
            prompt, built, draft, num_draft_tokens=args.draft, max_tokens=args.tokens, prompt_cache=cache
        )
        tokens = [int(t) for t, _, _ in steps]
    else:
        main = cache[: len(built.layers)]
        tokens = [int(t) for t, _ in generate_step(prompt, built, max_tokens=args.tokens, prompt_cache=main)]
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--draft", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--mode", default="speculative", choices=["speculative", "greedy"])
    args = parser.parse_args(argv)
    print(f"mlx {mx.__version__}; MiniMax-M3, {args.layers} sparse layer(s), {args.mode}, {args.tokens} tokens"
          f"{f', {args.draft} drafted per step' if args.mode == 'speculative' else ''}; "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| dtype | context | plain s | optimize s | paired ratio | tokens | routed / declined |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        plain, routed = model(args.layers, args.hidden, dtype), model(args.layers, args.hidden, dtype)
        draft = tiny_lm("llama", dtype=dtype)
        opt = optimize(routed)
        models = {"plain": plain, "optimize": routed}
        for context in args.contexts:
            times: dict[str, list[float]] = {"plain": [], "optimize": []}
            tokens: dict[str, list[int]] = {}
            for rep in range(args.reps + 1):  # the first pair warms up (and traces), untimed
                for name in ("plain", "optimize") if rep % 2 == 0 else ("optimize", "plain"):
                    seconds, tokens[name] = generate(models[name], draft, filled(plain, draft, context, dtype), args)
                    if rep:
                        times[name].append(seconds)
            ratio = statistics.median(p / o for p, o in zip(times["plain"], times["optimize"]))
            same = "identical" if tokens["plain"] == tokens["optimize"] else "DIFFERENT"
            counts = f"{opt.routed} / {dict(opt.declined) or 0}"
            print(f"| {dtype} | {context} | {statistics.median(times['plain']):.2f} | "
                  f"{statistics.median(times['optimize']):.2f} | {ratio:.2f}x | {same} | {counts} |", flush=True)  # fmt: skip
        opt.restore()
    print(f"load after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
