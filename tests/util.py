"""Helpers shared by the tests (``from tests.util import ...``): numeric comparisons, optional backends, examples.

Tolerances, per floating dtype (``RTOL``): bf16 has 8 significant bits (one rounding
~4e-3; a backend that keeps bf16 intermediates through a reduction or a softmax drifts
to ~1e-2), f16 has 11 (~5e-4 per rounding), f32 has 24 (~6e-8; reductions and
transcendental approximations stay well under 1e-5). :func:`assert_close` applies them
either per element (``|actual - expected| <= rtol * |expected|``, for elementwise
arithmetic) or relative to the magnitude of the result (``<= rtol * (|expected| +
max|expected|)``, for reductions, matmuls, softmax and attention, whose small entries
come from cancellation or from exponentials of rounded differences). Integer and bool
results must be equal; layout ops must be bit-exact (:func:`assert_bits_equal`).
"""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from attnpass.ir import DType

RTOL = {DType.bfloat16: 2e-2, DType.float16: 2e-3, DType.float32: 1e-5}
FLOAT_DTYPES = (DType.bfloat16, DType.float16, DType.float32)


def random_array(rng: np.random.Generator, shape, dtype: DType | str, *, low: float = -2.0, high: float = 2.0):
    """Values of ``dtype``: uniform floats in [low, high), ints in [low, high), or fair bools."""
    dtype = DType.parse(dtype)
    if dtype is DType.bool:
        return rng.random(shape) < 0.5
    if dtype is DType.int32:
        return rng.integers(int(low), int(high), size=shape).astype(np.int32)
    return rng.uniform(low, high, size=shape).astype(dtype.numpy)


def bits(x: np.ndarray) -> np.ndarray:
    """The raw bits of ``x`` (uint16 for 2-byte floats, uint32 for 4-byte ones; ints and bools as is)."""
    x = np.asarray(x)
    if x.dtype.kind in "iub":
        return x
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_bits_equal(actual, expected) -> None:
    """Same dtype, same shape, same bits (so -0.0 vs 0.0 or a different NaN payload fail)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    np.testing.assert_array_equal(bits(actual), bits(expected))


def assert_close(
    actual, expected, dtype: DType | str | None = None, *, rtol: float | None = None, elementwise: bool = False
) -> None:
    """Compare a backend result with the reference: exact for ints/bools, else per-dtype tolerance.

    ``elementwise``: each element within ``rtol`` of itself; otherwise within ``rtol`` of the
    result's magnitude too. Non-finite entries must match exactly (positions and values).
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    dtype = DType.from_numpy(expected.dtype) if dtype is None else DType.parse(dtype)
    assert actual.dtype == dtype.numpy, f"dtype {actual.dtype} != {dtype.numpy}"
    if not dtype.is_float:
        np.testing.assert_array_equal(actual, expected)
        return
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    finite = np.isfinite(e)
    np.testing.assert_array_equal(np.isfinite(a), finite, err_msg="non-finite positions differ")
    np.testing.assert_array_equal(a[~finite], e[~finite], err_msg="non-finite values differ")
    if finite.any():
        tol = RTOL[dtype] if rtol is None else rtol
        scale = 0.0 if elementwise else np.max(np.abs(e[finite]))
        err = np.abs(a[finite] - e[finite])
        bound = tol * (np.abs(e[finite]) + scale)
        worst = int(np.argmax(err - bound))
        assert np.all(err <= bound), (
            f"{int(np.sum(err > bound))} of {err.size} elements beyond rtol {tol} ({dtype.value}); "
            f"worst: actual {a[finite][worst]!r} expected {e[finite][worst]!r}"
        )



EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> SimpleNamespace:
    """Run ``examples/<name>.py`` as a module (not as ``__main__``) and return its globals."""
    return SimpleNamespace(**runpy.run_path(str(EXAMPLES_DIR / f"{name}.py"), run_name=f"example_{name}"))


def available(module: str) -> bool:
    """Whether ``module`` (e.g. ``"mlx.core"``) can be imported here."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def requires(*modules: str) -> pytest.MarkDecorator:
    """The one marker for optional backends: skip unless every module imports (``requires("mlx.core", "jax")``)."""
    missing = [m for m in modules if not available(m)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (optional extra)")


def installed_targets() -> list[str]:
    """The built-in lowering targets whose backend is installed here (numpy always)."""
    return [t for t, module in (("numpy", "numpy"), ("jax", "jax"), ("mlx", "mlx.core")) if available(module)]
