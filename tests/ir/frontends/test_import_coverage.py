"""Import coverage for real models: the ops the importers added, each primitive with its exact parameters.

Every new op (tanh, erf, log, log1p, expm1, sqrt, abs, sign, logical_not, minimum,
power, logaddexp, take_along_axis, addmm) has a shape rule and agrees on every
target; every MLX primitive and JAX equation the mlx-lm families and the JAX zoo
use imports to them and reproduces the function (MLX bit-exact on MLX); an
unsupported MLX primitive is reported at the user's source line.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, ModelImportError, ShapeError, TensorSpec, from_jax, from_mlx, ops, trace
from attnpass.lowering import lower
from tests.util import assert_close, assert_mlx_import_reproduces, random_array, requires

UNARY = ("tanh", "erf", "log", "log1p", "expm1", "sqrt", "abs", "sign")
BINARY = ("minimum", "power", "logaddexp")


def _ops(graph) -> list[str]:
    return [n.op for n in graph.nodes() if n.op != "input"]


# ----------------------------------------------------------------------------- the new ops


@pytest.mark.parametrize("op", ["tanh", "erf", "log", "log1p", "expm1", "sqrt", "power", "logaddexp", "addmm"])
def test_float_ops_reject_integers(op):
    spec = TensorSpec((2, 3), "int32")
    with pytest.raises(ShapeError, match=rf"{op}: operand has dtype int32"):
        if op == "addmm":
            trace(lambda c, a, b: ops.addmm(c, a, b), spec, spec, TensorSpec((3, 3), "int32"))
        elif op in BINARY:
            trace(lambda x, y: getattr(ops, op)(x, y), spec, spec)
        else:
            trace(lambda x: getattr(ops, op)(x), spec)


def test_shape_rules_quote_the_operands():
    with pytest.raises(ShapeError, match=r"logical_not: operand has dtype float32"):
        trace(lambda x: ops.logical_not(x), TensorSpec((2,), "float32"))
    with pytest.raises(ShapeError, match=r"take_along_axis: indices i32\[2\] must have the rank of x f32\[2,3\]"):
        trace(lambda x, i: ops.take_along_axis(x, i, 1), TensorSpec((2, 3), "float32"), TensorSpec((2,), "int32"))
    with pytest.raises(ShapeError, match=r"addmm: c f32\[3,5\] does not broadcast to the product"):
        trace(
            lambda c, a, b: ops.addmm(c, a, b),
            TensorSpec((3, 5), "float32"), TensorSpec((2, 3), "float32"), TensorSpec((3, 4), "float32"),
        )  # fmt: skip


@requires("mlx.core", "jax")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_new_elementwise_ops_agree_on_every_target(rng, dtype):
    def program(x, y, flags):
        unary = [getattr(ops, op)(ops.abs(x) if op in ("log", "log1p", "sqrt") else x) for op in UNARY]
        binary = [getattr(ops, op)(ops.abs(x) if op == "power" else x, y) for op in BINARY]
        return (*unary, *binary, ops.logical_not(flags))

    spec = TensorSpec((3, 8), dtype)
    graph = trace(program, spec, spec, TensorSpec((3, 8), "bool"))
    x, y = random_array(rng, (3, 8), dtype), random_array(rng, (3, 8), dtype, low=0.5, high=2.0)
    flags = random_array(rng, (3, 8), "bool")
    x[0, :3] = 0  # sign(0) = 0, log(0) = -inf
    expected = run(lower(graph, "numpy"), x, y, flags)
    for target in ("mlx", "jax"):
        for got, want, name in zip(run(lower(graph, target), x, y, flags), expected, (*UNARY, *BINARY, "not")):
            assert_close(got, want, elementwise=name not in ("expm1", "log1p", "logaddexp")), (target, name)


@requires("mlx.core", "jax")
def test_take_along_axis_broadcasts_and_agrees_on_every_target(rng):
    graph = trace(
        lambda x, i: ops.take_along_axis(x, i, axis=1), TensorSpec((2, 5, 3), "float32"), TensorSpec((1, 4, 3), "int32")
    )
    assert graph.node(graph.outputs[0]).type.shape == (2, 4, 3)
    x, idx = random_array(rng, (2, 5, 3), "float32"), rng.integers(0, 5, (1, 4, 3)).astype(np.int32)
    expected = np.take_along_axis(x, idx, axis=1)
    for target in ("numpy", "mlx", "jax"):
        np.testing.assert_array_equal(run(lower(graph, target), x, idx), expected)


@requires("mlx.core", "jax")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_addmm_rounds_once_on_every_target(rng, dtype):
    graph = trace(
        lambda c, a, b: ops.addmm(c, a, b, alpha=0.5, beta=2.0),
        TensorSpec((4,), dtype), TensorSpec((3, 16), dtype), TensorSpec((16, 4), dtype),
    )  # fmt: skip
    c, a, b = (random_array(rng, s, dtype) for s in ((4,), (3, 16), (16, 4)))
    expected = run(lower(graph, "numpy"), c, a, b)
    for target in ("mlx", "jax"):
        assert_close(run(lower(graph, target), c, a, b), expected)


# ----------------------------------------------------------------------------- from_mlx

mlx_only = requires("mlx.core", "jax")  # the MLX import is checked on the JAX target too


def _check_mlx(fn, *args):
    imported = from_mlx(fn, *args)
    assert_mlx_import_reproduces(imported, fn, *args)
    return imported


@mlx_only
@pytest.mark.parametrize(
    "name, op",
    [("tanh", "tanh"), ("erf", "erf"), ("log1p", "log1p"), ("expm1", "expm1"), ("abs", "abs"), ("sign", "sign"),
     ("sqrt", "sqrt"), ("rsqrt", "rsqrt"), ("log", "log")],
)  # fmt: skip
def test_mlx_unary_primitives(rng, name, op):
    import mlx.core as mx

    x = mx.array(random_array(rng, (3, 5), "float32", low=0.1, high=3.0))
    imported = _check_mlx(getattr(mx, name), x)
    assert _ops(imported.graph) == [op]


@mlx_only
def test_mlx_binary_comparison_and_select_primitives(rng):
    import mlx.core as mx

    x, y = (mx.array(random_array(rng, (3, 5), "float32", low=0.1, high=2.0)) for _ in range(2))

    def binary(x, y):
        picked = mx.where(mx.logical_not(x != y) | (x <= y), mx.minimum(x, y), mx.logaddexp(x, y))
        return picked + x**y + mx.clip(x, 0.5, 1.5) + mx.square(y)

    imported = _check_mlx(binary, x, y)
    used = set(_ops(imported.graph))
    assert {"minimum", "logaddexp", "power", "logical_not", "equal", "greater_equal", "maximum", "where"} <= used


@requires("mlx.core")
def test_mlx_log_of_another_base_is_refused():
    import mlx.core as mx

    with pytest.raises(ModelImportError, match=r"only the natural logarithm"):
        from_mlx(mx.log2, mx.ones((2,)))


@requires("mlx.core")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_addmm_keeps_alpha_and_beta_and_is_bit_exact(rng, dtype):
    import mlx.core as mx

    mx_dtype = getattr(mx, dtype)
    c, w = (mx.array(random_array(rng, s, "float32")).astype(mx_dtype) for s in ((1, 8), (16, 8)))
    x = mx.array(random_array(rng, (3, 16), "float32")).astype(mx_dtype)
    imported = from_mlx(lambda x: mx.addmm(c, x, w, alpha=2.0, beta=0.5), x, inline_limit=0)
    (node,) = [n for n in imported.graph.nodes() if n.op == "addmm"]
    assert node.attrs == {"alpha": 2.0, "beta": 0.5}
    host = np.array(x.astype(mx.float32)).astype(DType.parse(dtype).numpy)
    got = run(lower(imported.graph, "mlx"), host, **imported.params)
    expected = mx.addmm(c, x, w, alpha=2.0, beta=0.5).astype(mx.float32)
    np.testing.assert_array_equal(got, np.array(expected).astype(got.dtype))


@mlx_only
def test_mlx_biased_linear_imports_as_addmm(rng):
    import mlx.core as mx
    import mlx.nn as nn

    layer = nn.Linear(16, 8)
    mx.eval(layer.parameters())
    x = mx.array(random_array(rng, (2, 16), "float32"))
    imported = _check_mlx(layer, x)
    assert _ops(imported.graph).count("addmm") == 1


@mlx_only
def test_mlx_gather_axis_and_gather_mm(rng):
    import mlx.core as mx

    x = mx.array(random_array(rng, (2, 6), "float32"))
    experts = mx.array(random_array(rng, (4, 6, 3), "float32"))
    idx = mx.array(np.array([[5, 0, 2], [1, 1, 4]], np.int32))
    routes = mx.array(np.array([[3, 1], [0, 3]], np.uint32))

    def moe(x):
        picked = mx.take_along_axis(x, idx, axis=1)  # GatherAxis
        outs = mx.gather_mm(x[:, None, None, :], experts, rhs_indices=routes)  # GatherMM: [2, 2, 1, 3]
        return picked.sum() + outs.sum(axis=(1, 2))

    imported = _check_mlx(moe, x)
    assert "take_along_axis" in _ops(imported.graph) and "matmul" in _ops(imported.graph)


@requires("mlx.core")
def test_mlx_errors_name_the_users_source_line():
    import mlx.core as mx

    def helper(x):
        return mx.sort(x, axis=0)  # unsupported: Sort

    def model(x):
        y = x * 2.0
        return helper(y) + 1.0

    with pytest.raises(ModelImportError) as err:
        from_mlx(model, mx.ones((3,)))
    message = str(err.value)
    assert "unsupported MLX primitive Sort" in message and "float32[3]" in message
    assert f"{__file__}:{helper.__code__.co_firstlineno + 1} in helper" in message
    assert "primitive #" not in message


@requires("mlx.core")
def test_mlx_errors_inside_library_layers_name_the_calling_line():
    import mlx.core as mx
    import mlx.nn as nn

    layer = nn.Conv2d(2, 2, 3)  # a 2-D Convolution: no IR op; made inside mlx.nn, called from here
    mx.eval(layer.parameters())

    def model(x):
        return layer(x)

    with pytest.raises(ModelImportError) as err:
        from_mlx(model, mx.ones((1, 5, 5, 2)))
    assert f"{__file__}:{model.__code__.co_firstlineno + 1} in model" in str(err.value)
    assert "only 1-D convolutions (conv1d) are supported, not 2-D" in str(err.value)


# ----------------------------------------------------------------------------- from_jax

jax_only = requires("jax", "mlx.core")  # the JAX import is checked on the MLX target too


def _check_jax(fn, *args):
    """The import reproduces ``fn`` on every target (within rounding: XLA rounds a fused chain once)."""
    imported = from_jax(fn, *args)
    expected = np.asarray(fn(*args))
    for target in ("jax", "numpy", "mlx"):
        assert_close(run(lower(imported.graph, target), *args, **imported.params), expected, elementwise=True)
    return imported


@jax_only
@pytest.mark.parametrize("name", ["sqrt", "tanh", "log", "log1p", "expm1", "abs", "sign", "erf"])
def test_jax_unary_equations(rng, name):
    import jax
    import jax.numpy as jnp

    fn = jax.lax.erf if name == "erf" else getattr(jnp, name)
    imported = _check_jax(fn, random_array(rng, (3, 5), "float32", low=0.1, high=3.0))
    assert _ops(imported.graph) == [name]


@jax_only
def test_jax_powers_follow_jaxs_own_products(rng):
    import jax.numpy as jnp

    x = random_array(rng, (4, 6), "float32", low=0.5, high=2.0)
    for y in (0, 1, 2, 3, 5, 8, -2):
        _check_jax(lambda x: x**y, x)
    imported = _check_jax(lambda x: x**5, x)
    assert _ops(imported.graph).count("mul") == 3  # x*x, (x*x)*(x*x), x * that: square-and-multiply
    imported = _check_jax(lambda x: jnp.power(x, 2.5), x)
    assert "power" in _ops(imported.graph)


@jax_only
def test_jax_clamp_minimum_comparisons_and_select_n(rng):
    import jax
    import jax.numpy as jnp

    x = random_array(rng, (3, 5), "float32")

    def select(x):
        which = (x > 0).astype(jnp.int32) + (x > 1).astype(jnp.int32)
        clipped = jax.lax.clamp(-0.5, x, 0.5) + jnp.clip(x, -1, 1) + jnp.minimum(x, 0.1)
        return jax.lax.select_n(which, x, 2 * x, 3 * x) + jnp.where(~(x != 1.0), 1.0, clipped)

    imported = _check_jax(select, x)
    assert {"minimum", "maximum", "logical_not", "equal", "where"} <= set(_ops(imported.graph))


@jax_only
def test_jax_gathers_embedding_take_and_take_along_axis(rng):
    import jax.numpy as jnp

    table = random_array(rng, (10, 4), "float32")
    x = random_array(rng, (2, 5, 3), "float32")
    tokens = np.array([[1, 2, -3]], np.int32)
    idx = rng.integers(0, 5, (2, 4, 3)).astype(np.int32)
    embedded = _check_jax(lambda t: jnp.asarray(table)[t], tokens)
    assert "take" in _ops(embedded.graph)
    _check_jax(lambda x: jnp.take(x, jnp.array([4, 0, 2, 2]), axis=1), x)
    _check_jax(lambda x, i: jnp.take_along_axis(x, i, axis=1), x, idx)


@requires("jax")
def test_jax_gathers_of_one_window_import_and_of_several_are_refused(rng):
    """One window is a dynamic slice, its start clamped as JAX's gather clamps it; several are refused by name."""
    import jax

    x = random_array(rng, (6, 4), "float32")
    window = jax.lax.GatherDimensionNumbers(offset_dims=(0, 1), collapsed_slice_dims=(), start_index_map=(0,))

    def one(x, i):
        return jax.lax.gather(x, i.reshape(1), window, slice_sizes=(2, 4))

    imported = from_jax(one, x, np.int32(1))
    for start in (1, 5):
        got = run(lower(imported.graph, "numpy"), x, np.int32(start))
        np.testing.assert_array_equal(got, np.asarray(jax.jit(one)(x, np.int32(start))))
    several = jax.lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,))
    with pytest.raises(ModelImportError, match=r"only point gathers \(slice size 1 on every indexed axis\) and single"):
        from_jax(lambda x, i: jax.lax.gather(x, i[:, None], several, slice_sizes=(2, 4)), x, np.array([0, 3], np.int32))
