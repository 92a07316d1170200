"""from_jax of the primitives model libraries stopped at (issue 32, item 6): scans, ``rem``, ``pow``, mixed dtypes,
``stack``, ``remat``. Each function is imported, lowered to numpy, MLX and JAX, and compared with ``jax.jit`` of
the function itself: bit for bit where the op is exact (integer scans, max/min scans, ``rem``, moves, casts, a
product chain) or where the JAX target runs the same primitive; within the dtype's tolerance where float
arithmetic is reassociated or computed wider (the numpy reference rounds once from float64)."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import ModelImportError, from_jax
from attnpass.lowering import lower
from tests.util import assert_bits_equal, assert_close, lazy_import, requires

pytestmark = requires("jax", "mlx.core")
jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")
lax = lazy_import("jax.lax")

EVERY = ("numpy", "mlx", "jax")


def _check(fn, *args, exact=EVERY, op: str | None = None) -> None:
    """``fn`` imported (``op``: an IR op the import must contain), lowered to every target, compared with
    ``jax.jit(fn)``: bit for bit on the ``exact`` targets, within the dtype's tolerance on the others."""
    imported = from_jax(fn, *args)
    if op is not None:
        assert op in {n.op for n in imported.graph.nodes()}
    expected = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(jax.jit(fn)(*args))]
    for target in EVERY:
        got = run(lower(imported.graph, target), *args, **imported.params)
        for actual, wanted in zip(got if len(expected) > 1 else [got], expected, strict=True):
            if target in exact:
                assert_bits_equal(actual, wanted)
            else:
                assert_close(actual, wanted)


