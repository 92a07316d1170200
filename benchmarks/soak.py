"""Benchmark (not a test): a long generation of one optimized mlx-lm model next to the plain one, block by block.

Model: :func:`attnpass.models.tiny_lm` (llama, 2 layers, hidden 256; ``--heads`` query / ``--kv-heads`` KV
heads of dim ``--head-dim``, by default tiny_lm's 24 / 2 of dim 128) in ``--dtype``, twice with the same weights: one plain, one under ``optimize(min_keys=--min-keys)``. Each generates
``--tokens`` tokens greedily from the same ``--prompt``-token prompt with ``mlx_lm.generate.generate_step`` (a
``KVCache`` per layer, as ``mlx_lm.generate`` decodes); the two run in turn, blocks of ``--block`` tokens each,
the order alternating per block, so each pair of blocks covers the same positions moments apart. Per block the
table prints the context reached, each model's tokens/s and their ratio, the optimized model's traces (signatures
built), the signatures it holds (fewer than the traces only if one was evicted and rebuilt), the bound on the
cuts of the contexts so far (:func:`~attnpass.backends.mlx.buffers.cuts_bound`) and the process's RSS. RSS is
the process's, so the paired run cannot tell the two models' memory apart: with ``--alone`` (the default) each
model then generates the same tokens alone in a fresh process, and the table gives each one's RSS growth per
block and per 1,000 tokens after the first block (the warm-up), the optimized model's against the plain one's
(the two processes run at once: their RSS is their own, their speed is not measured).

    python benchmarks/soak.py [--tokens 20000] [--block 1000] [--dtype bfloat16] [--min-keys N] [--prompt 16]
        [--heads 24] [--kv-heads 2] [--head-dim 128] [--no-alone]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from attnpass.backends.mlx import optimize
from attnpass.backends.mlx.buffers import cuts_bound
from attnpass.models import tiny_lm

VARIANTS = ("plain", "optimize")


def rss_mb() -> float:
    """The process's resident set in MB (Linux ``/proc``; elsewhere the peak, from ``resource``)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)


def models(args: argparse.Namespace, variants: tuple[str, ...]) -> tuple[dict, object | None]:
    """The models of ``variants`` (same weights) and the optimized one's handle (None without it)."""
    shape = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    found = {variant: tiny_lm("llama", dtype=args.dtype, **shape) for variant in variants}
    opt = optimize(found["optimize"], min_keys=args.min_keys) if "optimize" in found else None
    return found, opt


def tokens(model, prompt: int, count: int) -> Iterator[int]:
    """``count`` greedy tokens of ``model`` after a ``prompt``-token prompt (token ids 1 .. prompt)."""
    cache = make_prompt_cache(model)
    for token, _ in generate_step(mx.arange(1, prompt + 1), model, prompt_cache=cache, max_tokens=count):
        yield int(token)


def block(steps: Iterator[int], size: int) -> tuple[float, list[int]]:
    """Tokens/s of the next ``size`` tokens of ``steps`` and the tokens; the step left in flight is waited for."""
    start = time.perf_counter()
    got = [next(steps) for _ in range(size)]
    rate = size / (time.perf_counter() - start)
    mx.synchronize(generation_stream)
    return rate, got


def signatures(opt) -> int:
    return sum(len(c.specializations) for c in list(opt.programs.values()))


def paired(args: argparse.Namespace) -> list[dict]:
    """The two models in turn, ``args.block`` tokens each, the order alternating; a row per block."""
    found, opt = models(args, VARIANTS)
    steps = {v: tokens(m, args.prompt, args.tokens) for v, m in found.items()}
    rows, same = [], True
    for index in range(args.tokens // args.block):
        rates, got = {}, {}
        for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
            rates[variant], got[variant] = block(steps[variant], args.block)
        same = same and got["plain"] == got["optimize"]
        context = args.prompt + (index + 1) * args.block
        rows.append({
            "context": context, "plain": rates["plain"], "optimize": rates["optimize"], "traces": opt.traces,
            "signatures": signatures(opt), "bound": cuts_bound(context), "rss": rss_mb(), "same": same,
        })  # fmt: skip
        row = rows[-1]
        print(f"{context:>7} {row['plain']:>9.1f} {row['optimize']:>9.1f} {row['optimize'] / row['plain']:>6.2f} "
              f"{row['traces']:>6} {row['signatures']:>6} {row['bound']:>6} {row['rss']:>8.0f} "
              f"{'yes' if same else 'NO':>5}", flush=True)  # fmt: skip
    print(f"routed {opt.routed}, declined {dict(opt.declined)}")
    return rows


def alone(args: argparse.Namespace, variant: str) -> list[float]:
    """The RSS (MB) after each block of ``variant`` generating alone in this process (the first: before any)."""
    found, _ = models(args, (variant,))
    steps = tokens(found[variant], args.prompt, args.tokens)
    sizes = [rss_mb()]
    for _ in range(args.tokens // args.block):
        block(steps, args.block)
        sizes.append(rss_mb())
    return sizes


def growth(sizes: list[float], per: int) -> float:
    """MB of RSS per 1,000 tokens after the first block (blocks of ``per`` tokens)."""
    return (sizes[-1] - sizes[1]) / ((len(sizes) - 2) * per) * 1000 if len(sizes) > 2 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--block", type=int, default=1000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--min-keys", type=int, default=None, help="optimize's min_keys (default: MIN_KEYS on CPU)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--heads", type=int, default=24, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-alone", action="store_true", help="skip the RSS runs of each model alone")
    parser.add_argument("--alone", choices=VARIANTS, help=argparse.SUPPRESS)  # a child: one model, RSS as JSON
    args = parser.parse_args()
    if args.alone:
        print(json.dumps(alone(args, args.alone)))
        return
    print(f"mlx {mx.__version__} on {mx.default_device()}, {args.dtype}, {args.heads}/{args.kv_heads} heads of "
          f"dim {args.head_dim}, min_keys={args.min_keys}, "
          f"{args.tokens} tokens in blocks of {args.block}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'context':>7} {'plain/s':>9} {'opt/s':>9} {'ratio':>6} {'traces':>6} {'sigs':>6} {'bound':>6} "
          f"{'RSS MB':>8} {'same':>5}")  # fmt: skip
    rows = paired(args)
    ratios = [r["optimize"] / r["plain"] for r in rows]
    half = len(ratios) // 2
    if half:
        first, last = sum(ratios[:half]) / half, sum(ratios[half:]) / (len(ratios) - half)
        print(f"tokens/s ratio: first half {first:.2f}, second half {last:.2f}; traces {rows[-1]['traces']}, "
              f"signatures {rows[-1]['signatures']}, bound {rows[-1]['bound']}")  # fmt: skip
    if args.no_alone:
        return
    children = {}
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--alone", variant] + [a for a in sys.argv[1:] if a != "--no-alone"]
        children[variant] = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    sizes = {variant: json.loads(child.communicate()[0]) for variant, child in children.items()}
    print("RSS MB after each block, each model alone:")
    for variant in VARIANTS:
        print(f"  {variant:>8}: " + " ".join(f"{s:.0f}" for s in sizes[variant]))
    plain, optimized = (growth(sizes[v], args.block) for v in VARIANTS)
    print(f"RSS growth per 1,000 tokens after the first block: plain {plain:.1f} MB, optimize {optimized:.1f} MB "
          f"({optimized / plain:.2f}x plain)")  # fmt: skip


if __name__ == "__main__":
    main()
