"""Benchmark: one Qwen3.8-Flash-Next QSA decode layer step, masked vs gather, MLX and JAX on CPU.

    .venv/bin/python benchmarks/qsa_gather.py            # n_kv 8K, 32K, 128K, 256K (a few minutes)
    .venv/bin/python benchmarks/qsa_gather.py --quick    # smoke run: 8K, 2 repetitions
    .venv/bin/python benchmarks/qsa_gather.py --plot qsa_gather.png

Both programs are lowered from the same traced layer (attnpass.models.qsa_layer); the gather
one went through QSAGather -> DCE -> NarrowInputs -> DCE. Each step is timed end to end
(MLX: the generated function plus ``mx.eval``; JAX: the ``jax.jit``-compiled function plus
``block_until_ready``), after one warm-up call. Repetitions interleave the two paths,
alternating which goes first, and the table shows medians. Inputs are built once per depth
and already live on the backend, so host-to-device traffic is not part of the time; the
"streamed MB" columns give the bytes a caller provides per step.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

from attnpass.ir import Graph  # noqa: E402
from attnpass.lowering import lower  # noqa: E402
from attnpass.models import QSAConfig, build_layer, gather_pipeline, make_inputs, narrowed_inputs

DEPTHS = (8_192, 32_768, 131_072, 262_144)
PATHS = ("masked", "gather")


def step_function(target: str, graph: Graph, inputs: dict[str, np.ndarray]) -> Callable[[], np.ndarray]:
    """A zero-argument call that runs one decode step to completion and returns the output."""
    program = lower(graph, target)
    args = program.bind(**narrowed_inputs(graph, inputs))
    if target == "mlx":
        import mlx.core as mx

        mx.eval(args)

        def run_mlx() -> np.ndarray:
            out = program.fn(*args)
            mx.eval(out)
            return np.array(out)

        return run_mlx
    import jax

    compiled = jax.jit(program.fn)
    args = [jax.device_put(a) for a in args]
    return lambda: np.asarray(compiled(*args).block_until_ready())


def measure(steps: dict[str, Callable[[], np.ndarray]], reps: int) -> tuple[dict[str, float], float]:
    """Median seconds per path (interleaved, alternating order) and max |masked - gather|."""
    outputs = {path: step() for path, step in steps.items()}  # warm-up (and JAX compile)
    times: dict[str, list[float]] = {path: [] for path in steps}
    for rep in range(reps):
        order = PATHS if rep % 2 == 0 else PATHS[::-1]
        for path in order:
            start = time.perf_counter()
            steps[path]()
            times[path].append(time.perf_counter() - start)
    diff = float(np.abs(outputs["masked"] - outputs["gather"]).max())
    return {path: statistics.median(ts) for path, ts in times.items()}, diff


def run(depths: tuple[int, ...], backends: tuple[str, ...], reps: int) -> list[dict]:
    cfg = QSAConfig()
    rows = []
    for n_kv in depths:
        masked = build_layer(cfg, n_kv)
        gathered = gather_pipeline().run(masked).graph
        inputs = make_inputs(cfg, n_kv, np.array([[n_kv - 3]]), seed=n_kv)
        for backend in backends:
            steps = {path: step_function(backend, g, inputs) for path, g in zip(PATHS, (masked, gathered))}
            medians, diff = measure(steps, reps)
            rows.append(
                {
                    "backend": backend,
                    "n_kv": n_kv,
                    "masked_ms": medians["masked"] * 1e3,
                    "gather_ms": medians["gather"] * 1e3,
                    "masked_mb": masked.input_nbytes() / 1e6,
                    "gather_mb": gathered.input_nbytes() / 1e6,
                    "max_diff": diff,
                }
            )
            print(format_row(rows[-1]), flush=True)
            del steps
            gc.collect()
        del masked, gathered, inputs
        gc.collect()
    return rows


HEADER = (
    f"{'backend':<7} {'n_kv':>8} {'masked ms':>10} {'gather ms':>10} {'speedup':>8} "
    f"{'streamed MB':>17} {'max |diff|':>11}"
)


def format_row(row: dict) -> str:
    mb = f"{row['masked_mb']:.2f} -> {row['gather_mb']:.2f}"
    return (
        f"{row['backend']:<7} {row['n_kv']:>8,} {row['masked_ms']:>10.1f} {row['gather_ms']:>10.1f} "
        f"{row['masked_ms'] / row['gather_ms']:>7.2f}x {mb:>17} {row['max_diff']:>11.2e}"
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # optional (extra "bench"), imported only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ms, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend in sorted({r["backend"] for r in rows}):
        mine = [r for r in rows if r["backend"] == backend]
        depth = [r["n_kv"] for r in mine]
        for step, style in zip(PATHS, ("o-", "s--")):
            ax_ms.plot(depth, [r[f"{step}_ms"] for r in mine], style, label=f"{backend} {step}")
        ax_ratio.plot(depth, [r["masked_ms"] / r["gather_ms"] for r in mine], "o-", label=backend)
    for ax in (ax_ms, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n_kv (cells in the KV cache)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_ms.set_yscale("log")
    ax_ms.set_ylabel("ms per decode step (median)")
    ax_ms.set_title("One QSA layer, CPU")
    ax_ratio.set_ylabel("masked / gather")
    ax_ratio.set_title("Speedup of the gather rewrite")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: n_kv 8192, 2 repetitions")
    parser.add_argument("--n-kv", type=lambda s: tuple(int(x) for x in s.split(",")), help="comma-separated depths")
    parser.add_argument("--backends", default="mlx,jax", help="comma-separated: mlx, jax")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per path (default 5)")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    args = parser.parse_args(argv)
    depths = args.n_kv or ((DEPTHS[0],) if args.quick else DEPTHS)
    reps = 2 if args.quick else args.reps
    print(f"QSA decode layer (24q/2kv/256, indexer 4x128, K=512 blocks x 4), f32, CPU, {reps} reps, medians")
    print(HEADER)
    rows = run(depths, tuple(args.backends.split(",")), reps)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
