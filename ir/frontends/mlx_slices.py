"""MLX's slice and gather spellings, normalised to the IR's canonical ones at import.

MLX records ``Slice``/``SliceUpdate`` with the start it normalised but the stop
as written (``x[:, :-1]`` keeps stop = -1, ``x[::-1]`` has stop = -n - 1) and
negative steps as they are; its gathers wrap negative indices. The IR's slice
wants ``0 <= start <= stop <= n`` and steps >= 1, its ``take`` indices in
``[0, n)``. What a slice selects along an axis is fixed by its start, step and
result size alone (MLX computes the size from the stop): element ``k`` is
``start + k * step``. So a slice becomes one IR slice with positive steps, and
a ``take`` of constant indices on each axis MLX walks backwards. A scatter of
single elements (``x[..., ids] = v``) becomes one ``put_along_axis`` on the
flattened array.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from attnpass.ir.core.types import DType

from .importing import GraphBuilder, ModelImportError


def _positions(start: int, step: int, count: int, n: int, where: str, axis: int) -> tuple[int, int]:
    """The first and last position ``start + k * step`` (k < count) on an axis of size ``n``, checked in range."""
    if step == 0:
        raise ModelImportError(f"{where}: slice step 0 on axis {axis}")
    first, last = start, start + (count - 1) * step
    if count and not (0 <= min(first, last) and max(first, last) < n):
        raise ModelImportError(
            f"{where}: axis {axis} of size {n}: positions {first}..{last} (start {start}, step {step}, {count} of "
            f"them) fall outside [0, {n})"
        )
    return first, last


def _reverse(b: GraphBuilder, x: str, axis: int) -> str:
    n = b.type(x).shape[axis]
    if n <= 1:
        return x
    index = b.constant(np.arange(n - 1, -1, -1, dtype=np.int32), DType.int32, "reversed", inline=True)
    return b.op("take", [x, index], {"axis": axis})


def strided_slice(
    b: GraphBuilder, x: str, start: Sequence[int], step: Sequence[int], counts: Sequence[int], where: str
) -> str:
    """``x`` at positions ``start + k * step`` (k < counts) per axis: one IR slice, then reversals."""
    shape = b.type(x).shape
    lows, highs, steps, reversed_axes = [], [], [], []
    for axis, (lo, st, m, n) in enumerate(zip(start, step, counts, shape)):
        first, last = _positions(lo, st, m, n, where, axis)
        lows.append(min(first, last) if m else 0)
        highs.append(max(first, last) + 1 if m else 0)
        steps.append(abs(st) if m > 1 else 1)
        if st < 0 and m > 1:
            reversed_axes.append(axis)
    y = x
    if (tuple(lows), tuple(highs), tuple(steps)) != ((0,) * len(shape), tuple(shape), (1,) * len(shape)):
        y = b.op("slice", [x], {"start": tuple(lows), "stop": tuple(highs), "step": tuple(steps)})
    for axis in reversed_axes:
        y = _reverse(b, y, axis)
    return y


def slice_update(b: GraphBuilder, x: str, update: str, start: Sequence[int], step: Sequence[int], where: str) -> str:
    """``x`` with ``update`` written at positions ``start + k * step`` (k < the update's size) per axis.

    Negative steps become positive ones over the reversed update; unit steps are slices and concats
    (:meth:`GraphBuilder.update_box`); a strided axis is a ``take`` of ``concat([x, written])``.
    """
    shape, counts = b.type(x).shape, b.type(update).shape
    if len(counts) != len(shape):
        raise ModelImportError(f"{where}: the update has rank {len(counts)}, the array {len(shape)}")
    lows, steps = [], []
    for axis, (lo, st, m, n) in enumerate(zip(start, step, counts, shape)):
        first, last = _positions(lo, st, m, n, where, axis)
        if m == 0:
            return x
        if st < 0 and m > 1:
            update = _reverse(b, update, axis)
        lows.append(min(first, last))
        steps.append(abs(st) if m > 1 else 1)
    if all(s == 1 for s in steps):
        return b.update_box(x, update, tuple(lows), tuple(lo + m for lo, m in zip(lows, counts)))
    return _update_strided(b, x, update, lows, steps, 0)


def _update_strided(b: GraphBuilder, x: str, update: str, lows: list[int], steps: list[int], axis: int) -> str:
    """``x`` with ``update`` written at ``lows + k * steps`` on the axes from ``axis`` on (positive steps)."""
    shape = b.type(x).shape
    if axis == len(shape):
        return update
    lo, st, m, n = lows[axis], steps[axis], b.type(update).shape[axis], shape[axis]
    hi = lo + (m - 1) * st + 1
    inner = _update_strided(b, b.slice_axis(x, axis, lo, hi, st), update, lows, steps, axis + 1)
    if (lo, st, m) == (0, 1, n):
        return inner
    # Position p takes row n + k of concat([x, inner]) where p = lo + k * st, else its own row p.
    index = np.arange(n, dtype=np.int32)
    index[lo:hi:st] = n + np.arange(m, dtype=np.int32)
    rows = b.constant(index, DType.int32, "scatter_rows", inline=True)
    return b.op("take", [b.concat([x, inner], axis), rows], {"axis": axis})


_NONNEGATIVE_SOURCES = ("argmax", "argmin", "argpartition", "iota")
_SIGN_KEEPING = ("cast", "reshape", "broadcast_to", "transpose", "slice", "take", "take_along_axis")


def _nonnegative(b: GraphBuilder, value: str) -> bool:
    """Whether ``value``'s elements are >= 0 by construction: an index op, a non-negative constant, or moves of one."""
    node = b.graph.node(value)
    if node.op == "constant":
        return min(node.attrs["value"], default=0) >= 0
    if node.op in _NONNEGATIVE_SOURCES:
        return True
    return node.op in _SIGN_KEEPING and _nonnegative(b, node.inputs[0])


def wrapped_indices(b: GraphBuilder, indices: str, n: int) -> str:
    """int32 ``indices`` into an axis of size ``n`` with MLX's negative ones wrapped (``-1`` is ``n - 1``).

    Constants are wrapped at import; indices non-negative by construction are left alone; others get
    ``where(i < 0, i + n, i)``.
    """
    indices = b.cast(indices, DType.int32)
    if _nonnegative(b, indices):
        return indices
    node = b.graph.node(indices)
    if node.op == "constant":
        flat = np.asarray(node.attrs["value"], np.int64)
        values = np.broadcast_to(flat.reshape(()) if flat.size == 1 else flat.reshape(node.type.shape), node.type.shape)
        return b.constant(np.where(values < 0, values + n, values), DType.int32, "wrapped", inline=True)
    negative = b.op("less", [indices, b.scalar(0, DType.int32)])
    return b.op("where", [negative, b.op("add", [indices, b.scalar(n, DType.int32)]), indices], hint="wrapped")


def point_scatter(
    b: GraphBuilder, x: str, indices: Sequence[str], updates: str, axes: Sequence[int], where: str
) -> str:
    """MLX's ``Scatter`` with plain assignment of single elements (``x[..., ids] = v``: one index array per axis,
    broadcast to one shape, the ellipsis as ``arange``s): each point's flat offset into ``x``, then one
    ``put_along_axis`` on ``x`` flattened. Negative indices wrap; points written twice: the target decides."""
    shape = b.type(x).shape
    index_shape = b.type(indices[0]).shape
    window = b.type(updates).shape[len(index_shape) :]
    if (
        sorted(axes) != list(range(len(shape)))
        or any(b.type(i).shape != index_shape for i in indices)
        or any(size != 1 for size in window)
    ):
        raise ModelImportError(
            f"{where}: only a scatter of single elements with one index array per axis is supported (x[i, j, k] = v)"
        )
    if math.prod(shape) >= 2**31:
        raise ModelImportError(f"{where}: {list(shape)} has 2^31 elements or more, past int32 offsets")
    offset, stride = None, 1
    for axis in sorted(range(len(axes)), key=lambda j: -axes[j]):  # the last axis first: its stride is 1
        term = wrapped_indices(b, indices[axis], shape[axes[axis]])
        if stride != 1:
            term = b.op("mul", [term, b.scalar(stride, DType.int32)])
        offset = term if offset is None else b.op("add", [offset, term])
        stride *= shape[axes[axis]]
    count = math.prod(index_shape)
    flat = b.op("put_along_axis", [b.reshape(x, [stride]), b.reshape(offset, [count]), b.reshape(updates, [count])],
                {"axis": 0})  # fmt: skip
    return b.reshape(flat, list(shape))


__all__ = ["point_scatter", "slice_update", "strided_slice", "wrapped_indices"]
