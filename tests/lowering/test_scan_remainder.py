"""scan (cumulative sum, product, max, min) and remainder on every target, against independent references.

Integer scans, max/min scans and remainder (integers and floats) are exact: every target computes the
reference's bits. A float cumulative sum or product is not: each target adds in its own order and
precision (MLX and JAX accumulate in the dtype or float32, the reference in float64 rounded once), so
those are compared within rounding (``assert_close``), never bit for bit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorType
from attnpass.ir.dialects.evaluate import rounded
from attnpass.lowering import lower
from tests.util import assert_bits_equal, assert_close, lazy_import, one_op_graph, random_array, requires, target_params

mx = lazy_import("mlx.core")


def _scan_loops(x: np.ndarray, kind: str, axis: int, reverse: bool, inclusive: bool) -> np.ndarray:
    """out[..., i, ...] = kind over x[..., j, ...] for j <= i (j >= i reversed; j == i left out when exclusive),
    in Python floats / ints; an empty range gives the identity."""
    combine = {"sum": sum, "prod": np.prod, "max": max, "min": min}[kind]
    empty = {"sum": 0, "prod": 1, "max": -np.inf, "min": np.inf}[kind]
    moved = np.moveaxis(x.astype(np.float64), axis, -1)
    out = np.empty_like(moved)
    n = moved.shape[-1]
    for index in np.ndindex(moved.shape[:-1]):
        row = [float(v) for v in moved[index]]
        for i in range(n):
            span = range(i if inclusive else i + 1, n) if reverse else range(0, i + 1 if inclusive else i)
            values = [row[j] for j in span]
            out[index + (i,)] = combine(values) if values else empty
    return np.moveaxis(out, -1, axis)


FLAGS = list(itertools.product([False, True], [False, True]))  # reverse, inclusive


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("kind", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("dtype", ["int32", "float32", "bfloat16"])
def test_scan_on_every_target_against_loops(rng, target, kind, dtype):
    """Integer scans and max/min scans bit for bit; float sums and products within rounding."""
    x = rng.integers(-3, 4, (3, 4, 5)).astype(DType.parse(dtype).numpy)
    if dtype != "int32" and kind in ("sum", "prod"):
        low, high = (0.5, 1.5) if kind == "prod" else (-2.0, 2.0)
        x = random_array(rng, (3, 4, 5), dtype, low=low, high=high)
    for (reverse, inclusive), axis in itertools.product(FLAGS, (-1, 0, 1)):
        attrs = {"kind": kind, "axis": axis, "reverse": reverse, "inclusive": inclusive}
        got = run(lower(one_op_graph("scan", [TensorType(x.shape, dtype)], attrs), target), x)
        loops = _scan_loops(x, kind, axis, reverse, inclusive)
        if dtype == "int32" and kind in ("max", "min"):  # the exclusive identity is the dtype's lowest / highest
            info = np.iinfo(np.int32)
            loops = np.where(np.isinf(loops), np.where(loops < 0, info.min, info.max), loops)
        expected = rounded(loops, dtype)
        assert got.dtype == expected.dtype
        if dtype == "int32" or kind in ("max", "min"):
            assert_bits_equal(got, expected)
        else:
            assert_close(got, expected)


def test_scan_numpy_target_is_the_float64_sum_rounded_once(rng):
    x = random_array(rng, (2, 9), "bfloat16")
    attrs = {"kind": "sum", "axis": 1, "reverse": True, "inclusive": False}
    got = run(lower(one_op_graph("scan", [TensorType(x.shape, "bfloat16")], attrs), "numpy"), x)
    assert_bits_equal(got, rounded(_scan_loops(x, "sum", 1, True, False), "bfloat16"))


@requires("mlx.core")
@pytest.mark.parametrize("kind", ["sum", "prod", "max", "min"])
def test_scan_on_mlx_is_mx_cum_itself(rng, kind):
    x = random_array(rng, (4, 7), "float32")
    for reverse, inclusive in FLAGS:
        attrs = {"kind": kind, "axis": 1, "reverse": reverse, "inclusive": inclusive}
        got = run(lower(one_op_graph("scan", [TensorType(x.shape, "float32")], attrs), "mlx"), x)
        theirs = getattr(mx, f"cum{kind}")(mx.array(x), axis=1, reverse=reverse, inclusive=inclusive)
        assert_bits_equal(got, np.array(theirs))


def _remainder_samples(rng, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Every sign pairing, exact multiples (zero results), divisors larger than the dividend, tiny dividends."""
    if dtype == "int32":
        x = rng.integers(-50, 50, 400).astype(np.int32)
        y = rng.choice(np.r_[-7:0, 1:8], 400).astype(np.int32)
        return x, y
    x = rng.standard_normal(400) * 10.0 ** rng.integers(-2, 3, 400)
    y = rng.choice([-3.0, -2.0, -0.75, 0.5, 1.0, 2.5, 3.0, 1e3], 400)
    x[:8] = [6.0, -6.0, 0.0, -0.0, 1e-6, -1e-6, 2.5, -2.5]
    x, y = rounded(x, dtype), rounded(y, dtype)
    tiny = float(DType.parse(dtype).finfo.tiny)
    normal = (np.abs(x.astype(np.float64)) >= tiny) | (x == 0)  # subnormal operands are left out (XLA flushes them)
    return x[normal], y[normal]


def _python_remainder(x: float, y: float) -> float:
    """Python's % on the value (the divisor's sign); a zero result keeps the dividend's sign, as math.fmod's."""
    import math

    r = math.fmod(x, y)
    return r + y if r and (r < 0) != (y < 0) else r


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", ["int32", "float32", "bfloat16", "float16"])
def test_remainder_is_exact_on_every_target(rng, target, dtype):
    """The result takes the divisor's sign, as Python's % and mx.remainder; bit for bit, zeros' signs included."""
    x, y = _remainder_samples(rng, dtype)
    got = run(lower(one_op_graph("remainder", [TensorType(x.shape, dtype)] * 2), target), x, y)
    if dtype == "int32":
        np.testing.assert_array_equal(got, np.array([int(a) % int(b) for a, b in zip(x, y)], np.int32))
        return
    values = [_python_remainder(float(a), float(b)) for a, b in zip(x.astype(np.float64), y.astype(np.float64))]
    expected = rounded(np.array(values), dtype)
    assert_bits_equal(got, expected)
    assert ((got.astype(np.float64) * y.astype(np.float64)) >= 0).all()  # the divisor's sign (or zero)


@requires("mlx.core")
def test_remainder_on_mlx_is_mx_remainder_and_negative_zero_keeps_its_sign():
    x = np.array([-7.0, 7.0, -7.0, 7.0, -0.0, 6.0, -6.0, -1e-30], np.float32)
    y = np.array([3.0, -3.0, -3.0, 3.0, 2.0, -3.0, 3.0, 2.0], np.float32)
    got = run(lower(one_op_graph("remainder", [TensorType(x.shape, "float32")] * 2), "mlx"), x, y)
    assert_bits_equal(got, np.array(mx.remainder(mx.array(x), mx.array(y))))
    assert got.tolist() == [2.0, -2.0, -1.0, 1.0, 0.0, 0.0, 0.0, 2.0]
    assert np.signbit(got[4]) and not np.signbit(got[5]) and np.signbit(got[6])  # a zero keeps x's sign
