"""Symbolic layouts: which coordinates of a *root* tensor each axis of a derived tensor walks.

A value reached from a root through ``transpose``/``reshape``/``broadcast_to``
reads the root's elements in a pattern that a :data:`Layout` describes
exactly: per axis, a list of :class:`Atom` (major to minor), each walking
``size`` steps of ``stride`` along one root axis (or none: a broadcast). The
algebra is O(rank) whatever the tensor sizes, so a matcher can prove what a
chain of layout ops does to a ``[B, H, S, D]`` tensor of any length.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

LAYOUT_OPS = frozenset({"transpose", "reshape", "broadcast_to"})


@dataclass(frozen=True)
class Atom:
    """``size`` steps of ``stride`` along root axis ``axis`` (``axis`` None: a broadcast, stride 0)."""

    axis: int | None
    size: int
    stride: int


Layout = tuple[tuple[Atom, ...], ...]


def root_layout(shape: Sequence[int]) -> Layout:
    return tuple((Atom(a, n, 1),) if n > 1 else () for a, n in enumerate(shape))


def normalize(atoms: Sequence[Atom]) -> tuple[Atom, ...]:
    """Merge neighbours that walk one root axis contiguously (or are both broadcasts)."""
    out: list[Atom] = []
    for a in atoms:
        if a.size == 1:
            continue
        if out and out[-1].axis == a.axis and (a.axis is None or out[-1].stride == a.stride * a.size):
            prev = out.pop()
            a = Atom(a.axis, prev.size * a.size, a.stride)
        out.append(a)
    return tuple(out)


def transpose(layout: Layout, perm: Sequence[int]) -> Layout:
    return tuple(layout[p] for p in perm)


def _take(atoms: deque, need: int) -> list[Atom] | None:
    """Pop atoms worth ``need`` elements from the front, splitting one if needed (None: not a regrouping)."""
    group = []
    while need > 1:
        if not atoms:
            return None
        a = atoms.popleft()
        if a.size <= need:
            if need % a.size:
                return None
            group.append(a)
            need //= a.size
        else:
            if a.size % need:
                return None
            minor = a.size // need
            group.append(Atom(a.axis, need, a.stride * minor))
            atoms.appendleft(Atom(a.axis, minor, a.stride))
            need = 1
    return group


def reshape(layout: Layout, shape: Sequence[int]) -> Layout | None:
    """The layout after a row-major reshape, or None when the reshape mixes atoms unevenly."""
    atoms = deque(a for axis in layout for a in axis)
    out = []
    for n in shape:
        group = _take(atoms, n)
        if group is None:
            return None
        out.append(normalize(group))
    return tuple(out) if not atoms else None


def broadcast(layout: Layout, shape: Sequence[int]) -> Layout:
    """numpy broadcasting to ``shape``: new or size-1 axes become broadcast atoms."""
    lead = len(shape) - len(layout)
    padded = ((),) * lead + tuple(layout)
    out = []
    for atoms, n in zip(padded, shape):
        out.append(atoms if atoms or n == 1 else (Atom(None, n, 0),))
    return tuple(out)


def refine(left: Sequence[Atom], right: Sequence[Atom]) -> list[tuple[Atom | None, Atom | None]] | None:
    """Pair two atom lists of one axis into common factors (None: the sides do not split alike).

    A side with no atoms (size 1, or broadcast) pairs None with every factor of the other.
    """
    real_l = [a for a in left if a.axis is not None]
    real_r = [a for a in right if a.axis is not None]
    if not real_l or not real_r:
        lone = [(a, None) for a in real_l] + [(None, a) for a in real_r]
        return [(None, None)] if not lone and (left or right) else lone
    pairs = common_factors(left, right)
    if pairs is None:
        return None
    return [
        (a if a is None or a.axis is not None else None, b if b is None or b.axis is not None else None)
        for a, b in pairs
    ]


def common_factors(left: Sequence[Atom], right: Sequence[Atom]) -> list[tuple[Atom, Atom]] | None:
    """Two atom lists of one axis (each covering it, broadcasts included) split into common factors, pair by pair
    (None: they do not split alike)."""
    ql, qr = deque(left), deque(right)
    pairs = []
    while ql and qr:
        a, b = ql.popleft(), qr.popleft()
        if a.size == b.size:
            pairs.append((a, b))
            continue
        big, small, queue = (a, b, ql) if a.size > b.size else (b, a, qr)
        if big.size % small.size:
            return None
        minor = big.size // small.size
        head = Atom(big.axis, small.size, big.stride * minor)
        queue.appendleft(Atom(big.axis, minor, big.stride))
        pairs.append((head, small) if big is a else (small, head))
    return None if ql or qr else pairs


def view_plan(layout: Layout, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """How a root of ``shape`` is laid out as ``layout`` (no broadcasts): reshape it to the first
    tuple (each root axis split into its atoms, major first), transpose by the second, then reshape
    to the layout's shape."""
    factors = [a for atoms in layout for a in atoms]
    split = []
    for axis, size in enumerate(shape):
        split += sorted((a for a in factors if a.axis == axis), key=lambda a: -a.stride) if size > 1 else []
    return tuple(a.size for a in split), tuple(split.index(a) for a in factors)


def covers(atoms: Sequence[Atom], size: int) -> bool:
    """Do ``atoms`` (of one root axis) enumerate every coordinate ``0..size-1`` exactly once?"""
    expect = 1
    for a in sorted(atoms, key=lambda a: a.stride):
        if a.stride != expect:
            return False
        expect *= a.size
    return expect == size


__all__ = [
    "LAYOUT_OPS", "Atom", "Layout", "broadcast", "common_factors", "covers", "normalize", "refine", "reshape",
    "root_layout", "transpose", "view_plan",
]  # fmt: skip
