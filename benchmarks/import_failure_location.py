"""Benchmark: how long a failing MLX import takes to name the user's line, by depth.

    .venv/bin/python benchmarks/import_failure_location.py
    .venv/bin/python benchmarks/import_failure_location.py --blocks 8 16 32 64 128

The function is a chain of ``x = x + mx.tanh(x @ w)`` blocks ending in an
unsupported op (``mx.sort``: MLX's ``Sort``; ``mx.cumsum`` imports since the
scan ops). Two paths are timed: the import's own lines (recorded during its
one export), and the fallback replay
(:func:`attnpass.ir.frontends.mlx_source.locate`), reached here because the
function also holds an array made from the example argument itself, which the
export refuses as an extra output. Each row prints the time of the failing
``from_mlx`` (fastest of ``--repeat`` runs) and the ratio to the row before: a
linear cost doubles with the depth. The target is linear growth and under 2 s
at 64 blocks.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable


def chain(blocks: int, hold_argument: Any = None) -> Callable:
    """``blocks`` residual tanh blocks then a sort; ``hold_argument``: an array kept alive in the frame."""
    import mlx.core as mx

    weights = [mx.random.normal((16, 16)) * 0.1 for _ in range(blocks)]
    mx.eval(weights)

    def fn(x: Any) -> Any:
        held = None if hold_argument is None else hold_argument * 1.0  # noqa: F841 (forces the replay)
        for w in weights:
            x = x + mx.tanh(x @ w)
        return mx.sort(x, axis=-1)

    return fn


def failing_import(fn: Callable, x: Any) -> tuple[float, str]:
    """Seconds until ``from_mlx`` raises, and the last line of its message (where it located the op)."""
    from attnpass.ir import ModelImportError, from_mlx

    start = time.perf_counter()
    try:
        from_mlx(fn, x)
    except ModelImportError as exc:
        return time.perf_counter() - start, str(exc).splitlines()[-1].strip()
    raise AssertionError("the import did not fail")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import mlx.core as mx

    x = mx.random.normal((2, 16))
    mx.eval(x)
    print(f"{'blocks':>6} {'path':>8} {'seconds':>9} {'ratio':>6}  located")
    for path in ("recorded", "replay"):
        previous = None
        for blocks in args.blocks:
            fn = chain(blocks, x if path == "replay" else None)
            runs = [failing_import(fn, x) for _ in range(args.repeat)]
            seconds, where = min(runs)
            ratio = f"{seconds / previous:6.2f}" if previous else " " * 6
            print(f"{blocks:>6} {path:>8} {seconds:9.4f} {ratio}  {where}")
            previous = seconds


if __name__ == "__main__":
    main()
