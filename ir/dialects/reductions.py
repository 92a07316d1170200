"""Reductions: sum, max (axes, keepdims), argpartition, argtopk, argmax/argmin and scans (cumulative sum, product, max,
min, logsumexp)."""

from __future__ import annotations

from attnpass.ir.core.registry import OpDef, attr, operand, register
from attnpass.ir.core.types import DType, ShapeError, TensorType

from .rules import FLOATS, NUMERIC, normalize_axis, require_dtype


def _reduction(name: str) -> None:
    def infer(ts, *, axes, keepdims):
        (x,) = ts
        require_dtype(name, x, NUMERIC)
        norm = sorted({normalize_axis(name, a, x.rank) for a in axes})
        if len(norm) != len(axes):
            raise ShapeError(f"{name}: repeated axes {list(axes)} for operand {x}")
        if keepdims:
            shape = tuple(1 if i in norm else d for i, d in enumerate(x.shape))
        else:
            shape = tuple(d for i, d in enumerate(x.shape) if i not in norm)
        return TensorType(shape, x.dtype)

    register(
        OpDef(
            name,
            (operand("x"),),
            infer,
            {"axes": attr("ints"), "keepdims": attr("bool", False)},
            "reduction",
            f"{name} over axes; result keeps the operand dtype.",
        )
    )


_reduction("sum")
_reduction("max")


def _infer_argpartition(ts, *, kth, axis):
    (x,) = ts
    require_dtype("argpartition", x, NUMERIC)
    if x.rank == 0:
        raise ShapeError(f"argpartition: operand {x} is a scalar; need rank >= 1")
    n = x.shape[normalize_axis("argpartition", axis, x.rank)]
    if not 0 <= kth < n:
        raise ShapeError(f"argpartition: kth={kth} out of range for axis {axis} of {x} (need 0 <= kth < {n})")
    return TensorType(x.shape, DType.int32)


register(
    OpDef(
        "argpartition",
        (operand("x"),),
        _infer_argpartition,
        {"kth": attr("int"), "axis": attr("int", -1)},
        "reduction",
        "int32 indices that partition x along axis: the element at kth is in sorted position, smaller ones "
        "before, larger ones after. The order inside each side (and among ties) is target-defined.",
    )
)


def _infer_argtopk(ts, *, k, axis):
    (x,) = ts
    require_dtype("argtopk", x, NUMERIC)
    if x.rank == 0:
        raise ShapeError(f"argtopk: operand {x} is a scalar; need rank >= 1")
    ax = normalize_axis("argtopk", axis, x.rank)
    if not 0 <= k <= x.shape[ax]:
        raise ShapeError(f"argtopk: k={k} out of range for axis {axis} of {x} (need 0 <= k <= {x.shape[ax]})")
    return TensorType(x.shape[:ax] + (k,) + x.shape[ax + 1 :], DType.int32)


register(
    OpDef(
        "argtopk",
        (operand("x"),),
        _infer_argtopk,
        {"k": attr("int"), "axis": attr("int", -1)},
        "reduction",
        "int32 indices of the k largest elements along axis, largest first; equal elements lower index first; "
        "floats in IEEE total order (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN): the indices of "
        "jax.lax.top_k (its values are take_along_axis of x at them).",
    )
)


def _arg_reduction(name: str, which: str) -> None:
    def infer(ts, *, axis, keepdims):
        (x,) = ts
        require_dtype(name, x, NUMERIC)
        if x.rank == 0:
            raise ShapeError(f"{name}: operand {x} is a scalar; need rank >= 1")
        ax = normalize_axis(name, axis, x.rank)
        if x.shape[ax] == 0:
            raise ShapeError(f"{name}: axis {axis} of {x} is empty; it has no {which}")
        kept = (1,) if keepdims else ()
        return TensorType(x.shape[:ax] + kept + x.shape[ax + 1 :], DType.int32)

    register(
        OpDef(
            name,
            (operand("x"),),
            infer,
            {"axis": attr("int"), "keepdims": attr("bool", False)},
            "reduction",
            f"int32 index of the {which} along axis: the first one on ties, the first NaN if any (numpy.{name}).",
        )
    )


_arg_reduction("argmax", "maximum")
_arg_reduction("argmin", "minimum")


SCAN_KINDS = ("sum", "prod", "max", "min", "logsumexp")


def _infer_scan(ts, *, kind, axis, reverse, inclusive):
    (x,) = ts
    require_dtype("scan", x, FLOATS if kind == "logsumexp" else NUMERIC)
    if x.rank == 0:
        raise ShapeError(f"scan: operand {x} is a scalar; need rank >= 1")
    normalize_axis("scan", axis, x.rank)
    return x


register(
    OpDef(
        "scan",
        (operand("x"),),
        _infer_scan,
        {
            "kind": attr("choice:" + "|".join(SCAN_KINDS)),
            "axis": attr("int"),
            "reverse": attr("bool", False),
            "inclusive": attr("bool", True),
        },
        "reduction",
        "Cumulative kind (sum, prod, max, min, logsumexp) along axis, as mx.cumsum/cumprod/cummax/cummin/"
        "logcumsumexp: out[i] combines x[0..i] (x[i..n-1] when reverse); exclusive leaves x[i] out, the first "
        "(last) element being the identity (0, 1, the dtype's lowest, its highest: -inf/inf for floats; -inf "
        "for logsumexp, floats only).",
    )
)
