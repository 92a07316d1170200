"""Elementwise ops: binary with numpy broadcasting, unary, select, logic and comparisons."""

from __future__ import annotations

from attnpass.ir.core.registry import OpDef, operand, register
from attnpass.ir.core.types import DType, TensorType

from .rules import FLOATS, NUMERIC, broadcast_shapes, require_dtype, same_dtype


def _binary(name: str, allowed: tuple[DType, ...], doc: str) -> None:
    def infer(ts):
        dtype = same_dtype(name, ts)
        require_dtype(name, ts[0], allowed)
        return TensorType(broadcast_shapes(name, ts[0].shape, ts[1].shape), dtype)

    register(OpDef(name, (operand("x"), operand("y")), infer, {}, "elementwise", doc))


def _unary(name: str, allowed: tuple[DType, ...], doc: str) -> None:
    def infer(ts):
        require_dtype(name, ts[0], allowed)
        return ts[0]

    register(OpDef(name, (operand("x"),), infer, {}, "elementwise", doc))


_binary("add", NUMERIC, "x + y with numpy broadcasting.")
_binary("sub", NUMERIC, "x - y with numpy broadcasting.")
_binary("mul", NUMERIC, "x * y with numpy broadcasting.")
_binary("div", FLOATS, "x / y (true division) with numpy broadcasting.")
_binary("maximum", NUMERIC, "Elementwise maximum with numpy broadcasting.")
_unary("neg", NUMERIC, "-x.")
_unary("exp", FLOATS, "e**x.")
_unary("relu", NUMERIC, "max(x, 0).")


def _infer_where(ts):
    cond, a, b = ts
    require_dtype("where", cond, (DType.bool,), "condition")
    dtype = same_dtype("where", [a, b])
    return TensorType(broadcast_shapes("where", cond.shape, a.shape, b.shape), dtype)


register(
    OpDef(
        "where",
        (operand("cond"), operand("x"), operand("y")),
        _infer_where,
        {},
        "elementwise",
        "cond ? x : y, broadcast.",
    )
)


def _logical(name: str, doc: str) -> None:
    def infer(ts):
        for t in ts:
            require_dtype(name, t, (DType.bool,))
        return TensorType(broadcast_shapes(name, ts[0].shape, ts[1].shape), DType.bool)

    register(OpDef(name, (operand("x"), operand("y")), infer, {}, "elementwise", doc))


def _compare(name: str, doc: str) -> None:
    def infer(ts):
        same_dtype(name, ts)
        require_dtype(name, ts[0], NUMERIC)
        return TensorType(broadcast_shapes(name, ts[0].shape, ts[1].shape), DType.bool)

    register(OpDef(name, (operand("x"), operand("y")), infer, {}, "elementwise", doc))


_logical("logical_and", "x & y on bool tensors, numpy broadcasting.")
_logical("logical_or", "x | y on bool tensors, numpy broadcasting.")
_compare("equal", "x == y -> bool, numpy broadcasting.")
_compare("less", "x < y -> bool, numpy broadcasting.")
_compare("greater_equal", "x >= y -> bool, numpy broadcasting.")
_unary("rsqrt", FLOATS, "1 / sqrt(x) (for RMSNorm).")
_unary("sin", FLOATS, "sin(x).")
_unary("cos", FLOATS, "cos(x).")
_unary("sigmoid", FLOATS, "1 / (1 + exp(-x)).")
_binary("floor_divide", NUMERIC, "numpy floor division x // y with numpy broadcasting.")
_binary(
    "remainder",
    NUMERIC,
    "x % y as Python's and mx.remainder: r = fmod(x, y), plus y when r is nonzero and its sign differs from y's "
    "(the result takes the divisor's sign; a zero result keeps x's sign). An integer divisor of 0 is undefined.",
)

# Ops of imported models (from_mlx / from_jax): activations, logarithms, powers, clamps, logic.
_unary("tanh", FLOATS, "tanh(x).")
_unary("erf", FLOATS, "The error function erf(x) (exact GELU).")
_unary("log", FLOATS, "Natural logarithm.")
_unary("log1p", FLOATS, "log(1 + x), accurate for small x.")
_unary("expm1", FLOATS, "e**x - 1, accurate for small x.")
_unary("sqrt", FLOATS, "Square root.")
_unary("abs", NUMERIC, "|x|.")
_unary("sign", NUMERIC, "-1, 0 or 1 by the sign of x (0 for zeros).")
_unary("logical_not", (DType.bool,), "not x on a bool tensor.")
_binary("minimum", NUMERIC, "Elementwise minimum with numpy broadcasting.")
_binary("power", FLOATS, "x ** y (floats) with numpy broadcasting.")
_binary("logaddexp", FLOATS, "log(exp(x) + exp(y)) without overflow, numpy broadcasting.")

# Rounding to integral values (MLX Floor, Ceil, Round): exact on every target, signs of zero kept.
_unary("floor", FLOATS, "The largest integral value <= x (numpy.floor).")
_unary("ceil", FLOATS, "The smallest integral value >= x (numpy.ceil).")
_unary("round", FLOATS, "x rounded to the nearest integral value, halves to even (numpy.round, mx.round, jnp.round).")
