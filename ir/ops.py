"""The functions a traced model calls: ``from attnpass.ir import ops``.

Each builds one node of the op set in :mod:`attnpass.ir.opdefs` (a few are
composites of several). Python scalars are accepted wherever a broadcastable
tensor fits and take the other operand's dtype.
"""

from __future__ import annotations

from math import prod
from typing import Any, Sequence

from .opdefs import normalize_axis
from .tracer import Tensor, binary, constant, emit, promote
from .types import DType, ShapeError

__all__ = [
    "add", "sub", "mul", "div", "maximum", "neg", "exp", "relu", "cast", "reshape", "transpose",
    "slice", "concat", "take", "where", "sum", "max", "matmul", "softmax", "sdpa", "constant",
]  # fmt: skip


def add(x: Any, y: Any) -> Tensor:
    return binary("add", x, y)


def sub(x: Any, y: Any) -> Tensor:
    return binary("sub", x, y)


def mul(x: Any, y: Any) -> Tensor:
    return binary("mul", x, y)


def div(x: Any, y: Any) -> Tensor:
    return binary("div", x, y)


def maximum(x: Any, y: Any) -> Tensor:
    return binary("maximum", x, y)


def neg(x: Tensor) -> Tensor:
    return emit("neg", [x])


def exp(x: Tensor) -> Tensor:
    return emit("exp", [x])


def relu(x: Tensor) -> Tensor:
    return emit("relu", [x])


def cast(x: Tensor, dtype: DType | str) -> Tensor:
    return emit("cast", [x], {"dtype": DType.parse(dtype)})


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Row-major reshape; one dimension may be -1."""
    shape = tuple(int(d) for d in shape)
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape: at most one -1 in {list(shape)}")
    if -1 in shape:
        known = prod(d for d in shape if d != -1)
        if known == 0 or x.type.size % known:
            raise ShapeError(f"reshape: cannot infer -1 in {list(shape)} for {x.type}")
        shape = tuple(x.type.size // known if d == -1 else d for d in shape)
    return emit("reshape", [x], {"shape": shape})


def transpose(x: Tensor, perm: Sequence[int] | None = None) -> Tensor:
    """Permute axes (default: reverse them)."""
    perm = tuple(reversed(range(x.ndim))) if perm is None else tuple(int(p) for p in perm)
    return emit("transpose", [x], {"perm": perm})


def slice(x: Tensor, start: Sequence[int], stop: Sequence[int], step: Sequence[int] | None = None) -> Tensor:
    """Static strided slice with explicit per-axis bounds."""
    step = (1,) * x.ndim if step is None else tuple(step)
    return emit("slice", [x], {"start": tuple(start), "stop": tuple(stop), "step": step})


def concat(xs: Sequence[Tensor], axis: int = 0) -> Tensor:
    return emit("concat", list(xs), {"axis": int(axis)})


def take(x: Tensor, indices: Tensor, axis: int = 0) -> Tensor:
    """Gather along ``axis`` by int32 ``indices`` (numpy.take semantics; indices in range)."""
    return emit("take", [x, indices], {"axis": int(axis)})


def where(cond: Tensor, x: Any, y: Any) -> Tensor:
    """``cond ? x : y``; one of x, y may be a Python scalar (it takes the other's dtype)."""
    like = x if isinstance(x, Tensor) else y
    if not isinstance(like, Tensor):
        raise ShapeError("where: x or y must be a traced tensor (both are Python scalars)")
    return emit("where", [cond, promote(x, like), promote(y, like)])


def _axes(x: Tensor, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(x.ndim))
    return (int(axis),) if isinstance(axis, int) else tuple(int(a) for a in axis)


def sum(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return emit("sum", [x], {"axes": _axes(x, axis), "keepdims": keepdims})


def max(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return emit("max", [x], {"axes": _axes(x, axis), "keepdims": keepdims})


def matmul(a: Tensor, b: Tensor) -> Tensor:
    return emit("matmul", [a, b])


def softmax(x: Tensor, axis: int = -1, precise: bool = False) -> Tensor:
    """Softmax over ``axis``; ``precise=True`` computes in float32 for half inputs."""
    normalize_axis("softmax", axis, x.ndim)
    return emit("softmax", [x], {"axis": int(axis), "precise": precise})


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    mask: Tensor | None = None,
    causal: str | None = None,
) -> Tensor:
    """Scaled dot-product attention, layout ``[B, H, S, D]``, GQA when K/V have fewer heads.

    ``mask``: bool (True = attend) or additive float, broadcastable to ``[B, Hq, S, T]``.
    ``causal``: None, ``"top_left"`` (JAX ``is_causal``) or ``"bottom_right"`` (MLX ``"causal"``).
    """
    operands = [q, k, v] + ([mask] if mask is not None else [])
    return emit("sdpa", operands, {"scale": scale, "causal": causal or "none"})
