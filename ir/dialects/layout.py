"""Layout ops (no arithmetic): cast, reshape, transpose, slice, concat, take, take_along_axis, broadcast_to,
put_along_axis, dynamic_update_slice, ..."""

from __future__ import annotations

from math import prod

from attnpass.ir.core.registry import OpDef, attr, operand, register, var_operand
from attnpass.ir.core.types import DType, ShapeError, TensorType

from .rules import broadcast_shapes, describe_types, normalize_axis, require_dtype, same_dtype


def _infer_cast(ts, *, dtype):
    return TensorType(ts[0].shape, dtype)


def _infer_reshape(ts, *, shape):
    (x,) = ts
    if any(d < 0 for d in shape):
        raise ShapeError(f"reshape: target shape {list(shape)} has negative dims (resolve -1 before building)")
    if prod(shape) != x.size:
        raise ShapeError(f"reshape: cannot reshape {x} ({x.size} elements) to {list(shape)} ({prod(shape)} elements)")
    return TensorType(shape, x.dtype)


def _infer_transpose(ts, *, perm):
    (x,) = ts
    if sorted(perm) != list(range(x.rank)):
        raise ShapeError(f"transpose: perm {list(perm)} is not a permutation of 0..{x.rank - 1} for operand {x}")
    return TensorType(tuple(x.shape[p] for p in perm), x.dtype)


