"""Convolution: ``conv1d`` in MLX's channels-last layout (the short convolutions of hybrid and Mamba layers)."""

from __future__ import annotations

from attnpass.ir.core.registry import OpDef, attr, operand, register
from attnpass.ir.core.types import ShapeError, TensorType

from .rules import FLOATS, require_dtype, same_dtype


def _infer_conv1d(ts, *, stride, padding, dilation, groups):
    x, w = ts
    dtype = same_dtype("conv1d", ts)
    require_dtype("conv1d", x, FLOATS)
    if x.rank != 3 or w.rank != 3:
        raise ShapeError(f"conv1d: need x [N, L, C_in] and w [C_out, K, C_in / groups], got {x} and {w}")
    if stride < 1 or dilation < 1 or groups < 1 or len(padding) != 2 or min(padding) < 0:
        raise ShapeError(
            f"conv1d: stride={stride} padding={list(padding)} dilation={dilation} groups={groups} invalid "
            "(need stride, dilation, groups >= 1 and padding (low, high) >= 0)"
        )
    (n, length, c_in), (c_out, k, per_group) = x.shape, w.shape
    if c_in % groups or c_out % groups or per_group * groups != c_in:
        raise ShapeError(
            f"conv1d: groups={groups} does not fit x {x} and w {w} (need C_in and C_out divisible by groups "
            "and w's last dim equal to C_in / groups)"
        )
    span = dilation * (k - 1) + 1
    padded = length + padding[0] + padding[1]
    if k < 1 or padded < span:
        raise ShapeError(f"conv1d: the kernel spans {span} positions, more than the padded length {padded} of {x}")
    return TensorType((n, (padded - span) // stride + 1, c_out), dtype)


register(
    OpDef(
        "conv1d",
        (operand("x"), operand("w")),
        _infer_conv1d,
        {
            "stride": attr("int", 1),
            "padding": attr("ints", (0, 0)),
            "dilation": attr("int", 1),
            "groups": attr("int", 1),
        },
        "convolution",
        "Cross-correlation over L of x [N, L, C_in] (zero padding (low, high)) with w [C_out, K, C_in / groups] "
        "-> [N, L_out, C_out], as mx.conv1d: out[n, l, o] = sum_k,c x[n, l*stride + k*dilation - low, "
        "g*C_in/groups + c] * w[o, k, c], g = o // (C_out / groups).",
    )
)
