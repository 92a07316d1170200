"""The one coverage check of attention_match (scores and P·V output): the first role not enumerated exactly once.

The oracle enumerates every coordinate the atoms of a role walk and compares
with ``range(size)``; it does not use the layout algebra's ``covers``.
"""

from __future__ import annotations

import itertools

import pytest

from attnpass.passes.analysis.attention_match import _uncovered
from attnpass.passes.analysis.layout_algebra import Atom, root_layout


def oracle(layout, sizes) -> int | None:
    for role, size in enumerate(sizes):
        atoms = [a for axis in layout for a in axis if a.axis == role]
        steps = itertools.product(*(range(a.size) for a in atoms))
        coords = sorted(sum(i * a.stride for i, a in zip(idx, atoms)) for idx in steps)
        if coords != list(range(size)):
            return role
    return None


A = Atom
CASES = [
    (root_layout((2, 4, 3, 5)), (2, 4, 3, 5)),
    ((((A(1, 2, 2), A(0, 2, 1)), (A(1, 2, 1),), (A(2, 3, 1),), (A(3, 5, 1),))), (2, 4, 3, 5)),  # split, reordered heads
    (((A(0, 2, 1),), (A(1, 4, 1),), (A(2, 3, 1),), (A(3, 5, 1), A(3, 5, 1))), (2, 4, 3, 5)),  # keys walked twice
    (((A(0, 2, 1),), (A(1, 2, 1),), (A(2, 3, 1),), (A(3, 5, 1),)), (2, 4, 3, 5)),  # half the heads
    (((A(0, 2, 1),), (A(1, 4, 2),), (A(2, 3, 1),), (A(3, 5, 1),)), (2, 4, 3, 5)),  # every other head
    (((A(0, 2, 1),), (A(1, 4, 1),), (A(None, 3, 0),), (A(3, 5, 1),)), (2, 4, 3, 5)),  # rows broadcast, never walked
    (root_layout((1, 4, 1, 5)), (1, 4, 1, 5)),  # size-1 roles have no atoms
]


@pytest.mark.parametrize("layout, sizes", CASES)
def test_uncovered_names_the_first_role_not_walked_exactly_once(layout, sizes):
    assert _uncovered(layout, sizes) == oracle(layout, sizes)


def test_the_cases_reach_both_answers():
    assert {oracle(*c) for c in CASES} == {None, 1, 2, 3}
