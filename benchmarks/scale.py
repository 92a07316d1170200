"""Benchmark: how tracing, the full pipeline and MLX lowering grow with model depth.

    .venv/bin/python benchmarks/scale.py                      # 12, 48 and 192 layers
    .venv/bin/python benchmarks/scale.py --layers 12 48 --repeat 3
    .venv/bin/python benchmarks/scale.py --profile 192        # cProfile of the pipeline at 192 layers

The model is ``attnpass.models.qwen38.build_model``: the attention of a
Qwen3.8-Flash-Next-shaped verify step (q_len 4, n_kv 8192), QSA layers at
``l % 4 == 3`` and dense sdpa elsewhere, with residual adds. The pipeline is the
``qwen38-model`` example's (QSA gather, head-chunk, dce, narrow-inputs, dce).
Phases: trace (``build_model``), pipeline (``PassManager.run``: every pass plus
the verifier, the copies and the changed checks between passes) and lower
(MLX code generation and compiling the generated source). Each phase is
timed ``--repeat`` times and the fastest run is shown; a flat "ms/layer"
column means linear growth. Machine load makes single runs noisy (+-30%);
compare the columns of one invocation, not figures across invocations.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from typing import Callable

from attnpass.lowering import lower
from attnpass.models import EXAMPLES, build_model
from attnpass.passes import PassManager, parse_pipeline

PIPELINE = EXAMPLES["qwen38-model"].pipeline
PHASES = ("trace", "pipeline", "lower")


def fastest(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """(best wall seconds, last result) over ``repeat`` calls."""
    best, result = float("inf"), None
    for _ in range(repeat):
        gc.collect()  # start each run from a clean heap; the collector stays on while timing
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(n_layers: int, repeat: int) -> dict[str, float]:
    """Seconds per phase, and node counts before and after the pipeline."""
    manager = PassManager(parse_pipeline(PIPELINE))
    t_trace, graph = fastest(lambda: build_model(n_layers), repeat)
    t_pipe, result = fastest(lambda: manager.run(graph), repeat)
    t_lower, _ = fastest(lambda: lower(result.graph, "mlx"), repeat)
    return {"trace": t_trace, "pipeline": t_pipe, "lower": t_lower, "nodes": len(graph), "after": len(result.graph)}


def table(rows: dict[int, dict[str, float]]) -> str:
    header = f"{'layers':>6} {'nodes':>6} {'after':>6}"
    header += "".join(f" {phase + ' ms':>12} {'ms/layer':>9}" for phase in PHASES) + f" {'total ms/layer':>15}"
    lines = [header]
    for n_layers, r in rows.items():
        line = f"{n_layers:>6} {r['nodes']:>6} {r['after']:>6}"
        line += "".join(f" {r[p] * 1e3:>12.1f} {r[p] * 1e3 / n_layers:>9.2f}" for p in PHASES)
        lines.append(line + f" {sum(r[p] for p in PHASES) * 1e3 / n_layers:>15.2f}")
    return "\n".join(lines)


def profile(n_layers: int, top: int = 20) -> None:
    graph = build_model(n_layers)
    manager = PassManager(parse_pipeline(PIPELINE))
    profiler = cProfile.Profile()
    profiler.runcall(manager.run, graph)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48, 192], help="model depths to measure")
    parser.add_argument("--repeat", type=int, default=2, help="runs per phase; the fastest is shown")
    parser.add_argument("--profile", type=int, metavar="LAYERS", help="profile the pipeline at this depth instead")
    args = parser.parse_args()
    if args.profile:
        profile(args.profile)
        return
    print(f"pipeline: {PIPELINE}")
    rows = {n: measure(n, args.repeat) for n in args.layers}
    print(table(rows))
    first, last = args.layers[0], args.layers[-1]
    growth = {p: (rows[last][p] / last) / (rows[first][p] / first) for p in PHASES}
    print(f"ms/layer at {last} vs {first} layers: " + ", ".join(f"{p} x{g:.2f}" for p, g in growth.items()))


if __name__ == "__main__":
    main()