def _infer_slice(ts, *, start, stop, step):
    (x,) = ts
    if not len(start) == len(stop) == len(step) == x.rank:
        raise ShapeError(
            f"slice: start/stop/step need one entry per axis of {x}, got "
            f"start={list(start)} stop={list(stop)} step={list(step)}"
        )
    dims = []
    for axis, (lo, hi, st, n) in enumerate(zip(start, stop, step, x.shape)):
        if st < 1 or not 0 <= lo <= n or not lo <= hi <= n:
            raise ShapeError(
                f"slice: axis {axis} of {x}: start={lo} stop={hi} step={st} invalid "
                f"(need 0 <= start <= stop <= {n} and step >= 1)"
            )
        dims.append(-(-(hi - lo) // st))
    return TensorType(tuple(dims), x.dtype)


def _infer_concat(ts, *, axis):
    first = ts[0]
    ax = normalize_axis("concat", axis, first.rank)
    same_dtype("concat", ts)
    for t in ts[1:]:
        if t.rank != first.rank or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != ax):
            raise ShapeError(f"concat: operands {describe_types(ts)} differ outside axis {axis}")
    shape = list(first.shape)
    shape[ax] = sum(t.shape[ax] for t in ts)
    return TensorType(tuple(shape), first.dtype)


def _infer_take(ts, *, axis):
    x, idx = ts
    require_dtype("take", idx, (DType.int32,), "indices")
    if x.rank == 0:
        raise ShapeError(f"take: operand {x} is a scalar; need rank >= 1")
    ax = normalize_axis("take", axis, x.rank)
    return TensorType(x.shape[:ax] + idx.shape + x.shape[ax + 1 :], x.dtype)


register(OpDef("cast", (operand("x"),), _infer_cast, {"dtype": attr("dtype")}, "layout", "Convert to dtype."))
register(OpDef("reshape", (operand("x"),), _infer_reshape, {"shape": attr("ints")}, "layout", "Row-major reshape."))
register(OpDef("transpose", (operand("x"),), _infer_transpose, {"perm": attr("ints")}, "layout", "Permute axes."))
register(
    OpDef(
        "slice",
        (operand("x"),),
        _infer_slice,
        {"start": attr("ints"), "stop": attr("ints"), "step": attr("ints")},
        "layout",
        "Static strided slice x[start:stop:step] per axis (positive steps, bounds already clamped).",
    )
)
register(
    OpDef("concat", (var_operand("xs"),), _infer_concat, {"axis": attr("int")}, "layout", "Concatenate along axis.")
)
register(
    OpDef(
        "take",
        (operand("x"), operand("indices")),
        _infer_take,
        {"axis": attr("int")},
        "layout",
        "numpy.take: gather along axis by int32 indices, which must lie in [0, dim).",
    )
)


def _infer_broadcast_to(ts, *, shape):
    (x,) = ts
    if any(d < 0 for d in shape):
        raise ShapeError(f"broadcast_to: target shape {list(shape)} has negative dims")
    padded = (1,) * (len(shape) - x.rank) + x.shape
    if x.rank > len(shape) or any(d not in (1, n) for d, n in zip(padded, shape)):
        raise ShapeError(f"broadcast_to: operand {x} does not broadcast to {list(shape)} (numpy broadcasting rules)")
    return TensorType(tuple(shape), x.dtype)


def _infer_put_along_axis(ts, *, axis):
    x, idx, values = ts
    require_dtype("put_along_axis", idx, (DType.int32,), "indices")
    if values.dtype != x.dtype:
        raise ShapeError(f"put_along_axis: values {values} must have the dtype of x {x}")
    if idx.rank != x.rank:
        raise ShapeError(f"put_along_axis: indices {idx} must have the rank of x {x}")
    ax = normalize_axis("put_along_axis", axis, x.rank)
    if any(i != n and i != 1 for a, (i, n) in enumerate(zip(idx.shape, x.shape)) if a != ax):
        raise ShapeError(f"put_along_axis: indices {idx} do not broadcast against x {x} outside axis {axis}")
    broadcast_shapes("put_along_axis", values.shape, idx.shape)
    return x


register(
    OpDef(
        "broadcast_to",
        (operand("x"),),
        _infer_broadcast_to,
        {"shape": attr("ints")},
        "layout",
        "numpy.broadcast_to: repeat size-1 axes and prepend axes to reach shape (no arithmetic).",
    )
)
register(
    OpDef(
        "put_along_axis",
        (operand("x"), operand("indices"), operand("values")),
        _infer_put_along_axis,
        {"axis": attr("int")},
        "layout",
        "numpy.put_along_axis on a copy of x: indices in [-n, n) (negative ones wrap); values broadcast to "
        "the indices. Writes to one cell must agree, otherwise which one wins is target-defined.",
    )
)


def _infer_take_along_axis(ts, *, axis):
    x, idx = ts
    require_dtype("take_along_axis", idx, (DType.int32,), "indices")
    if x.rank == 0 or idx.rank != x.rank:
        raise ShapeError(f"take_along_axis: indices {idx} must have the rank of x {x} (rank >= 1)")
    ax = normalize_axis("take_along_axis", axis, x.rank)
    outer = broadcast_shapes("take_along_axis", x.shape[:ax] + x.shape[ax + 1 :], idx.shape[:ax] + idx.shape[ax + 1 :])
    return TensorType(outer[:ax] + (idx.shape[ax],) + outer[ax:], x.dtype)


def _infer_dynamic_update_slice(ts):
    buffer, update, start = ts
    same_dtype("dynamic_update_slice", [buffer, update])
    require_dtype("dynamic_update_slice", start, (DType.int32,), "start")
    if update.rank != buffer.rank or any(u > n for u, n in zip(update.shape, buffer.shape)):
        raise ShapeError(f"dynamic_update_slice: update {update} must have the rank of buffer {buffer} and fit in it")
    if start.shape != (buffer.rank,):
        raise ShapeError(
            f"dynamic_update_slice: start {start} must be i32[{buffer.rank}], one index per axis of {buffer}"
        )
    return buffer


register(
    OpDef(
        "take_along_axis",
        (operand("x"), operand("indices")),
        _infer_take_along_axis,
        {"axis": attr("int")},
        "layout",
        "numpy.take_along_axis: out[..., i, ...] = x[..., indices[..., i, ...], ...] along axis; x and indices "
        "broadcast on the other axes; int32 indices must lie in [0, dim).",
    )
)
register(
    OpDef(
        "dynamic_update_slice",
        (operand("buffer"), operand("update"), operand("start")),
        _infer_dynamic_update_slice,
        {},
        "layout",
        "A copy of buffer with update written at the runtime offset start (i32[rank]), each index clamped "
        "to [0, dim - update_dim] as jax.lax.dynamic_update_slice does.",
    )
)


def _infer_iota(ts, *, shape, axis):
    if any(d < 0 for d in shape):
        raise ShapeError(f"iota: shape {list(shape)} has negative dims")
    normalize_axis("iota", axis, len(shape))
    return TensorType(shape, DType.int32)


register(
    OpDef(
        "iota",
        (),
        _infer_iota,
        {"shape": attr("ints"), "axis": attr("int")},
        "layout",
        "int32 positions along axis, broadcast over the other axes (numpy: arange reshaped and broadcast).",
    )
)
