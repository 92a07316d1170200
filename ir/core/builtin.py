"""The builtin ops every graph needs: ``input`` and ``constant`` (registered with the core)."""

from __future__ import annotations

import math
from math import prod

from .registry import OpDef, attr, register
from .types import DType, ShapeError, TensorType


def _check_source_shape(op: str, shape: tuple[int, ...]) -> None:
    if any(d < 0 for d in shape):
        raise ShapeError(f"{op}: shape {list(shape)} has negative dims")


def _infer_input(ts, *, shape, dtype, role, path):
    _check_source_shape("input", shape)
    return TensorType(shape, dtype)


def _infer_constant(ts, *, value, shape, dtype):
    _check_source_shape("constant", shape)
    size = prod(shape)
    if len(value) not in (1, size):
        raise ShapeError(f"constant: {len(value)} values for shape {list(shape)} (need 1 or {size})")
    for v in value:
        if dtype is DType.int32 and not (isinstance(v, int) or (math.isfinite(v) and float(v).is_integer())):
            raise ShapeError(f"constant: value {v!r} is not an integer, but dtype is int32")
        if dtype is DType.bool and v not in (0, 1):
            raise ShapeError(f"constant: value {v!r} is not a bool, but dtype is bool")
    return TensorType(shape, dtype)


register(
    OpDef(
        "input",
        (),
        _infer_input,
        {
            "shape": attr("ints"),
            "dtype": attr("dtype"),
            "role": attr("choice:streamed|resident", "streamed"),
            "path": attr("str?", None),
        },
        "source",
        "A graph input. role: 'streamed' (filled by the host every call) or 'resident' (lives on device). "
        "path: where an imported value came from (a module or pytree path, e.g. model.layers.0.q_proj.weight).",
    )
)
register(
    OpDef(
        "constant",
        (),
        _infer_constant,
        {"value": attr("scalars"), "shape": attr("ints"), "dtype": attr("dtype")},
        "source",
        "A constant tensor: a flat tuple of values in C order, or one value splatted over the shape.",
    )
)
