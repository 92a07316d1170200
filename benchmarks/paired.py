"""Paired bursts (for the decode benchmarks): two decoders timed in turn, so each pair shares the machine's load.

On 2 shared cores the load moves a decode rate by 10-30% between seconds; a
ratio of two medians taken seconds apart carries that drift. Here the plain
and the optimized decoder run in turn, ``bursts`` bursts of ``tokens`` steps
each, the order alternating per burst, from caches filled at the same depth:
burst ``i`` of both covers the same positions moments apart, and the median of
the pairs' ratios (:func:`paired_ratio`) is the speedup under a shared load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

VARIANTS = ("plain", "optimize")


def paired_bursts(
    steps: dict[str, Callable[[], int]], tokens: int, bursts: int, rep: int, settle: Callable[[], None]
) -> dict[str, list[float]]:
    """Tokens/s of each burst of ``tokens`` calls of ``steps[variant]`` (each returns the tokens it gave), the
    variants in turn, the order alternating with ``rep + burst``. ``settle`` runs after each burst, untimed (e.g.
    waits for the step an asynchronous decoder left in flight, so that no burst pays another's)."""
    rates: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for burst in range(bursts):
        for variant in VARIANTS if (rep + burst) % 2 == 0 else VARIANTS[::-1]:
            start = time.perf_counter()
            count = sum(steps[variant]() for _ in range(tokens))
            rates[variant].append(count / (time.perf_counter() - start))
            settle()
    return rates


def paired_ratio(rates: dict[str, list[float]]) -> float:
    """The median over bursts of optimize / plain tokens/s, burst by burst."""
    return statistics.median(o / p for p, o in zip(rates["plain"], rates["optimize"]))


def medians_ratio(rates: dict[str, list[float]]) -> float:
    """The ratio of the two medians: optimize / plain."""
    return statistics.median(rates["optimize"]) / statistics.median(rates["plain"])


def floor_lines(paired: list[float], medians: list[float], floor: float = 0.95) -> str:
    """The minimum of each ratio over every row, against ``floor``."""
    lines = []
    for label, values in (("paired ratio", paired), ("ratio of medians", medians)):
        least = min(values)
        lines.append(f"minimum {label} {least:.2f}: {'at or above' if least >= floor else 'BELOW'} the {floor} floor")
    return "\n".join(lines)
