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

Optional backends and peers (mlx, jax, mlx-vlm, torch/transformers, Graphviz) are handled
one way, so that the suite collects and passes, with skips that name what is missing, in a
venv with only the core dependencies (``make test-core``)::

    from tests.util import lazy_import, requires, target_params

    pytestmark = requires("mlx.core", "jax")  # a module that needs them throughout; else
                                              # @requires("jax") on each test that does
    mx = lazy_import("mlx.core")              # names of optional modules: imported on first use
    lax = lazy_import("jax.lax")

    @pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))  # marks per target
    def test_...(target): ...

Never ``import mlx...`` or ``import jax...`` in a test module (top level or local), never
``pytest.importorskip``. Code that runs at collection (decorators, parametrize lists, skipif
conditions) must not read a lazy module's attributes: build such objects inside a function.
A lazy module is read-only: patch the real one, ``monkeypatch.setattr("mlx.core.name", ...)``.
``requires(graphviz=True)``: ``attnpass render`` finds a ``dot`` program (the ``render`` extra).
"""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from attnpass.ir import DType, Graph, get_op

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


def assert_mlx_import_reproduces(imported, fn, *args) -> None:
    """An MLX import reproduces ``fn(*args)``: bit-exact lowered to MLX, within rounding on numpy and JAX."""
    from attnpass.backends import run
    from attnpass.lowering import lower

    expected = np.array(fn(*args))
    np.testing.assert_array_equal(run(lower(imported.graph, "mlx"), *args, **imported.params), expected)
    host = [np.array(a) for a in args]
    for target in ("numpy", "jax"):
        assert_close(run(lower(imported.graph, target), *host, **imported.params), expected)


EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> SimpleNamespace:
    """Run ``examples/<name>.py`` as a module (not as ``__main__``) and return its globals."""
    return SimpleNamespace(**runpy.run_path(str(EXAMPLES_DIR / f"{name}.py"), run_name=f"example_{name}"))


def available(module: str) -> bool:
    """Whether ``module`` (e.g. ``"mlx.core"``) can be imported here (found; its parents are imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def graphviz_available() -> bool:
    """Whether ``attnpass render`` finds a ``dot`` program for SVG/PNG (the ``render`` extra)."""
    from attnpass.ir import AttnpassError
    from attnpass.ir.core.rendering import find_dot

    try:
        find_dot()
    except AttnpassError:
        return False
    return True


# The extra of pyproject.toml that installs each optional top-level module (for skip reasons).
EXTRAS = {
    "mlx": "mlx", "jax": "jax", "mlx_vlm": "clients", "torch": "peers", "transformers": "peers", "mlx_lm": "zoo",
    "flax": "zoo", "equinox": "zoo", "ruff": "dev", "penzai": "libraries", "keras": "libraries",
    "mlx_whisper": "libraries", "mlx_embeddings": "libraries",
}  # fmt: skip


def requires(*modules: str, graphviz: bool = False) -> pytest.MarkDecorator:
    """The one marker for optional backends and peers: skip unless every module imports
    (``requires("mlx.core", "jax")``) and, with ``graphviz``, a ``dot`` program is found."""
    # Top-level packages first (finding them imports nothing); submodules only when all are there,
    # since finding "transformers.models.qwen4_exp" imports transformers.
    missing = [m for m in modules if not available(m.split(".")[0])]
    missing = missing or [m for m in modules if not available(m)]
    extras = sorted({EXTRAS[m.split(".")[0]] for m in missing if m.split(".")[0] in EXTRAS})
    outside = [m for m in missing if m.split(".")[0] not in EXTRAS]
    if graphviz and not graphviz_available():
        missing.append("Graphviz dot")
        extras = sorted({*extras, "render"})
    hints = [f"optional extra: pip install -e '.[{','.join(extras)}]'"] if extras else []
    hints += [f"{', '.join(outside)} in no extra: a venv of its own, made by a Makefile target"] if outside else []
    reason = f"needs {', '.join(missing)} ({'; '.join(hints)})"
    return pytest.mark.skipif(bool(missing), reason=reason)


# What each lowering target needs installed to lower and run (numpy is a core dependency).
TARGET_MODULES = {"numpy": (), "mlx": ("mlx.core",), "jax": ("jax",)}


def target_params(*targets: str) -> list:
    """``targets`` as parametrize values, each carrying :func:`requires` for its backend:
    ``@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))`` (ids stay the names)."""
    return [pytest.param(t, marks=requires(*TARGET_MODULES[t])) for t in targets]


class _LazyModule(ModuleType):
    """Stands for a module until one of its attributes is read, then imports it; read-only."""

    def __getattr__(self, attr: str):
        try:
            module = importlib.import_module(self.__name__)
        except ImportError:
            if attr.startswith("__"):  # introspection (pytest's collection, hasattr): not there
                raise AttributeError(attr) from None
            raise  # a test that uses it without requires(...)
        return getattr(module, attr)

    def __setattr__(self, attr: str, value) -> None:
        # Setting it here would not reach the real module (and monkeypatch's undo reads __dict__).
        raise AttributeError(
            f"{self.__name__} is a lazy_import stand-in: patch the module itself, "
            f"monkeypatch.setattr({self.__name__ + '.' + attr!r}, ...)"
        )

    def __delattr__(self, attr: str) -> None:
        self.__setattr__(attr, None)


def lazy_import(module: str) -> ModuleType:
    """``module`` (``"mlx.core"``, ``"jax.numpy"``), imported when a test first reads an attribute of it.

    Module-level names of optional backends use this, so a test module collects without them;
    the tests that read them carry :func:`requires`.
    """
    return _LazyModule(module)


def one_op_graph(op: str, types, attrs=None):
    """A graph of one ``op`` node over inputs ``x0, x1, ...`` of ``types``, its only output (they fill the op's
    operands in declared order, optional ones included)."""
    graph = Graph(op)
    names = [graph.add_input(f"x{i}", t) for i, t in enumerate(types)]
    graph.set_outputs([graph.add_node(op, by_position(op, names), attrs or {})])
    return graph


def by_position(op: str, values: list[str]) -> list[str] | dict[str, str]:
    """``values`` as the operands of ``op`` in declared order: named for an op with optional operands."""
    opdef = get_op(op)
    return values if opdef.variadic or not opdef.optional else dict(zip(opdef.operand_names, values))
