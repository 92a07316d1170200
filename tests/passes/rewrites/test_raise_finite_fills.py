"""raise-attention and finite mask fills (docs/semantics.md §1.2): ``where(mask, s, -1e30)`` is raised when the
fill sits at least 2^24 + 1024 below zero (half the max in float16), computes what the source does on every row,
fully masked rows included (the mean of V), and anything else is declined naming the fill and the bound."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, from_jax, ops, trace
from attnpass.lowering import lower
from attnpass.passes import PassManager, RaiseAttention
from tests.util import assert_bits_equal, assert_close, random_array, requires, target_params

B, H, S, T, D = 1, 2, 4, 8, 8  # T a power of two: a fully masked row's weights 1/T are exact


def _softmax(x):
    e = ops.exp(ops.sub(x, ops.max(x, -1, keepdims=True)))
    return ops.div(e, ops.sum(e, -1, keepdims=True))


def _source(fill, dtype, *, scale_after=None, additive=False):
    """q·kᵀ/√D masked by where(m, s, fill) (then scaled by ``scale_after``), softmax, ·v; ``additive``: a
    float mask added to the scores before the where."""

    def attention(q, k, v, m, bias=None):
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * 0.125
        if bias is not None:
            scores = scores + bias
        masked = ops.where(m, scores, ops.constant(fill, dtype, like=scores))
        if scale_after is not None:
            masked = masked * scale_after
        return ops.matmul(_softmax(masked), v)

    specs = [TensorSpec((B, H, n, D), dtype) for n in (S, T, T)] + [TensorSpec((S, T), "bool")]
    if additive:
        return trace(lambda q, k, v, m, bias: attention(q, k, v, m, bias), *specs, TensorSpec((S, T), dtype))
    return trace(lambda q, k, v, m: attention(q, k, v, m), *specs)


def _inputs(dtype, rng):
    q, k, v = (random_array(rng, (B, H, n, D), dtype) for n in (S, T, T))
    allowed = rng.random((S, T)) < 0.5
    allowed[0] = False  # a row that attends no key
    allowed[1] = [True] + [False] * (T - 1)  # one key
    allowed[2:, 1] = True
    return q, k, v, allowed


def _reference(q, k, v, allowed):
    """float64: softmax over the allowed keys only; a row without keys is the mean of V."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = q @ np.swapaxes(k, -1, -2) * 0.125
    scores = np.where(allowed, scores, -np.inf)
    scores = np.where(allowed.any(-1, keepdims=True), scores, 0.0)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def _raise(graph):
    result = PassManager([RaiseAttention()]).run(graph)
    (decision,) = [r for r in result.remarks if r.rule == "attention"]
    return result.graph, decision


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fill", [-1e9, -1e30, "0.7 min"])
def test_a_finite_fill_far_below_the_scores_is_raised_and_exact(rng, dtype, fill, target):
    fill = 0.7 * float(DType.parse(dtype).finfo.min) if fill == "0.7 min" else fill
    source = _source(fill, dtype)
    raised, decision = _raise(source)
    assert decision.kind == "applied" and [n.op for n in raised.nodes()].count("sdpa") == 1
    reached = float(np.asarray(fill, DType.parse(dtype).numpy))  # the fill in the source's dtype
    assert f"fill {reached!r} masks exactly while every row's highest unmasked score is >= {reached + 1024!r}" in (
        decision.message
    )
    q, k, v, allowed = _inputs(dtype, rng)
    expected = _reference(q, k, v, allowed).astype(DType.parse(dtype).numpy)
    source_out = run(lower(source, "numpy"), q, k, v, allowed)
    got = run(lower(raised, target), q, k, v, allowed)
    assert_close(got, expected)
    assert_close(got, source_out)
    # the fully masked row: the mean of V in the source and raised alike, bit for bit on the reference
    assert_bits_equal(run(lower(raised, "numpy"), q, k, v, allowed)[:, :, 0], source_out[:, :, 0])
    assert_bits_equal(source_out[:, :, 0], np.mean(np.asarray(v, np.float64), axis=2).astype(source_out.dtype))


@pytest.mark.parametrize(
    "dtype, fill, scale_after", [("float32", float(np.finfo(np.float32).min), 2.0), ("float16", -1e9, None)]
)
def test_a_fill_that_reaches_minus_infinity_keeps_a_row_without_keys_nan(rng, dtype, fill, scale_after):
    """The dtype's min doubled, or -1e9 in float16, is -inf at the softmax: that row is 0/0 in the source."""
    source = _source(fill, dtype, scale_after=scale_after)
    raised, decision = _raise(source)
    assert decision.kind == "applied" and "masks exactly" not in decision.message
    q, k, v, allowed = _inputs(dtype, rng)
    got, want = run(lower(raised, "numpy"), q, k, v, allowed), run(lower(source, "numpy"), q, k, v, allowed)
    assert np.isnan(want[:, :, 0]).all() and np.isnan(got[:, :, 0]).all()
    assert_close(got[:, :, 1:], want[:, :, 1:])


