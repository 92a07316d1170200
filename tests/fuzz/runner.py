"""The fuzz loop: case ``i`` of seed ``s`` is drawn from its own ``random.Random`` (reproducible alone), checked,
and on failure shrunk to a small reproducer printed as graph text, pipeline text and inputs.

A differential case draws its pipeline first, then its options, then the
graph of its family (families take turns by index), so shrinking the graph
leaves the pipeline alone. A JSON case mutates the JSON of a generated graph
(:mod:`.json_mutation`). Shrinking keeps the failure's kind (a crash stays a
crash) and replays in :func:`replay`, which ``python -m tests.fuzz --replay``
calls with the printed choice sequence.
"""

from __future__ import annotations

import random
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence, TextIO

import numpy as np

from .choices import Choices, shrink
from .differential import Failure, check, describe
from .families import FAMILIES
from .json_mutation import check_loader, known_loader_crash, mutated_json
from .pipelines import random_pipeline

KINDS = (*FAMILIES, "json")
# The passes each family is written for, drawn more often in its pipelines (every registered pass still takes part).
FAVOURITES = {
    "sdpa": ("head-chunk", "narrow-inputs"),
    "chain": ("head-chunk", "dce"),
    "decomposed": ("raise-attention",),
    "qsa": ("qsa-gather", "dce", "narrow-inputs"),
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


def fuzz(
    n: int,
    seed: int = 0,
    kinds: Sequence[str] = KINDS,
    *,
    shrink_seconds: float = 60.0,
    max_failures: int = 1,
    progress: Callable[[int, float], None] | None = None,
    applied: Counter | None = None,
) -> tuple[list[Outcome], float]:
    """Run ``n`` cases, kinds taking turns; returns the shrunk failures (at most ``max_failures``) and the seconds.

    ``applied`` counts the rewrites the differential cases made, per pass, and the known loader crashes
    (:data:`~tests.fuzz.json_mutation.KNOWN_LOADER_CRASHES`, not failures) under ``known loader crash``.
    """
    failures: list[Outcome] = []
    start = time.perf_counter()
    for i in range(n):
        outcome = run_case(kinds[i % len(kinds)], seed, i, applied)
        if outcome.failure is not None and known_loader_crash(outcome.failure):
            if applied is not None:
                applied["known loader crash"] += 1
        elif outcome.failure is not None:
            failures.append(minimise(outcome, shrink_seconds))
            if len(failures) >= max_failures:
                break
        if progress is not None:
            progress(i + 1, time.perf_counter() - start)
    return failures, time.perf_counter() - start


def print_progress(stream: TextIO, every: int = 1000) -> Callable[[int, float], None]:
    def show(done: int, seconds: float) -> None:
        if done % every == 0:
            print(f"// {done} cases in {seconds:.1f} s ({done / seconds:.1f} cases/s)", file=stream, flush=True)

    return show
