"""floor, ceil, round, argmax, argmin and conv1d on every target, against the float64 reference.

Rounding to integers and arg reductions are exact: every target computes the reference's bits
(signs of zero and infinities included; a NaN stays a NaN, its payload is the target's: MLX's
float16 floor returns 0x7D00 for 0x7E00; subnormal operands are left out, XLA on CPU flushes
them). conv1d is arithmetic: the numpy target is bit for bit an independent float64 loop rounded
once, MLX is bit for bit ``mx.conv1d`` itself, and MLX and JAX are within rounding of the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorType
from attnpass.ir.dialects.evaluate import rounded
from attnpass.lowering import lower
from tests.util import (
    assert_bits_equal,
    assert_close,
    bits,
    lazy_import,
    one_op_graph,
    random_array,
    requires,
    target_params,
)

mx = lazy_import("mlx.core")


def _rounding_samples(rng, dtype: DType) -> np.ndarray:
    """Halves (ties), values near integers, large and huge values, zeros of both signs, infinities, NaN."""
    halves = rng.integers(-40, 40, 64) + 0.5
    near = rng.integers(-40, 40, 64) + rng.choice([-1e-2, -1e-3, 0.0, 1e-3, 1e-2], 64)
    ordinary = rng.standard_normal(128) * 10.0 ** rng.integers(-3, 4, 128)
    special = [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, np.inf, -np.inf, np.nan, 1e30, -1e30, 2.0**22 + 0.5]
    x = rounded(np.concatenate([halves, near, ordinary, special]), dtype)
    tiny = float(dtype.finfo.tiny)
    return x[~((np.abs(x.astype(np.float64)) < tiny) & (x != 0))]  # no subnormals


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("op, reference", [("floor", np.floor), ("ceil", np.ceil), ("round", np.rint)])
def test_rounding_is_bit_exact_on_every_target(rng, target, dtype, op, reference):
    """round is half to even (np.rint): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0.0."""
    dtype = DType.parse(dtype)
    x = _rounding_samples(rng, dtype)
    got = run(lower(one_op_graph(op, [TensorType(x.shape, dtype)]), target), x)
    expected = rounded(reference(x.astype(np.float64)), dtype)
    nan = np.isnan(expected.astype(np.float64))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), nan)
    assert nan.any() and got.dtype == expected.dtype
    assert_bits_equal(got[~nan], expected[~nan])


def test_round_halves_to_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5], np.float32)
    got = run(lower(one_op_graph("round", [TensorType((7,), "float32")]), "numpy"), x)
    assert got.tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 4.0]
    assert np.signbit(got[3])


def _arg_samples(rng, dtype: str) -> np.ndarray:
    """Few distinct values (ties everywhere); for floats, a NaN in some rows, sometimes two."""
    x = rng.integers(-3, 3, (4, 5, 7)).astype(DType.parse(dtype).numpy)
    if dtype != "int32":
        x[0, 1, 3] = x[1, 2, 5] = x[1, 2, 1] = x[2, 0, 0] = np.nan
    return x


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_arg_reductions_pick_the_first_index_on_every_target(rng, target, dtype, op):
    """Ties go to the first index, a NaN wins (the first NaN), as numpy's argmax/argmin; keepdims keeps the axis."""
    x = _arg_samples(rng, dtype)
    wide = x.astype(np.float64)
    for axis, keepdims in ((-1, False), (1, True), (0, False)):
        graph = one_op_graph(op, [TensorType(x.shape, dtype)], {"axis": axis, "keepdims": keepdims})
        got = run(lower(graph, target), x)
        expected = getattr(np, op)(wide, axis=axis, keepdims=keepdims).astype(np.int32)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, expected)


def _conv1d_loops(x, w, stride, padding, dilation, groups):
    """out[n, l, o] = sum over taps k, group channels c of x[n, l*stride + k*dilation - low, g*per + c] * w[o, k, c]."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    (n, length, c_in), (c_out, k, per) = x.shape, w.shape
    low, high = padding
    l_out = (length + low + high - dilation * (k - 1) - 1) // stride + 1
    out = np.zeros((n, l_out, c_out))
    for o in range(c_out):
        g = o // (c_out // groups)
        for pos in range(l_out):
            for tap in range(k):
                src = pos * stride + tap * dilation - low
                if 0 <= src < length:
                    out[:, pos, o] += x[:, src, g * per : (g + 1) * per] @ w[o, tap]
    return out


CONVS = [  # x shape, w shape, attributes
    ((1, 10, 6), (6, 3, 1), {"groups": 6}),  # depthwise (the short convolutions of hybrid families)
    ((2, 9, 4), (4, 4, 1), {"groups": 4, "padding": (3, 0)}),  # causal depthwise
    ((2, 10, 6), (4, 3, 6), {"stride": 2, "padding": (1, 1), "dilation": 2}),
    ((1, 7, 4), (6, 2, 2), {"groups": 2, "padding": (1, 2), "stride": 3}),
]


def _conv_case(rng, shapes, dtype: str) -> tuple[Graph, np.ndarray, np.ndarray]:
    """A one-op conv1d graph of ``shapes`` (x shape, w shape, attributes) and random operands for it."""
    xs, ws, attrs = shapes
    x, w = random_array(rng, xs, dtype), random_array(rng, ws, dtype)
    return one_op_graph("conv1d", [TensorType(xs, dtype), TensorType(ws, dtype)], attrs), x, w


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shapes", CONVS, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_conv1d_numpy_target_is_the_float64_loops_rounded_once(rng, shapes, dtype):
    graph, x, w = _conv_case(rng, shapes, dtype)
    full = {"stride": 1, "padding": (0, 0), "dilation": 1, "groups": 1, **shapes[2]}
    assert_bits_equal(run(lower(graph, "numpy"), x, w), rounded(_conv1d_loops(x, w, **full), dtype))


@requires("mlx.core", "jax")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shapes", CONVS, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_conv1d_agrees_on_every_target_and_is_mx_conv1d_on_mlx(rng, shapes, dtype):
    graph, x, w = _conv_case(rng, shapes, dtype)
    attrs = shapes[2]
    expected = run(lower(graph, "numpy"), x, w)
    for target in ("mlx", "jax"):
        assert_close(run(lower(graph, target), x, w), expected)
    if attrs.get("padding", (0, 0))[0] == attrs.get("padding", (0, 0))[1]:  # mx.conv1d pads symmetrically
        mine = run(lower(graph, "mlx"), x, w)
        mx_x, mx_w = (mx.array(a.astype(np.float32)).astype(getattr(mx, dtype)) for a in (x, w))
        theirs = mx.conv1d(
            mx_x, mx_w, stride=attrs.get("stride", 1), padding=attrs.get("padding", (0, 0))[0],
            dilation=attrs.get("dilation", 1), groups=attrs.get("groups", 1),
        )  # fmt: skip
        np.testing.assert_array_equal(bits(mine), bits(np.array(theirs.astype(mx.float32)).astype(mine.dtype)))