@pytest.mark.parametrize(
    "dtype, fill, scale_after, named",
    [
        ("float32", -1e4, None, ("with -10000;", "<= -1.68e+07")),
        ("float32", -1e9, 2.0**-30, ("with -1e+09,", "as -0.931323;", "<= -1.68e+07")),  # the fill as it arrives
        ("bfloat16", -2.0**24, None, ("with -1.67772e+07;", "<= -1.68e+07")),
        ("float16", -1e4, None, ("with -10000;", "<= -3.28e+04")),
    ],
)  # fmt: skip
def test_a_fill_too_close_to_the_scores_is_declined_naming_fill_and_bound(dtype, fill, scale_after, named):
    _graph, decision = _raise(_source(fill, dtype, scale_after=scale_after))
    assert (decision.kind, decision.reason) == ("declined", "inexact")
    assert all(value in decision.message for value in named), decision.message  # the fill and the bound


def test_a_finite_fill_over_an_additive_mask_is_declined():
    """sdpa takes one mask, where(bool, additive, -inf): a row the bool leaves without keys would be NaN, where
    the source's finite fill gives it the mean of V."""
    _graph, decision = _raise(_source(-1e30, "float32", additive=True))
    assert (decision.kind, decision.reason) == ("declined", "inexact")


@requires("jax", "mlx.core")
@pytest.mark.parametrize("fill", [-1e9, -1e30])
def test_the_jax_spelling_is_raised_and_matches_jax(rng, fill):
    """haiku-style JAX: jnp.where(mask, scores, -1e30) and jax.nn.softmax."""
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, allowed):
        scores = jnp.einsum("bhsd,bhtd->bhst", q, k) / jnp.sqrt(D).astype(q.dtype)
        return jnp.einsum("bhst,bhtd->bhsd", jax.nn.softmax(jnp.where(allowed, scores, fill), axis=-1), v)

    q, k, v, allowed = _inputs("float32", rng)
    imported = from_jax(attention, q, k, v, allowed)
    raised, decision = _raise(imported.graph)
    assert decision.kind == "applied" and [n.op for n in raised.nodes()].count("sdpa") == 1
    expected = np.asarray(jax.jit(attention)(q, k, v, allowed))
    for target in ("numpy", "jax", "mlx"):
        assert_close(run(lower(raised, target), q, k, v, allowed, **imported.params), expected)


@pytest.mark.parametrize("fills, raised", [((-1e30, -1e30), True), ((-1e30, -1e9), False), ((-np.inf, -1e30), False)])
def test_two_bool_masks_are_raised_only_with_one_fill(rng, fills, raised):
    """Two wheres: a row both leave without keys is uniform over all keys only when the fills are equal; with
    different fills the larger one takes all the weight, so it is declined."""

    def attention(q, k, v, m1, m2):
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * 0.125
        for m, fill in zip((m1, m2), fills):
            scores = ops.where(m, scores, ops.constant(fill, "float32", like=scores))
        return ops.matmul(_softmax(scores), v)

    specs = [TensorSpec((B, H, n, D), "float32") for n in (S, T, T)] + [TensorSpec((S, T), "bool")] * 2
    source = trace(attention, *specs)
    graph, decision = _raise(source)
    assert (decision.kind == "applied") is raised
    if not raised:
        assert (decision.kind, decision.reason) == ("declined", "inexact")
        return
    q, k, v, allowed = _inputs("float32", rng)
    first, second = allowed.copy(), allowed.copy()
    first[0, : T // 2], second[0, T // 2 :] = False, False  # row 0: each mask hides half, together all keys
    first[0, T // 2 :], second[0, : T // 2] = True, True
    args = (q, k, v, first, second)
    expected = _reference(q, k, v, first & second)
    assert_close(run(lower(graph, "numpy"), *args), expected.astype(np.float32))
    assert_bits_equal(run(lower(graph, "numpy"), *args)[:, :, 0], run(lower(source, "numpy"), *args)[:, :, 0])


def test_the_remarks_condition_is_what_exactness_needs(rng):
    """A row whose one unmasked score equals the fill (far from >= fill + 1024): the source weighs its masked
    keys as much as that key, sdpa only that key; on the rows that meet the condition the two agree."""
    fill = -1e9
    raised, decision = _raise(_source(fill, "float32"))
    assert decision.kind == "applied" and "highest unmasked score is >= -999998976" in decision.message
    q, k, v, allowed = _inputs("float32", rng)
    q[:, :, 1] = 0.0
    q[:, :, 1, 0] = 1.0
    k[:, :, 0] = 0.0
    k[:, :, 0, 0] = fill * 8  # row 1 attends key 0 only, with score fill * 8 * 0.125 = fill
    source_out = run(lower(_source(fill, "float32"), "numpy"), q, k, v, allowed)
    got = run(lower(raised, "numpy"), q, k, v, allowed)
    assert_close(got[:, :, 1], v[:, :, 0])  # sdpa: key 0's value
    assert_close(source_out[:, :, 1], v.mean(axis=2))  # the source: every key alike
    assert_close(got[:, :, 2:], source_out[:, :, 2:])
