"""Sharding annotations: how a value is laid out over a named device mesh (GSPMD / Shardy style).

A graph declares its mesh axes in order, each with a size (``graph.mesh_axes``,
e.g. ``{"data": 2, "model": 4}``). A value may carry a sharding: per dimension,
the mesh axis it is split over, or ``None`` (whole on every device along that
axis). A value without an annotation (``Node.sharding is None``) is left to the
partitioner; a graph input without one is replicated. Rules, checked by the
verifier: one entry per dimension, only declared axes, each axis at most once
per value, and every sharded dimension divisible by its axis size (so each
device holds exactly ``1/size`` of it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .types import MAX_DIM, GraphFormatError, check_identifier, short_repr

if TYPE_CHECKING:
    from .graph import Node

Sharding = tuple["str | None", ...]
_MESH_ITEM = re.compile(r"\s*(\w+)\s*=\s*([0-9]{1,20})\s*\Z")


def normalize_sharding(value: Sequence[str | None] | None) -> Sharding | None:
    """``value`` as a tuple, or None when it shards nothing (every entry None)."""
    if value is None:
        return None
    entries = tuple(value)
    return entries if any(e is not None for e in entries) else None


def normalize_mesh(axes: Mapping[str, int] | Sequence[tuple[str, int]]) -> dict[str, int]:
    """Validated mesh axes in order: identifier names, sizes >= 1, no name twice."""
    pairs = list(axes.items()) if isinstance(axes, Mapping) else [tuple(p) for p in axes]
    out: dict[str, int] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise GraphFormatError(f"mesh axis {short_repr(pair)}: expected (name, size)")
        name, size = pair
        check_identifier(name, "mesh axis name")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_DIM:
            raise GraphFormatError(f"mesh axis {name}: size must be an int in [1, {MAX_DIM}], got {short_repr(size)}")
        if name in out:
            raise GraphFormatError(f"mesh axis {name} is declared twice")
        out[name] = size
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2, model=4"`` -> ``{"data": 2, "model": 4}``, ``""`` -> ``{}`` (validated; GraphFormatError when
    malformed, an empty entry such as the trailing one of ``"model=4,"`` included)."""
    if not text.strip():
        return {}
    pairs = []
    items = text.split(",")
    for position, item in enumerate(p.strip() for p in items):
        if not item:
            raise GraphFormatError(
                f"mesh axis entry {position + 1} of {len(items)} in {short_repr(text)} is empty; expected "
                "name=size entries separated by commas, e.g. data=2,model=4"
            )
        m = _MESH_ITEM.match(item)
        if not m:
            raise GraphFormatError(f"malformed mesh axis {short_repr(item)}; expected name=size, e.g. model=4")
        pairs.append((m.group(1), int(m.group(2))))
    return normalize_mesh(pairs)


def sharding_problem(node: Node, mesh_axes: Mapping[str, int]) -> str | None:
    """Why ``node``'s sharding is invalid on a mesh with ``mesh_axes``, or None when it is valid."""
    sharding = node.sharding
    if sharding is None:
        return None
    shape = node.type.shape
    if len(sharding) != len(shape):
        return f"sharding {format_sharding(sharding)} has {len(sharding)} entries for rank {len(shape)}"
    seen: set[str] = set()
    for dim, (size, axis) in enumerate(zip(shape, sharding)):
        if axis is None:
            continue
        if not isinstance(axis, str) or axis not in mesh_axes:
            declared = ", ".join(mesh_axes) or "none"
            return (
                f"dimension {dim} is sharded over {short_repr(axis)}, which is not a mesh axis of the graph "
                f"(declared: {declared})"
            )
        if axis in seen:
            return f"mesh axis {axis} shards more than one dimension"
        seen.add(axis)
        if size % mesh_axes[axis]:
            return f"dimension {dim} of size {size} does not divide over mesh axis {axis} of size {mesh_axes[axis]}"
    return None


def format_sharding(sharding: Sharding | None) -> str:
    """``(_, model, _, _)``: one entry per dimension, ``_`` for unsharded."""
    if sharding is None:
        return "(unannotated)"
    return "(" + ", ".join(a if a is not None else "_" for a in sharding) + ")"


def decode_sharding(raw: Any, where: str) -> Sharding | None:
    """A JSON sharding (a list of axis names and nulls) as a tuple; GraphFormatError when malformed."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(a is None or isinstance(a, str) for a in raw):
        raise GraphFormatError(f"{where}: sharding must be a list of mesh axis names and nulls, got {short_repr(raw)}")
    return normalize_sharding(raw)


__all__ = [
    "Sharding", "decode_sharding", "format_sharding", "normalize_mesh", "normalize_sharding", "parse_mesh",
    "sharding_problem",
]  # fmt: skip
