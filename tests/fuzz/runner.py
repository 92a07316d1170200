"""The fuzz loop: case ``i`` of seed ``s`` is drawn from its own ``random.Random`` (reproducible alone), checked,
and on failure shrunk to a small reproducer printed as graph text, pipeline text and inputs.

A differential case draws its pipeline first, then its options, then the
graph of its family (families take turns by index), so shrinking the graph
leaves the pipeline alone. A JSON case mutates the JSON of a generated graph
(:mod:`.json_mutation`). Shrinking keeps the failure's kind (a crash stays a
crash) and replays in :func:`replay`, which ``python -m tests.fuzz --replay``
calls with the printed choice sequence. With ``jobs > 1`` the cases are split
between processes (case ``i`` goes to process ``i % jobs``), and the failing
case of lowest index is shrunk.
"""

from __future__ import annotations

import multiprocessing
import random
import re
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .choices import Choices, shrink
from .differential import Failure, check, describe
from .families import FAMILIES
from .json_mutation import check_loader, mutated_json
from .pipelines import random_pipeline

KINDS = (*FAMILIES, "json")
# The passes each family is written for, drawn more often in its pipelines (every registered pass still takes part).
FAVOURITES = {
    "sdpa": ("head-chunk", "narrow-inputs", "decompose-sdpa"),
    "chain": ("head-chunk", "dce"),
    "decomposed": ("raise-attention",),
    "qsa": ("qsa-gather", "qsa-pool-cache", "dce", "narrow-inputs"),
    "mla": ("mla-absorb", "dsa-gather", "dce"),
    "partial": ("raise-attention",),
}


@dataclass(frozen=True)
class Outcome:
    """One case: its kind, the choices that built it, the failure (or None) and its reproducer text."""

    kind: str
    record: tuple[int, ...]
    failure: Failure | None
    reproducer: str


def _differential(kind: str, c: Choices, applied: Counter | None, text: bool) -> tuple[Failure | None, str]:
    pipeline = random_pipeline(c, FAVOURITES[kind])
    fixed_point = c.flag(0.15)
    case = FAMILIES[kind](c)
    failure = check(case, pipeline, fixed_point=fixed_point, applied=applied)
    return failure, describe(case, pipeline, fixed_point) if failure or text else ""


def _json(c: Choices) -> tuple[Failure | None, str]:
    text = mutated_json(c)
    return check_loader(text), _abridged(text)


def _abridged(text: str) -> str:
    """``text`` with long runs of one character written as ``«[ x3000»``."""
    return re.sub(r"(.)\1{19,}", lambda m: f"«{m.group(1)} x{len(m.group(0))}»", text)


def replay(
    kind: str,
    record: Sequence[int] = (),
    rng: random.Random | None = None,
    applied: Counter | None = None,
    *,
    text: bool = False,
) -> Outcome:
    """Build and check the case of ``kind`` from ``record`` (or fresh draws from ``rng``); see :func:`check`.

    The outcome's reproducer text is written for a failure, or always with ``text``.
    """
    c = Choices(rng, record)
    with warnings.catch_warnings(), np.errstate(all="ignore"):  # NaN rows are compared, not reported twice
        warnings.simplefilter("ignore", RuntimeWarning)
        failure, shown = _json(c) if kind == "json" else _differential(kind, c, applied, text)
    return Outcome(kind, tuple(c.record), failure, shown)


def run_case(kind: str, seed: int, index: int, applied: Counter | None = None) -> Outcome:
    return replay(kind, rng=random.Random(f"{seed}:{kind}:{index}"), applied=applied)


def minimise(outcome: Outcome, seconds: float = 60.0) -> Outcome:
    """The simplest case found in ``seconds`` that fails with the same kind of failure."""
    assert outcome.failure is not None

    def fails(record: Sequence[int]) -> Sequence[int] | None:
        again = replay(outcome.kind, record)
        return again.record if again.failure and again.failure.kind == outcome.failure.kind else None

    return replay(outcome.kind, shrink(outcome.record, fails, seconds=seconds))


def report(outcome: Outcome) -> str:
    """A failure as printed: what failed, the reproducer and the replay command."""
    choices = ",".join(map(str, outcome.record))
    return (
        f"FAIL [{outcome.kind}] {outcome.failure.kind}: {outcome.failure.message}\n{outcome.reproducer}\n"
        f"replay: python -m tests.fuzz --replay {outcome.kind}:{choices}"
    )


def _scan(
    n: int, seed: int, kinds: Sequence[str], first: int, step: int, max_failures: int, every: int
) -> tuple[list[tuple[int, Outcome]], Counter]:
    """Cases ``first, first + step, ...`` below ``n``: the failing ones (unshrunk, up to ``max_failures``), counts."""
    failed: list[tuple[int, Outcome]] = []
    applied: Counter = Counter()
    start = time.perf_counter()
    for done, i in enumerate(range(first, n, step), 1):
        outcome = run_case(kinds[i % len(kinds)], seed, i, applied)
        if outcome.failure is not None:
            failed.append((i, outcome))
            if len(failed) >= max_failures:
                break
        if every and done % every == 0:
            who = f"worker {first}: " if step > 1 else ""
            seconds = time.perf_counter() - start
            print(
                f"// {who}{done} cases in {seconds:.1f} s ({done / seconds:.1f} cases/s)", file=sys.stderr, flush=True
            )
    return failed, applied


def fuzz(
    n: int,
    seed: int = 0,
    kinds: Sequence[str] = KINDS,
    *,
    jobs: int = 1,
    shrink_seconds: float = 60.0,
    max_failures: int = 1,
    progress_every: int = 0,
    applied: Counter | None = None,
) -> tuple[list[Outcome], float]:
    """Run ``n`` cases, kinds taking turns, in ``jobs`` processes; returns the shrunk failures and the seconds.

    At most ``max_failures`` failures (the first by case index) are shrunk and returned. ``applied`` counts
    the rewrites the differential cases made, per pass.
    """
    start = time.perf_counter()
    scans = [(n, seed, tuple(kinds), j, jobs, max_failures, progress_every) for j in range(jobs)]
    if jobs == 1:
        parts = [_scan(*scans[0])]
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            parts = pool.starmap(_scan, scans)
    for _failed, counts in parts:
        if applied is not None:
            applied.update(counts)
    first = sorted((i, o) for failed, _counts in parts for i, o in failed)[:max_failures]
    return [minimise(o, shrink_seconds) for _i, o in first], time.perf_counter() - start
