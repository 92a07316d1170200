"""Benchmark: one Qwen3.8-Flash-Next QSA layer step on CPU (MLX, JAX) against its traffic bound.

    .venv/bin/python benchmarks/qsa_gather.py                 # 8K..256K, f32 and bf16, MLX and JAX
    .venv/bin/python benchmarks/qsa_gather.py --quick         # smoke run: 8K, f32, 2 repetitions
    .venv/bin/python benchmarks/qsa_gather.py --n-kv 131072 --dtypes float32 --plot qsa.png

Decode step (one query row), per depth, dtype and backend, timed interleaved in one loop:

- ``masked``: the layer as traced (indexer with in-graph pooling, full-width mask, fused sdpa);
- ``pool``: ``default_pipeline("cpu")`` without ``qsa-pool-cache``: gather, GQA-folded f32
  attention, but every block still pooled, normed and rotated each step;
- ``cache``: ``default_pipeline("cpu")`` with ``qsa-pool-cache{store=pooled}``: the indexer reads
  the resident pooled-key cache (built once by ``QSAPoolCache(store="pooled").prefill``) and pools
  only the newest block; RMSNorm and RoPE still run over every block;
- ``keys``: ``default_pipeline("cpu")`` as it is (``qsa-pool-cache{store=keys}``, the default): the
  cache holds the normed, rotated block keys, so only the newest block is normed and rotated;
- ``bound``: the backend's own plain reduction (``mx.sum`` / ``jnp.sum`` under ``jax.jit``) over
  a buffer of as many bytes as the cached step must read (the key cache, the W gathered cells of
  K and V, the newest block of raw keys, q and the indexer query): the time the step would take
  if it only streamed those bytes at this backend's streaming rate.

Verify step (S = 5 query rows, f32; depths ``--verify-n-kv``, default those of the decode table):
``masked``, ``gathered`` (the cached pipeline: one ``qsa_gather`` of every row's cells per cache,
one attention, lowered as the target does: MLX through a flat ``[B*Hkv*T, D]`` view, JAX by one
``take_along_axis``) and ``other`` (the same graph with the other lowering of ``qsa_gather``: MLX
by one ``take_along_axis``, JAX through the flat view).

Each step runs to completion (MLX: ``mx.eval``; JAX: ``block_until_ready`` of the program as
``lower`` returns it, ``jax.jit``-ed, its state buffer donated), carrying the block-key cache from
call to call like a decode loop; inputs already live on the backend. One warm-up call, then ``--reps`` repetitions,
the order of the paths rotating each repetition; the tables show medians and the machine's load.
``max |diff|`` is the largest difference of each rewritten output from the masked one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from attnpass.ir import DType, Graph
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, make_inputs, narrowed_inputs
from attnpass.passes import PassManager, QSAGather, QSAPoolCache, default_pipeline

DEPTHS = (8_192, 32_768, 131_072, 262_144)
DTYPES = ("float32", "bfloat16")
VERIFY_ROWS = 5

Step = Callable[[], np.ndarray]


def pipelines(*, pool_cache: str | None = "keys") -> PassManager:
    """``default_pipeline("cpu")`` with the pooled-key cache storing ``pool_cache`` (None: no cache)."""
    swap = {QSAPoolCache: QSAPoolCache(store=pool_cache or "keys")}
    passes = [swap.get(type(p), p) for p in default_pipeline("cpu") if pool_cache or not isinstance(p, QSAPoolCache)]
    return PassManager(passes)


@contextlib.contextmanager
def other_gather(backend: str) -> Iterator[None]:
    """Programs lowered inside gather with the backend's other ``qsa_gather`` lowering (flat view or not)."""
    runtime = importlib.import_module(f"attnpass.lowering.targets.{backend}.runtime")
    chosen = runtime.qsa
    runtime.qsa = dataclasses.replace(chosen, flat_gather=not chosen.flat_gather)
    try:
        yield
    finally:
        runtime.qsa = chosen


