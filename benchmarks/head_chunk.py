"""Benchmark (not a test): head-chunked vs unchunked verify-shaped SDPA on MLX CPU.

Shape: 24 query heads, 2 KV heads, head dim 256, bf16, scale 1/16, q_len 3-8,
contexts up to 128K. Three variants run side by side, interleaved per
repetition (alternating order), and the table reports medians:

- ``unchunked``: the traced graph lowered to MLX as is (one SDPA call);
- ``chunked``: the same graph after :class:`HeadChunkSDPA`, lowered to MLX
  (one lazy graph: every chunk's score plane is alive at the final eval);
- ``eval/chunk``: the same chunks by hand, evaluated one by one (docs/semantics.md §4: this
  is what bounds the transient to one chunk's plane).

Peak memory is ``mx.get_peak_memory()`` after ``mx.reset_peak_memory()``,
minus the memory already active (the inputs): the call's transient. Ratios
are variant / unchunked. ``--quick`` is a seconds-long smoke run; the default
run takes a few minutes on 2 cores. ``--plot out.png`` draws the ratios when
matplotlib is installed.

    python benchmarks/head_chunk.py [--quick] [--reps N] [--plot out.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from attnpass.backends import to_numpy
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes import HeadChunkSDPA, head_chunk_plan
from attnpass.passes.rewrites.head_chunk import head_chunks

HQ, HKV, D, SCALE = 24, 2, 256, 1 / 16
DEFAULT_GRID = ((4096, (3, 4, 5, 6, 7, 8)), (32768, (3, 5, 8)), (131072, (3, 8)))
QUICK_GRID = ((256, (3, 8)), (1024, (3, 4, 6, 8)))
VARIANTS = ("unchunked", "chunked", "eval/chunk")
MIB = 1 << 20

Fn = Callable[[mx.array, mx.array, mx.array], mx.array]


def attention(q, k, v):
    return ops.sdpa(q, k, v, scale=SCALE)


def variants(q_len: int, t: int) -> dict[str, Fn]:
    kv = TensorSpec((1, HKV, t, D), "bf16")
    graph = trace(attention, TensorSpec((1, HQ, q_len, D), "bf16"), kv, kv)
    chunked = HeadChunkSDPA(enabled=True)(graph)
    assert chunked.changed, f"q_len {q_len} is not eligible: {chunked.remarks}"
    heads_per_chunk, _ = head_chunk_plan(q_len, HQ, HKV)

    def eval_per_chunk(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        outs = []
        for j, h0, h1 in head_chunks(HQ, HKV, heads_per_chunk):
            out = mx.fast.scaled_dot_product_attention(q[:, h0:h1], k[:, j : j + 1], v[:, j : j + 1], scale=SCALE)
            mx.eval(out)
            outs.append(out)
        return mx.concatenate(outs, axis=1)

    return {
        "unchunked": lower(graph, "mlx").fn,
        "chunked": lower(chunked.graph, "mlx").fn,
        "eval/chunk": eval_per_chunk,
    }


def measure(fn: Fn, q: mx.array, k: mx.array, v: mx.array) -> tuple[float, float, mx.array]:
    """(seconds, transient peak bytes, output) of one evaluated call."""
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    out = fn(q, k, v)
    mx.eval(out)
    seconds = time.perf_counter() - start
    return seconds, mx.get_peak_memory() - base, out


def bench(t: int, q_len: int, reps: int) -> dict:
    keys = [mx.random.normal((1, HKV, t, D)).astype(mx.bfloat16) for _ in range(2)]
    q = mx.random.normal((1, HQ, q_len, D)).astype(mx.bfloat16)
    mx.eval(q, *keys)
    fns = variants(q_len, t)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    peaks: dict[str, list[float]] = {name: [] for name in VARIANTS}
    outputs = {}
    for rep in range(reps):
        for name in VARIANTS if rep % 2 == 0 else reversed(VARIANTS):
            seconds, peak, out = measure(fns[name], q, *keys)
            times[name].append(seconds)
            peaks[name].append(peak)
            outputs.setdefault(name, to_numpy(out))
            del out
    chunked, unchunked = (outputs[n].astype(np.float32) for n in ("chunked", "unchunked"))
    return {
        "t": t,
        "q_len": q_len,
        "plan": head_chunk_plan(q_len, HQ, HKV),
        "ms": {n: statistics.median(v) * 1e3 for n, v in times.items()},
        "mib": {n: statistics.median(v) / MIB for n, v in peaks.items()},
        "bits": np.array_equal(outputs["chunked"].view(np.uint16), outputs["eval/chunk"].view(np.uint16)),
        "max_diff": float(np.max(np.abs(chunked - unchunked))),
    }


HEADER = (
    f"{'T':>7} {'q_len':>5} {'plan':>6} | {'unchunked':>9} {'chunked':>8} {'eval/ch':>8} ms | "
    f"{'time x':>6} {'eval x':>6} | {'unchunked':>9} {'chunked':>8} {'eval/ch':>8} MiB | {'peak x':>6} {'eval x':>6} | "
    f"{'bits':>4} {'max|d|':>7}"
)


def row(r: dict) -> str:
    ms, mib = r["ms"], r["mib"]
    plan = f"{r['plan'][0]}x{r['plan'][1]}"
    ratio = lambda d, n: d[n] / d["unchunked"] if d["unchunked"] else float("nan")  # noqa: E731
    return (
        f"{r['t']:>7} {r['q_len']:>5} {plan:>6} | "
        f"{ms['unchunked']:>9.1f} {ms['chunked']:>8.1f} {ms['eval/chunk']:>8.1f}    | "
        f"{ratio(ms, 'chunked'):>6.2f} {ratio(ms, 'eval/chunk'):>6.2f} | "
        f"{mib['unchunked']:>9.1f} {mib['chunked']:>8.1f} {mib['eval/chunk']:>8.1f}     | "
        f"{ratio(mib, 'chunked'):>6.2f} {ratio(mib, 'eval/chunk'):>6.2f} | "
        f"{'same' if r['bits'] else 'DIFF':>4} {r['max_diff']:>7.1e}"
    )


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for q_len in sorted({r["q_len"] for r in results}):
        rs = [r for r in results if r["q_len"] == q_len]
        ts = [r["t"] for r in rs]
        ax_t.plot(ts, [r["ms"]["chunked"] / r["ms"]["unchunked"] for r in rs], "o-", label=f"q_len {q_len}")
        ax_m.plot(ts, [r["mib"]["eval/chunk"] / r["mib"]["unchunked"] for r in rs], "o-", label=f"q_len {q_len}")
    for ax, title in ((ax_t, "time: chunked / unchunked"), (ax_m, "peak: eval per chunk / unchunked")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context T")
        ax.set_title(title)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small contexts: a smoke run of a few seconds")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per variant (median)")
    parser.add_argument("--plot", metavar="PNG", help="write ratio plots (needs matplotlib)")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    warm = [mx.zeros(shape, mx.bfloat16) for shape in ((1, HQ, 3, D), (1, HKV, 64, D), (1, HKV, 64, D))]
    measure(variants(3, 64)["chunked"], *warm)  # first-call setup out of the table
    print(f"MLX {mx.__version__} CPU, {HQ}q/{HKV}kv, head dim {D}, bf16, scale 1/16; medians of {args.reps} reps")
    print("plan = heads_per_chunk x chunks; x = variant / unchunked; MiB = transient peak above the inputs")
    print("bits: chunked program vs eval-per-chunk loop (raw bf16); max|d|: chunked vs unchunked")
    print(HEADER)
    results = []
    for t, q_lens in grid:
        for q_len in q_lens:
            results.append(bench(t, q_len, args.reps))
            print(row(results[-1]), flush=True)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
