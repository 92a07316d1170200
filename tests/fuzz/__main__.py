"""``python -m tests.fuzz [--n N] [--seed S] [--kinds sdpa,qsa,...] [--replay KIND:CHOICES]``: fuzz, print the rate."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from .runner import KINDS, fuzz, replay, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--n", type=int, default=2000, help="cases to run (kinds take turns)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    parser.add_argument("--max-failures", type=int, default=1, help="stop after this many (shrunk) failures")
    parser.add_argument("--jobs", type=int, default=1, help="processes (cases are split between them)")
    parser.add_argument("--shrink-seconds", type=float, default=60.0)
    parser.add_argument("--replay", metavar="KIND:CHOICES", help="rebuild and check one printed case")
    args = parser.parse_args(argv)
    if args.replay:
        kind, _, choices = args.replay.partition(":")
        outcome = replay(kind, [int(x) for x in choices.split(",") if x], text=True)
        print(report(outcome) if outcome.failure else f"// passes:\n{outcome.reproducer}")
        return 1 if outcome.failure else 0
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    applied: Counter = Counter()
    failures, seconds = fuzz(
        args.n, args.seed, kinds, jobs=args.jobs, shrink_seconds=args.shrink_seconds, max_failures=args.max_failures,
        progress_every=1000, applied=applied,
    )  # fmt: skip
    for outcome in failures:
        print(report(outcome), end="\n\n")
    rewrites = ", ".join(f"{name} {count}" for name, count in sorted(applied.items())) or "none"
    if failures:
        print(f"// fuzz: stopped after {len(failures)} failure(s), seed {args.seed}, {seconds:.1f} s")
    else:
        print(
            f"// fuzz: {args.n} cases, seed {args.seed}, no failure, {seconds:.1f} s ({args.n / seconds:.1f} cases/s)"
        )
    print(f"// rewrites applied: {rewrites}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
