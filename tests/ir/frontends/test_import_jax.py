"""from_jax: jaxpr equations -> IR ops with exact parameters, nested calls inlined, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import ModelImportError, from_jax
from attnpass.ir.frontends.import_jax import IMPORTERS
from attnpass.lowering import lower
from tests.util import assert_close, lazy_import, requires

pytestmark = requires("jax")
jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")


def _ops(graph):
    return [n.op for n in graph.nodes() if n.op != "input"]


def _check_targets(imported, fn, *args):
    expected = np.asarray(fn(*args))
    for target in ("jax", "mlx", "numpy"):
        assert_close(run(lower(imported.graph, target), *args, **imported.params), expected)


@requires("jax", "mlx.core")
@pytest.mark.parametrize(
    "spec, shapes",
    [
        ("bhsd,bhtd->bhst", ((2, 3, 4, 5), (2, 3, 6, 5))),
        ("bshd,bthd->bhst", ((2, 4, 3, 5), (2, 6, 3, 5))),
        ("bhst,bthd->bshd", ((2, 3, 4, 6), (2, 6, 3, 5))),
        ("ij,kj->ik", ((4, 5), (3, 5))),
        ("bij,jk->bki", ((2, 4, 5), (5, 3))),
    ],
)
def test_dot_general_becomes_transpose_reshape_matmul(rng, spec, shapes):
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)

    def contract(a, b):
        return jnp.einsum(spec, a, b)

    imported = from_jax(contract, a, b)
    assert _ops(imported.graph).count("matmul") == 1
    _check_targets(imported, contract, a, b)


@requires("jax", "mlx.core")
def test_nested_jit_and_custom_derivatives_are_inlined(rng):
    x = rng.standard_normal((3, 9)).astype(np.float32)
    w = rng.standard_normal((9, 9)).astype(np.float32)

    @jax.jit
    def inner(x):
        return jax.nn.relu(x) + jax.lax.stop_gradient(x) ** 3

    def outer(x):
        y = jax.nn.softmax(inner(x) @ w, axis=0)
        return jnp.where(y > 0.1, jax.nn.sigmoid(y), jnp.sin(y)).astype(jnp.float16)

    imported = from_jax(outer, x)
    ops_ = _ops(imported.graph)
    assert {"max", "sum", "exp", "div", "maximum", "where", "sigmoid", "sin", "cast"} <= set(ops_)
    assert ops_.count("mul") >= 2  # x ** 3 as two multiplications
    (param,) = imported.params  # w: 81 elements, captured as a resident input
    assert imported.graph.input_role(param) == "resident"
    _check_targets(imported, outer, x)


@requires("jax", "mlx.core")
def test_shape_dtype_structs_iota_slices_and_broadcasts(rng):
    spec = jax.ShapeDtypeStruct((2, 6), jnp.float32)

    def layout(x):
        a, b = jnp.split(x, [2], axis=1)
        ramp = jnp.arange(6, dtype=jnp.float32).reshape(1, 6)
        return (
            jnp.concatenate([b[:, ::2], a], axis=1)
            + jnp.broadcast_to(ramp[:, :4], (2, 4))
            + jnp.max(x, axis=1, keepdims=True)
        )

    imported = from_jax(layout, spec)
    assert imported.graph.inputs == ("x",)
    (bcast,) = [n for n in imported.graph.nodes() if n.op == "broadcast_to" and n.attrs["shape"] == (2, 4)]
    assert bcast.type.shape == (2, 4)
    x = rng.standard_normal((2, 6)).astype(np.float32)
    _check_targets(imported, layout, x)


def test_unsupported_primitive_names_itself_and_the_source_line(rng):
    x = rng.random((2, 3)).astype(np.float32) + 0.5

    def with_sort(x):
        return jnp.sort(x * 2.0, axis=1)

    with pytest.raises(ModelImportError) as err:
        from_jax(with_sort, x)
    message = str(err.value)
    assert "unsupported JAX primitive sort" in message and "equation #1" in message and "float32[2,3]" in message
    assert "test_import_jax.py" in message and "with_sort" in message
    supported = message.split("the JAX importer supports ", 1)[1].split("\n")[0].split(", ")
    assert supported == sorted(IMPORTERS) and {"cumsum", "dot_general", "remat2", "stack"} <= set(supported)
