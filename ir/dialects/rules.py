"""Helpers the op dialects' shape rules share: dtype families, axis normalisation, broadcasting."""

from __future__ import annotations

import numpy as np

from attnpass.ir.core.types import FLOAT_DTYPES, DType, ShapeError, TensorType

FLOATS = FLOAT_DTYPES
NUMERIC = FLOATS + (DType.int32,)


def describe_types(ts: list[TensorType]) -> str:
    """Operand types for an error message: ``f32[2,3], f32[3]``."""
    return ", ".join(str(t) for t in ts)


def normalize_axis(op: str, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"{op}: axis {axis} out of range for rank {rank} (valid: {-rank}..{rank - 1})")
    return axis % rank


def broadcast_shapes(op: str, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        shown = ", ".join("[" + ",".join(map(str, s)) + "]" for s in shapes)
        raise ShapeError(f"{op}: shapes {shown} do not broadcast (numpy broadcasting rules)") from None


def require_dtype(op: str, t: TensorType, allowed: tuple[DType, ...], what: str = "operand") -> None:
    if t.dtype not in allowed:
        valid = ", ".join(d.value for d in allowed)
        raise ShapeError(f"{op}: {what} has dtype {t.dtype.value} ({t}); valid: {valid}")


def same_dtype(op: str, ts: list[TensorType]) -> DType:
    dtypes = {t.dtype for t in ts}
    if len(dtypes) != 1:
        raise ShapeError(f"{op}: operands must share one dtype, got {describe_types(ts)}; insert a cast")
    return ts[0].dtype