def _floats(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ----------------------------------------------------------------------------- scans


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_float_cumsum_and_cumprod(rng, axis, reverse):
    x = _floats(rng, (4, 6))
    _check(lambda x: lax.cumsum(x, axis=axis, reverse=reverse), x, exact=("jax",), op="scan")
    _check(lambda x: lax.cumprod(x, axis=axis, reverse=reverse), x, exact=("jax",), op="scan")


@pytest.mark.parametrize("reverse", [False, True])
def test_cummax_cummin_and_integer_cumsum_are_exact_everywhere(rng, reverse):
    x = _floats(rng, (4, 6))
    _check(lambda x: lax.cummax(x, axis=1, reverse=reverse), x, op="scan")
    _check(lambda x: lax.cummin(x, axis=0, reverse=reverse), x, op="scan")
    _check(lambda n: lax.cumsum(n, axis=1, reverse=reverse), rng.integers(-9, 9, (3, 7)).astype(np.int32))


def test_positions_from_a_padding_mask_by_cumsum(rng):
    """``positions = cumsum(mask) - 1`` of a left-padded batch (a JAX generation loop's positions)."""
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
    _check(lambda m: jnp.cumsum(m.astype(jnp.int32), axis=-1) - 1, mask, op="scan")


# ----------------------------------------------------------------------------- rem and remainder

DIVIDENDS = [-7.5, -3.25, -2.0, -0.0, 0.0, 1.0, 3.25, 7.5, 9.0]
DIVISORS = [-3.0, -2.0, -0.75, 0.75, 2.0, 3.0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_rem_takes_the_dividends_sign_exactly(dtype):
    """``lax.rem`` is C's fmod: the sign of the dividend, ``-0.0`` kept; ``x % y`` (jnp.remainder) the divisor's."""
    x = np.array(DIVIDENDS, np.float32).astype(jnp.dtype(dtype))[:, None]
    y = np.array(DIVISORS, np.float32).astype(jnp.dtype(dtype))[None, :]
    _check(lambda x, y: lax.rem(x, y), x, y, op="remainder")
    _check(lambda x, y: x % y, x, y)


def test_integer_rem_and_remainder_signs_are_exact():
    x = np.arange(-9, 10, dtype=np.int32)[:, None]
    y = np.array([-4, -3, -1, 1, 2, 5], np.int32)[None, :]
    _check(lambda x, y: lax.rem(x, y), x, y, op="remainder")
    _check(lambda x, y: x % y, x, y)
    _check(lambda x, y: x // y, x, y)


def test_a_ring_buffer_index():
    """The next slot of a 64-slot ring buffer cache, ``(i + 1) % 64``, and the slot of a negative offset."""
    for i in (0, 5, 63, 64, -1):
        _check(lambda i: ((i + 1) % 64, (i - 70) % 64), np.int32(i))


# ----------------------------------------------------------------------------- pow


def test_pow_by_an_int32_exponent(rng):
    """``x ** n`` with an int32 array ``n`` (``lax.pow`` of mixed dtypes): the exponent cast to the base's dtype."""
    x = _floats(rng, (3, 5)) + np.float32(0.5)
    n = np.array([[-2, -1, 0, 1, 2], [3, 4, 0, 2, 1], [1, 1, 2, -3, 5]], np.int32)
    _check(lambda x, n: lax.pow(x, n), x, n, exact=("jax",), op="power")
    _check(lambda x, n: x**n, x, n, exact=("jax",), op="power")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_by_a_static_square_is_exact_where_the_products_are(rng, dtype):
    """A multi-backend library's RMSNorm writes ``x ** 2``: integer_pow, a product (exact everywhere); the mean
    and rsqrt within the tolerance."""
    x = _floats(rng, (2, 3, 16), jnp.dtype(dtype))
    _check(lambda x: x**2, x, op="mul")
    _check(lambda x: x * lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6), x, exact=("jax",))


def test_integer_pow_by_an_array_exponent_is_declined_by_name():
    """``jnp.power`` of an int base by an int array runs square-and-multiply over the exponent's bits (bitwise
    and, shifts): no IR op, so the import names it and says what to write instead."""
    x = np.array([2, -3, 4], np.int32)
    with pytest.raises(ModelImportError, match=r"bitwise and of integers.*jnp.power of an integer base.*float"):
        from_jax(lambda x, n: x**n, x, np.array([1, 2, 3], np.int32))
    _check(lambda x: x**3, x, op="mul")  # a static exponent: products, exact


# ----------------------------------------------------------------------------- promotion, stack, remat


def test_binary_ops_of_mixed_dtypes_promote_as_jax_does(rng):
    f32, bf16 = _floats(rng, (3, 4)), _floats(rng, (3, 4), jnp.bfloat16)
    i32 = rng.integers(-5, 5, (3, 4)).astype(np.int32)
    _check(lambda a, b: a + b, bf16, f32)
    _check(lambda a, b: a * b, f32, i32)
    _check(lambda a, b: (a < b, jnp.maximum(a, b)), i32, bf16)
    _check(lambda a, b: lax.pow(a, b), f32, i32, exact=("jax",))
    assert from_jax(lambda a, b: a + b, bf16, f32).graph.node("add").type.dtype.value == "float32"


def test_stack_and_rope_by_stack(rng):
    x, y = _floats(rng, (2, 3)), _floats(rng, (2, 3))
    _check(lambda x, y: (jnp.stack([x, y]), jnp.stack([x, y], axis=-1)), x, y, op="concat")

    def rope(x, angles):  # interleaved rotary embedding: pairs rotated and stacked back
        x1, x2 = x[..., ::2], x[..., 1::2]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)

    _check(rope, _floats(rng, (1, 4, 2, 8)), _floats(rng, (4, 1, 4)), exact=("jax",))


@pytest.mark.parametrize("checkpoint", ["checkpoint", "remat-policy"])
def test_remat_blocks_are_inlined(rng, checkpoint):
    """``jax.checkpoint`` (remat2) around a block: its body imported in place, no call left."""
    w = _floats(rng, (8, 8)) * np.float32(0.3)

    def block(x):
        return x + jnp.tanh(x @ w)

    policy = jax.checkpoint_policies.nothing_saveable if checkpoint == "remat-policy" else None
    wrapped = jax.checkpoint(block, policy=policy)
    x = _floats(rng, (2, 8))
    _check(lambda x: wrapped(wrapped(x)), x, exact=("jax",), op="tanh")


# ----------------------------------------------------------------------------- what the libraries of the zoo needed


def test_all_and_any_of_bools(rng):
    """``jnp.all`` / ``jnp.any`` (KerasHub's Gemma: a row that attends no token) are exact on every target."""
    m = rng.random((2, 3, 5)) < 0.7
    m[0, 0] = True
    _check(lambda m: (jnp.all(m, axis=-1), jnp.any(m, axis=(0, 2)), jnp.all(m)), m, op="sum")
    with pytest.raises(ModelImportError, match=r"reduce_and of integers \(bitwise\) is not in the IR"):
        from_jax(lambda x: lax.reduce_and(x, (0,)), np.ones((3,), np.int32))


@pytest.mark.parametrize("start", [0, 3, 5, 9, -2])
def test_a_vmapped_dynamic_slice_is_one_window_gather(rng, start):
    """vmap of ``lax.dynamic_slice`` is a gather of one window (penzai's named-axis slices): the start is
    clamped so the window fits, as in JAX; an uncollapsed point gather keeps its unit axis."""
    x = rng.integers(0, 50, (2, 12)).astype(np.int32)
    window = jax.vmap(lambda row, i: lax.dynamic_slice(row, (i,), (4,)), in_axes=(0, None))
    _check(window, x, np.int32(start), op="take")
    table = _floats(rng, (6, 10))
    point = jax.vmap(lambda t, i: lax.dynamic_slice_in_dim(t, i, 1, axis=0), in_axes=(1, None), out_axes=1)
    _check(point, table, np.int32(start % 6))


def test_a_point_gather_that_keeps_its_indexed_axis(rng):
    """penzai's embedding lookup: the indexed axis is not collapsed but kept with size 1 (``offset_dims`` lists it)."""
    table = _floats(rng, (8, 12))
    numbers = lax.GatherDimensionNumbers(offset_dims=(0, 3), collapsed_slice_dims=(), start_index_map=(1,))

    def lookup(table, ids):
        return lax.gather(table, ids[..., None], numbers, slice_sizes=(8, 1), mode="clip")

    _check(lookup, table, np.array([[3, 11]], np.int32), op="take")
