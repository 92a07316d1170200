"""Benchmark: how tracing, the full pipeline and MLX lowering grow with model depth.

    .venv/bin/python benchmarks/scale.py                      # 12, 48 and 192 layers
    .venv/bin/python benchmarks/scale.py --layers 12 48 --repeat 3
    .venv/bin/python benchmarks/scale.py --clock cpu          # process CPU time: steadier on a loaded machine
    .venv/bin/python benchmarks/scale.py --profile 192        # cProfile of the pipeline at 192 layers

The model is ``attnpass.models.qwen38.build_model``: the attention of a
Qwen3.8-Flash-Next-shaped verify step (q_len 4, n_kv 8192), QSA layers at
``l % 4 == 3`` and dense sdpa elsewhere, with residual adds. The pipeline is the
``qwen38-model`` example's (QSA gather, head-chunk, dce, narrow-inputs, dce).
Phases: trace (``build_model``), pipeline (``PassManager.run``: every pass plus
the verifier, the copies and the changed checks between passes) and lower
(MLX code generation and compiling the generated source). Each phase is
timed ``--repeat`` times and the fastest run is shown; a flat "ms/layer"
column means linear growth; each round times every depth in turn. Machine load makes single wall-clock runs noisy
(+-30%); compare the columns of one invocation, not figures across
invocations, or time with ``--clock cpu`` (this process's CPU time: what a
quiet machine's wall clock would show, less the waits for a core).
The last lines hold the numbers against the goals (issue 19): 48 layers in
under 150 ms in total, and ms/layer at the deepest model within 1.2x of the
shallowest.
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
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
GOAL_48_MS = 150.0  # trace + pipeline + lower of 48 layers
GOAL_GROWTH = 1.2  # ms/layer, deepest over shallowest


def timed(fn: Callable[[], object], clock: Callable[[], float]) -> tuple[float, object]:
    """(seconds on ``clock``, result) of one call."""
    gc.collect()  # start each run from a clean heap; the collector stays on while timing
    start = clock()
    result = fn()
    return clock() - start, result


def measure(depths: list[int], repeat: int, clock: Callable[[], float] = time.perf_counter) -> dict[int, dict]:
    """Per depth: the fastest seconds per phase over ``repeat`` rounds, and node counts before and after the pipeline.

    Each round times every depth in turn, so a change of machine load falls on all depths alike.
    """
    manager = PassManager(parse_pipeline(PIPELINE))
    rows: dict[int, dict] = {n: dict.fromkeys(PHASES, float("inf")) for n in depths}
    for _ in range(repeat):
        for n in depths:
            t_trace, graph = timed(lambda: build_model(n), clock)
            t_pipe, result = timed(lambda: manager.run(graph), clock)
            t_lower, _ = timed(lambda: lower(result.graph, "mlx"), clock)
            for phase, seconds in zip(PHASES, (t_trace, t_pipe, t_lower)):
                rows[n][phase] = min(rows[n][phase], seconds)
            rows[n].update(nodes=len(graph), after=len(result.graph))
    return rows


def table(rows: dict[int, dict[str, float]]) -> str:
    header = f"{'layers':>6} {'nodes':>6} {'after':>6}"
    header += "".join(f" {phase + ' ms':>12} {'ms/layer':>9}" for phase in PHASES) + f" {'total ms/layer':>15}"
    lines = [header]
    for n_layers, r in rows.items():
        line = f"{n_layers:>6} {r['nodes']:>6} {r['after']:>6}"
        line += "".join(f" {r[p] * 1e3:>12.1f} {r[p] * 1e3 / n_layers:>9.2f}" for p in PHASES)
        lines.append(line + f" {sum(r[p] for p in PHASES) * 1e3 / n_layers:>15.2f}")
    return "\n".join(lines)


def verdict(rows: dict[int, dict[str, float]]) -> list[str]:
    """The measured numbers against the goals: total ms at 48 layers, ms/layer growth from shallowest to deepest."""
    lines = []
    if 48 in rows:
        total = sum(rows[48][p] for p in PHASES) * 1e3
        met = "met" if total < GOAL_48_MS else "NOT met"
        lines.append(f"48 layers total: {total:.1f} ms (goal < {GOAL_48_MS:.0f} ms: {met})")
    first, last = min(rows), max(rows)
    if first != last:
        per_layer = {n: {p: rows[n][p] / n for p in PHASES} for n in (first, last)}
        growth = {p: per_layer[last][p] / per_layer[first][p] for p in PHASES}
        growth["total"] = sum(per_layer[last].values()) / sum(per_layer[first].values())
        met = "met" if growth["total"] <= GOAL_GROWTH else "NOT met"
        lines.append(
            f"ms/layer at {last} vs {first} layers: "
            + ", ".join(f"{p} x{g:.2f}" for p, g in growth.items())
            + f" (goal: total within x{GOAL_GROWTH}: {met})"
        )
    return lines


def profile(n_layers: int, top: int = 20) -> None:
    graph = build_model(n_layers)
    manager = PassManager(parse_pipeline(PIPELINE))
    profiler = cProfile.Profile()
    profiler.runcall(manager.run, graph)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48, 192], help="model depths to measure")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over the depths; the fastest run is shown")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall time, or this process's CPU time")
    parser.add_argument("--profile", type=int, metavar="LAYERS", help="profile the pipeline at this depth instead")
    args = parser.parse_args()
    if args.profile:
        profile(args.profile)
        return
    print(f"pipeline: {PIPELINE}; clock: {args.clock}")
    rows = measure(args.layers, args.repeat, CLOCKS[args.clock])
    print(table(rows))
    print("\n".join(verdict(rows)))


if __name__ == "__main__":
    main()
