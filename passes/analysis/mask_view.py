"""How a mask root is read as sdpa's ``[B, Hq, S, T]`` mask: the layout ops that lay it out, proven on factors.

A mask reaches the scores through layout ops (and implicit broadcasting) with its axes in the source's order,
which need not be sdpa's: JAX's ``dot_product_attention`` with grouped heads vmaps its core over the group, so a
combined mask comes out ``[G, B, Hkv, S, T]`` while sdpa's query head is ``h = kv * G + g``. :func:`mask_view`
takes the factor pairs the matcher proved (each factor of the mask root beside the score factor it walks, as
``(score atom, root atom)``) and returns the :class:`MaskView` that lays the root out in sdpa's order: each root
axis split into its factors, the factors transposed into score order, the factors of a head (or batch, row, key)
axis the root does not vary over broadcast where it varies over others of that axis, then one reshape. Every
element of the result is the mask element the source pairs with that score, so the sdpa computes the source's
function exactly. Query rows and keys must be the root's last factors, in order (``[..., S, T]``); a mask that
reorders them is declined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import layout_algebra as la
from .layout_algebra import Atom

ROLE_NAMES = ("b", "h", "s", "t")  # the axes of sdpa's mask [B, Hq, S, T]


@dataclass(frozen=True)
class MaskView:
    """A mask root reshaped to ``split``, transposed by ``perm``, reshaped to ``spread`` (1 where the root is
    broadcast), broadcast to ``digits`` and reshaped to ``shape4`` (which broadcasts onto [B, Hq, S, T]).
    :attr:`reordered` False: one reshape to ``shape4`` does it (the root's factors already in sdpa's order)."""

    shape4: tuple[int, ...]
    split: tuple[int, ...] = ()
    perm: tuple[int, ...] = ()
    spread: tuple[int, ...] = ()
    digits: tuple[int, ...] = ()

    @property
    def reordered(self) -> bool:
        return list(self.perm) != sorted(self.perm) or self.spread != self.digits


def mask_view(shape: Sequence[int], pairs: Sequence[tuple[Atom, Atom]], sizes: Sequence[int]) -> MaskView | str:
    """The view of a mask root of ``shape`` whose factors walk the scores as ``pairs`` (score atom, root atom;
    score atoms name the roles of [B, Hq, S, T] of ``sizes``), or why it is not one (the words after the root)."""
    split: list[int] = []  # indices into pairs, the root's factors major first
    for axis, size in enumerate(shape):
        mine = sorted((i for i, (_sa, ma) in enumerate(pairs) if ma.axis == axis), key=lambda i: -pairs[i][1].stride)
        if size > 1 and not la.covers([pairs[i][1] for i in mine], size):
            return f"axis {axis} (size {size}) is not read exactly once by the scores"
        split += mine if size > 1 else []
    roles = [pairs[i][0].axis for i in split]
    lead = next((n for n, role in enumerate(roles) if role in (2, 3)), len(split))
    rows_keys = [(pairs[i][0].axis, -pairs[i][0].stride) for i in split[lead:]]
    if any(role not in (2, 3) for role in roles[lead:]) or rows_keys != sorted(rows_keys):
        shown = ", ".join(ROLE_NAMES[role] for role in roles)
        return (
            f"walks the score axes ({shown}) in this order; sdpa masks are laid out [..., S, T]: a mask whose query "
            "rows and keys are not its last axes in that order is not raised (its batch and heads may come in any order)"
        )
    shape4, digits = [1, 1, 1, 1], []  # digits: (size, position in split or None for a broadcast factor)
    for role, full in enumerate(sizes):
        mine = sorted((i for i in split if pairs[i][0].axis == role), key=lambda i: -pairs[i][0].stride)
        if not mine:
            continue  # the root does not vary over this axis: sdpa broadcasts it
        shape4[role], top = full, full
        for i in mine:
            sa = pairs[i][0]
            span = sa.stride * sa.size
            if top % span:
                return f"walks {ROLE_NAMES[role]} factors {sa.size} x stride {sa.stride} that overlap another"
            digits += [(top // span, None)] if top > span else []
            digits.append((sa.size, split.index(i)))
            top = sa.stride
        digits += [(top, None)] if top > 1 else []
    return MaskView(
        tuple(shape4),
        tuple(pairs[i][1].size for i in split),
        tuple(at for _n, at in digits if at is not None),
        tuple(n if at is not None else 1 for n, at in digits),
        tuple(n for n, _at in digits),
    )


__all__ = ["MaskView", "mask_view"]
