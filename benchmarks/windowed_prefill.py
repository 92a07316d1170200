"""Benchmark (not a test): prefill of a sliding-window mlx-lm model, ``optimize`` vs plain mlx-lm's chunked prefill.

Model: the zoo's ``gemma3_text`` (examples/model_zoo.py's configuration, float32) with a sliding window of
``--window`` (512), 4 layers, every 4th global (layers 0-2 slide over a ``RotatingKVCache``, layer 3 attends
everything over a ``KVCache``), 8 query / 4 KV heads of dim 64. A prompt of each ``--lengths`` tokens is
prefilled by ``mlx_lm.generate.generate_step`` up to its first token, side by side in one run:

- ``plain``: mlx-lm as it is, with its own chunked prefill (``prefill_step_size``, ``--plain-step`` 2048: each
  step trims the rotating cache to the window, and the helper gets a dense bool mask of the window);
- ``optimize``: the same model under ``optimize(model)`` (the CPU default pipeline: ``block-sparse`` tiles
  each step of more than 512 rows; the sliding layers' window is the ``sdpa``'s attribute) with
  ``prefill_step_size`` ``--optimize-step`` (by default plain's; larger steps pay under ``optimize``, since the
  tiles visit only what the window and causality show; 8192 x 16384 is the largest mask raise-attention proves,
  its EVAL_LIMIT).

``optimize`` first runs once cold (building its signatures, printed), then ``--rounds`` times alternately with
plain. The table gives the median seconds to the first token, the ratio plain / optimize, and whether the first
``--tokens`` greedy tokens are identical (the machine is shared: compare ratios, not absolute times).

    python benchmarks/windowed_prefill.py [--lengths 1024 16384] [--window 512] [--plain-step 2048]
        [--optimize-step STEP] [--tokens 4] [--rounds 1] [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from attnpass.backends.mlx import optimize

ZOO = Path(__file__).resolve().parent.parent / "examples" / "model_zoo.py"


def model(window: int) -> Any:
    """The zoo's gemma3_text, float32, with the benchmark's window, layers and heads (same seed, same weights)."""
    zoo = runpy.run_path(str(ZOO), run_name="model_zoo")
    module = importlib.import_module("mlx_lm.models.gemma3_text")
    args = zoo["zoo_args"]("gemma3_text", module)
    args.update(sliding_window=window, sliding_window_pattern=4, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, hidden_size=256, intermediate_size=512)  # fmt: skip
    mx.random.seed(0)
    built = module.Model(module.ModelArgs(model_type="gemma3_text", **args))
    built.set_dtype(mx.float32)
    mx.eval(built.parameters())
    return built


def prefill(net: Any, prompt: mx.array, step: int, tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first token (the prefill) and the first ``tokens`` greedy tokens."""
    start = time.perf_counter()
    steps = generate_step(prompt, net, max_tokens=tokens, prefill_step_size=step)
    first = next(steps)[0]
    seconds = time.perf_counter() - start
    return seconds, [int(first)] + [int(t) for t, _ in steps]


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--plain-step", type=int, default=2048)
    parser.add_argument("--optimize-step", type=int, help="default: --plain-step")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="plain and optimize timed alternately; medians shown")
    parser.add_argument("--quick", action="store_true", help="lengths 256 and 1024, window 64, steps 256 / 512")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.window, args.plain_step = [256, 1024], 64, 256
    args.optimize_step = args.optimize_step or args.plain_step
    net, fast = model(args.window), model(args.window)  # same seed, same weights: only the attention route differs
    opt = optimize(fast)  # one handle for the run: the second prefill of a length reuses the first's signatures
    print(f"mlx {mx.__version__}, device {mx.default_device()}, float32, pipeline {opt.pipeline}")
    print(f"gemma3_text: 4 layers (3 sliding, window {args.window}), 8/4 heads of dim 64; load before: {load()}")
    rows = []
    for length in args.lengths:
        prompt = mx.array([(7 * i + 3) % 128 for i in range(length)])
        cold, tokens = prefill(fast, prompt, args.optimize_step, args.tokens)  # builds the signatures
        print(f"  {length}: optimize (cold) {cold:.2f} s, {opt.routed} routed, {dict(opt.declined)}", flush=True)
        plains, warms = [], []
        for _ in range(args.rounds):  # alternately, so that the machine's load falls on both alike
            plain, plain_tokens = prefill(net, prompt, args.plain_step, args.tokens)
            warm, tokens = prefill(fast, prompt, args.optimize_step, args.tokens)
            plains.append(plain)
            warms.append(warm)
            print(f"  {length}: plain {plain:.2f} s, optimize {warm:.2f} s", flush=True)
        rows.append((length, statistics.median(plains), cold, statistics.median(warms), tokens == plain_tokens))
    print(f"load after: {load()}\n")
    print(f"{'prompt':>7} {'plain s':>8} {'optimize s':>11} {'(cold)':>7} {'ratio':>6} {'tokens':>10}")
    for length, plain, cold, warm, same in rows:
        print(f"{length:>7} {plain:>8.2f} {warm:>11.2f} {cold:>7.2f} {plain / warm:>6.2f} "
              f"{'identical' if same else 'DIFFER':>10}")  # fmt: skip
    print()
    opt.explain()


if __name__ == "__main__":
    main()