def step_function(backend: str, graph: Graph, inputs: dict[str, np.ndarray], prefill: Graph | None) -> Step:
    """A zero-argument call running one step to completion; it carries the graph's state between calls."""
    if prefill is not None:
        (cache,) = _call_once(backend, prefill, inputs)
        inputs = {**inputs, prefill.outputs[0]: cache}
    program = lower(graph, backend)
    args = program.bind(**narrowed_inputs(graph, inputs))
    state = [(graph.inputs.index(name), out) for name, out in graph.state_pairs()]
    if backend == "mlx":
        import mlx.core as mx

        mx.eval(args)

        def run_mlx() -> np.ndarray:
            outs = program.fn(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            for arg, out in state:
                args[arg] = outs[out]  # drop the old cache before evaluation, so MLX may update it in place
            mx.eval(outs)
            return np.array(outs[0].astype(mx.float32))

        return run_mlx

    def run_jax() -> np.ndarray:
        outs = program.fn(*args)  # jax.jit-ed by lower, the state donated
        outs = outs if isinstance(outs, tuple) else (outs,)
        for arg, out in state:
            args[arg] = outs[out]
        return np.asarray(outs[0].block_until_ready()).astype(np.float32)

    return run_jax


def _call_once(backend: str, graph: Graph, inputs: dict[str, np.ndarray]) -> tuple:
    program = lower(graph, backend)
    out = program(**{name: inputs[name] for name in graph.inputs})
    return out if isinstance(out, tuple) else (out,)


def bound_function(backend: str, nbytes: int) -> Step:
    """The backend's plain reduction over ``nbytes`` of float32: its streaming time for that many bytes."""
    data = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    if backend == "mlx":
        import mlx.core as mx

        buffer = mx.array(data)
        mx.eval(buffer)
        return lambda: np.array(mx.sum(buffer))
    import jax
    import jax.numpy as jnp

    buffer, total = jnp.asarray(data), jax.jit(jnp.sum)
    return lambda: np.asarray(total(buffer).block_until_ready())


def bytes_to_read(cfg: QSAConfig, n_kv: int, rows: int = 1) -> dict[str, int]:
    """What one cached step must read: the block-key cache, the gathered K/V cells, the rest (small)."""
    item = DType.parse(cfg.dtype).itemsize
    width = QSAGather().width(cfg.top_k_blocks, cfg.ratio)
    return {
        "block keys": n_kv // cfg.ratio * cfg.idx_dim * 4,
        "K/V cells": rows * width * cfg.n_kv_heads * cfg.head_dim * 2 * item,
        "other": rows
        * (cfg.ratio * cfg.idx_dim * 4 + cfg.idx_heads * cfg.idx_dim * 4 + cfg.n_q_heads * cfg.head_dim * item),
    }


def measure(steps: dict[str, Step], reps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per path (interleaved, rotating order) and max |path - masked| of each output."""
    outputs = {path: step() for path, step in steps.items()}  # warm-up (JAX compiles)
    times: dict[str, list[float]] = {path: [] for path in steps}
    order = list(steps)
    for rep in range(reps):
        for path in order[rep % len(order) :] + order[: rep % len(order)]:
            start = time.perf_counter()
            steps[path]()
            times[path].append(time.perf_counter() - start)
    masked = outputs["masked"]
    diffs = {p: float(np.abs(o - masked).max()) for p, o in outputs.items() if o.shape == masked.shape}
    return {path: statistics.median(ts) for path, ts in times.items()}, diffs


@dataclass
class Row:
    backend: str
    dtype: str
    n_kv: int
    ms: dict[str, float]
    diff: dict[str, float]
    read_mb: float = 0.0


def run_decode(depths: tuple[int, ...], dtypes: tuple[str, ...], backends: tuple[str, ...], reps: int) -> list[Row]:
    rows = []
    print(DECODE_HEADER, flush=True)
    for dtype in dtypes:
        cfg = QSAConfig(dtype=dtype)
        for n_kv in depths:
            masked = build_layer(cfg, n_kv)
            pooled = pipelines(pool_cache=None).run(masked).graph
            cached, keys = pipelines(pool_cache="pooled").run(masked).graph, pipelines().run(masked).graph
            prefill = QSAPoolCache(store="pooled").prefill(masked)
            prefill_keys = QSAPoolCache(store="keys").prefill(masked)
            inputs = make_inputs(cfg, n_kv, np.array([[n_kv - 3]]), seed=n_kv)
            read = bytes_to_read(cfg, n_kv)
            for backend in backends:
                steps = {
                    "masked": step_function(backend, masked, inputs, None),
                    "pool": step_function(backend, pooled, inputs, None),
                    "cache": step_function(backend, cached, inputs, prefill),
                    "keys": step_function(backend, keys, inputs, prefill_keys),
                    "bound": bound_function(backend, sum(read.values())),
                }
                ms, diff = measure(steps, reps)
                ms = {p: t * 1e3 for p, t in ms.items()}
                rows.append(Row(backend, dtype, n_kv, ms, diff, sum(read.values()) / 1e6))
                print(format_decode(rows[-1]), flush=True)
                del steps
                gc.collect()
            del masked, pooled, cached, keys, prefill, prefill_keys, inputs
            gc.collect()
    return rows


def run_verify(depths: tuple[int, ...], backends: tuple[str, ...], reps: int) -> list[Row]:
    rows = []
    print(VERIFY_HEADER, flush=True)
    cfg = QSAConfig(mask_rows=64)
    for n_kv in depths:
        masked = build_layer(cfg, n_kv, rows=VERIFY_ROWS)
        gathered = pipelines().run(masked).graph
        prefill = QSAPoolCache(store="keys").prefill(masked)
        inputs = make_inputs(cfg, n_kv, np.arange(n_kv - 8, n_kv - 8 + VERIFY_ROWS)[None], seed=n_kv + 1)
        for backend in backends:
            steps = {
                "masked": step_function(backend, masked, inputs, None),
                "gathered": step_function(backend, gathered, inputs, prefill),
            }
            with other_gather(backend):
                steps["other"] = step_function(backend, gathered, inputs, prefill)
            ms, diff = measure(steps, reps)
            rows.append(Row(backend, "float32", n_kv, {p: t * 1e3 for p, t in ms.items()}, diff))
            print(format_verify(rows[-1]), flush=True)
            del steps
            gc.collect()
        del masked, gathered, prefill, inputs
        gc.collect()
    return rows


DECODE_HEADER = (
    f"{'backend':<7} {'dtype':<8} {'n_kv':>8} {'masked':>9} {'pool':>8} {'cache':>8} {'keys':>7} {'bound':>7} "
    f"{'masked/cache':>12} {'cache/bound':>11} {'masked/keys':>11} {'keys/bound':>10} {'read MB':>8} "
    f"{'max |diff|':>10}"
)
VERIFY_HEADER = (
    f"{'backend':<7} {'n_kv':>8} {'masked':>9} {'gathered':>8} {'other':>8} "
    f"{'masked/gathered':>15} {'other/gathered':>14} {'max |diff|':>10}"
)


def format_decode(r: Row) -> str:
    m = r.ms
    return (
        f"{r.backend:<7} {r.dtype:<8} {r.n_kv:>8,} {m['masked']:>9.1f} {m['pool']:>8.1f} {m['cache']:>8.1f} "
        f"{m['keys']:>7.1f} {m['bound']:>7.2f} {m['masked'] / m['cache']:>11.1f}x {m['cache'] / m['bound']:>10.1f}x "
        f"{m['masked'] / m['keys']:>10.1f}x {m['keys'] / m['bound']:>9.1f}x {r.read_mb:>8.1f} "
        f"{max(r.diff.values()):>10.2e}"
    )


def format_verify(r: Row) -> str:
    m = r.ms
    return (
        f"{r.backend:<7} {r.n_kv:>8,} {m['masked']:>9.1f} {m['gathered']:>8.1f} {m['other']:>8.1f} "
        f"{m['masked'] / m['gathered']:>14.1f}x {m['other'] / m['gathered']:>13.2f}x {max(r.diff.values()):>10.2e}"
    )


def flatness(rows: list[Row]) -> list[str]:
    """The cached steps' and the bound's time at the deepest over the shallowest depth, per backend and dtype."""
    lines = []
    for key in sorted({(r.backend, r.dtype) for r in rows}):
        mine = sorted((r for r in rows if (r.backend, r.dtype) == key), key=lambda r: r.n_kv)
        if len(mine) > 1:
            lo, hi = mine[0], mine[-1]
            ratios = ", ".join(f"{p} {hi.ms[p] / lo.ms[p]:.2f}x" for p in ("cache", "keys", "bound"))
            lines.append(f"{key[0]} {key[1]} ({hi.n_kv:,} / {lo.n_kv:,}): {ratios}")
    return lines


def plot(decode: list[Row], verify: list[Row], path: Path) -> None:
    import matplotlib  # optional (extra "bench"), imported only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_decode, ax_verify) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (backend, dtype), color in zip(sorted({(r.backend, r.dtype) for r in decode}), plt.cm.tab10.colors):
        mine = [r for r in decode if (r.backend, r.dtype) == (backend, dtype)]
        depth = [r.n_kv for r in mine]
        for step, style in zip(("masked", "pool", "cache", "keys", "bound"), ("o-", "s--", "^-", "v-.", ":")):
            label = f"{backend} {dtype} {step}"
            ax_decode.plot(depth, [r.ms[step] for r in mine], style, color=color, label=label, alpha=0.85)
    for backend, color in zip(sorted({r.backend for r in verify}), plt.cm.Set1.colors):
        mine = [r for r in verify if r.backend == backend]
        for step, style in zip(("masked", "gathered", "other"), ("o-", "^-", "s--")):
            label = f"{backend} {step}"
            ax_verify.plot([r.n_kv for r in mine], [r.ms[step] for r in mine], style, color=color, label=label)
    for ax, title in ((ax_decode, "decode step (1 row)"), (ax_verify, f"verify step ({VERIFY_ROWS} rows, f32)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("n_kv (cells in the KV cache)")
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"One QSA layer, CPU: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: n_kv 8192, float32, 2 repetitions")
    parser.add_argument("--n-kv", type=lambda s: tuple(int(x) for x in s.split(",")), help="comma-separated depths")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: float32, bfloat16")
    parser.add_argument("--backends", default="mlx,jax", help="comma-separated: mlx, jax")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per path (default 7)")
    parser.add_argument("--no-verify", action="store_true", help="skip the verify-step table")
    parser.add_argument(
        "--verify-n-kv",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        help="comma-separated depths of the verify table (default: the decode depths)",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    args = parser.parse_args(argv)
    depths = args.n_kv or ((DEPTHS[0],) if args.quick else DEPTHS)
    dtypes = ("float32",) if args.quick else tuple(args.dtypes.split(","))
    reps, backends = (2 if args.quick else args.reps), tuple(args.backends.split(","))
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"QSA layer (24q/2kv/256, indexer 4x128, K=512 blocks x 4) on CPU ({os.cpu_count()} cores, load average "
        f"{load}), {reps} reps, medians in ms"
    )
    decode = run_decode(depths, dtypes, backends, reps)
    print("deepest / shallowest: " + "; ".join(flatness(decode)))
    verify = [] if args.no_verify else run_verify(args.verify_n_kv or depths, backends, reps)
    print(f"load average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.plot:
        plot(decode, verify, args.plot)


if __name__ == "__main__":
    main()
