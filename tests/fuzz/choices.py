"""Choice sequences: every random decision of a generator is one recorded integer, so a case can be replayed and shrunk.

A generator draws through :class:`Choices` only (``below``, ``int``, ``pick``,
``flag``). Each draw records an index in ``[0, n)`` where index 0 is the
simplest option. Replaying a recorded sequence rebuilds the same case;
replaying an edited one (shorter, or with smaller entries) builds a simpler
case, and a draw past its end takes index 0. Every sequence is therefore a
valid case, which is what :func:`shrink` relies on (the approach of
Hypothesis's internals, written small).
"""

from __future__ import annotations

import random
import time
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


class Choices:
    """Draws from ``rng``, or replays ``prefix`` (then index 0) when ``rng`` is None; ``record`` is what was drawn."""

    def __init__(self, rng: random.Random | None = None, prefix: Sequence[int] = ()) -> None:
        self.rng = rng
        self.prefix = list(prefix)
        self.record: list[int] = []

    def below(self, n: int, weights: Sequence[float] | None = None) -> int:
        """An index in ``[0, n)``: uniform, or by ``weights``, when drawing fresh."""
        i = len(self.record)
        if i < len(self.prefix):
            value = min(self.prefix[i], n - 1)
        elif self.rng is None or n == 1:
            value = 0
        elif weights is None:
            value = self.rng.randrange(n)
        else:
            value = self.rng.choices(range(n), weights)[0]
        self.record.append(value)
        return value

    def int(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]``, shrinking toward ``lo``."""
        return lo + self.below(hi - lo + 1)

    def pick(self, options: Sequence[T], weights: Sequence[float] | None = None) -> T:
        """One of ``options``, shrinking toward the first."""
        return options[self.below(len(options), weights)]

    def flag(self, p: float = 0.5) -> bool:
        """True with probability ``p``, shrinking toward False."""
        return bool(self.below(2, (1 - p, p)))


def shrink(
    record: Sequence[int], fails: Callable[[Sequence[int]], Sequence[int] | None], *, seconds: float = 60.0
) -> list[int]:
    """A shorter/smaller sequence that still fails; ``fails(seq)`` returns the record it consumed, or None.

    Passes, repeated until none helps or ``seconds`` run out: delete blocks of
    8, 4, 2 and 1 entries; zero blocks; lower each entry (halving, then by one).
    """
    best = list(record)
    deadline = time.monotonic() + seconds

    def attempt(candidate: list[int]) -> bool:
        nonlocal best
        if time.monotonic() > deadline or (len(candidate), candidate) >= (len(best), best):
            return False
        consumed = fails(candidate)
        if consumed is None:
            return False
        best = list(consumed)
        return True

    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for size in (8, 4, 2, 1):
            i = len(best) - size
            while i >= 0:
                if attempt(best[:i] + best[i + size :]) or attempt(best[:i] + [0] * size + best[i + size :]):
                    improved = True
                i -= 1
        for i in range(len(best)):
            while i < len(best) and best[i] > 0:
                if not (
                    attempt(best[:i] + [best[i] // 2] + best[i + 1 :])
                    or attempt(best[:i] + [best[i] - 1] + best[i + 1 :])
                ):
                    break
                improved = True
    return best
