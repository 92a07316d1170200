"""Benchmark (not a test): block-sparse vs dense structured-mask SDPA, MLX and JAX on CPU, f32 and bf16.

One layer: 8 query heads, 4 KV heads, head dim 128, batch 1, q_len = k_len = T. Three masks:

- ``window``: causal sliding window W = 1024 at T = 8192 (``--long``: 16384);
- ``causal``: plain causal at T = 8192;
- ``chunked``: llama4-style causal chunks of 2048 at T = 8192.

``dense`` is the traced ``sdpa`` lowered as is (MLX's fused call, JAX's ``jax.nn.dot_product_attention``, each
with the structure as a bool mask, or MLX's ``"causal"``); ``sparse`` is the same graph after
:class:`~attnpass.passes.BlockSparse` (the cpu plan, 512-row tiles). JAX programs are ``jax.jit``'d and compiled
before timing. The table gives the median seconds of ``--reps`` interleaved calls, the speedup (dense / sparse),
the FLOP ratio (dense S*T over the (q, k) pairs the tiles visit), speedup / FLOP ratio, and whether the issue's
target is met: window and chunked >= 0.6 x FLOP ratio, causal >= 1.5 x. ``same``: the two outputs' raw bits are
equal; else their largest difference. ``--quick`` is a smoke run (T = 512, W = 64, chunk 128, 64-row tiles; seconds
on JAX, about a minute with MLX's slow CPU masked call) with no targets.

    python benchmarks/block_sparse.py [--quick | --long] [--reps N] [--backends mlx,jax] [--masks window,causal,chunked]
        [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np

from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes import BlockSparse

HQ, HKV, D = 8, 4, 128
DTYPES = (DType.float32, DType.bfloat16)
TARGETS = {"window": 0.6, "causal": None, "chunked": 0.6}  # x FLOP ratio; causal: an absolute 1.5x
CAUSAL_TARGET = 1.5


def cases(quick: bool, long: bool) -> list[tuple[str, int, tuple | None, int | None]]:
    """(name, T, window, block_q) per mask."""
    if quick:
        return [("window", 512, (64, None, None), 64), ("causal", 512, None, 64),
                ("chunked", 512, (None, None, 128), 64)]  # fmt: skip
    t = 16384 if long else 8192
    return [("window", t, (1024, None, None), None), ("causal", 8192, None, None),
            ("chunked", 8192, (None, None, 2048), None)]  # fmt: skip


def programs(t: int, window, block_q: int | None, dtype: DType, target: str) -> tuple[Callable, Callable, float]:
    """(dense fn, sparse fn, FLOP ratio) for one case on ``target``."""
    q, kv = TensorSpec((1, HQ, t, D), dtype), TensorSpec((1, HKV, t, D), dtype)
    graph = trace(lambda q, k, v: ops.sdpa(q, k, v, causal="bottom_right", window=window), q, kv, kv)
    result = BlockSparse(block_q=block_q, enabled=True)(graph)
    (applied,) = result.applied()
    ratio = float(applied.message.split("FLOP ratio ")[1].split(")")[0])
    return lower(graph, target).fn, lower(result.graph, target).fn, ratio


def inputs(t: int, dtype: DType, target: str) -> list[Any]:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, h, t, D)).astype(np.float32) for h in (HQ, HKV, HKV)]
    if target == "mlx":
        import mlx.core as mx

        xs = [mx.array(a).astype(getattr(mx, dtype.value)) for a in arrays]
        mx.eval(*xs)
        return xs
    import jax.numpy as jnp

    return [jnp.asarray(a).astype(getattr(jnp, dtype.value)) for a in arrays]


def runner(fn: Callable, xs: list[Any], target: str) -> Callable[[], np.ndarray]:
    """A call of ``fn`` that waits for its result (JAX: jit-compiled ahead of timing)."""
    if target == "mlx":
        import mlx.core as mx

        def call():
            out = fn(*xs)
            mx.eval(out)
            return out

        return call
    import jax

    compiled = jax.jit(fn).lower(*xs).compile()
    return lambda: compiled(*xs).block_until_ready()


def as_numpy(x: Any) -> np.ndarray:
    if type(x).__module__.startswith("mlx"):
        import mlx.core as mx

        return np.asarray(x.astype(mx.float32)) if x.dtype == mx.bfloat16 else np.asarray(x)
    return np.asarray(x.astype("float32"))


def bench(name: str, t: int, window, block_q, dtype: DType, target: str, reps: int) -> dict:
    dense_fn, sparse_fn, ratio = programs(t, window, block_q, dtype, target)
    xs = inputs(t, dtype, target)
    calls = {"dense": runner(dense_fn, xs, target), "sparse": runner(sparse_fn, xs, target)}
    times: dict[str, list[float]] = {"dense": [], "sparse": []}
    outs = {}
    for rep in range(reps):
        for variant in ("dense", "sparse") if rep % 2 == 0 else ("sparse", "dense"):
            start = time.perf_counter()
            out = calls[variant]()
            times[variant].append(time.perf_counter() - start)
            outs.setdefault(variant, as_numpy(out))
            del out
    dense, sparse = (statistics.median(times[v]) for v in ("dense", "sparse"))
    same = np.array_equal(outs["dense"], outs["sparse"])
    return {"name": name, "t": t, "dtype": dtype.value, "target": target, "dense": dense, "sparse": sparse,
            "ratio": ratio, "same": same, "diff": float(np.max(np.abs(outs["dense"] - outs["sparse"])))}  # fmt: skip


def verdict(r: dict, quick: bool) -> str:
    if quick:
        return "-"
    speedup = r["dense"] / r["sparse"]
    goal = TARGETS[r["name"]]
    ok = speedup >= CAUSAL_TARGET if goal is None else speedup >= goal * r["ratio"]
    want = f">={CAUSAL_TARGET}x" if goal is None else f">={goal}xFLOP"
    return f"{'met' if ok else 'MISSED'} ({want})"


HEADER = f"{'mask':>8} {'T':>6} {'target':>6} {'dtype':>8} | {'dense s':>8} {'sparse s':>8} {'speedup':>7} " \
         f"{'FLOP x':>6} {'sp/FLOP':>7} | {'output':>9} | target"  # fmt: skip


def row(r: dict, quick: bool) -> str:
    speedup = r["dense"] / r["sparse"]
    output = "same" if r["same"] else f"{r['diff']:.1e}"
    return (
        f"{r['name']:>8} {r['t']:>6} {r['target']:>6} {r['dtype']:>8} | {r['dense']:>8.2f} {r['sparse']:>8.2f} "
        f"{speedup:>7.2f} {r['ratio']:>6.2f} {speedup / r['ratio']:>7.2f} | {output:>9} | {verdict(r, quick)}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="T = 512: a smoke run")
    size.add_argument("--long", action="store_true", help="the window case at T = 16384")
    parser.add_argument("--reps", type=int, default=None, help="interleaved calls per variant (default 3 quick, 1)")
    parser.add_argument("--backends", default="mlx,jax", help="comma-separated: mlx, jax")
    parser.add_argument("--masks", default="window,causal,chunked", help="comma-separated: window, causal, chunked")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 1)
    targets = [b for b in args.backends.split(",") if b]
    if "mlx" in targets:
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
    if "jax" in targets:
        import jax

        jax.config.update("jax_platforms", "cpu")
    print(f"{HQ} q / {HKV} KV heads, head dim {D}, batch 1, q_len = k_len = T; CPU; medians of {reps} call(s)")
    print("speedup = dense / sparse; FLOP x = dense S*T / visited pairs; output: raw bits same, else max |diff|")
    print(HEADER, flush=True)
    masks = args.masks.split(",")
    for name, t, window, block_q in (case for case in cases(args.quick, args.long) if case[0] in masks):
        for target in targets:
            for dtype in (d for d in DTYPES if d.value in args.dtypes.split(",")):
                print(row(bench(name, t, window, block_q, dtype, target, reps), args.quick), flush=True)


if __name__ == "__main__":
    main()
