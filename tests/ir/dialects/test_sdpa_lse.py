"""``sdpa_lse``, sdpa's log-sum-exp output: shape rule, the three targets, and JAX's ``return_residual`` as a peer."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, ShapeError, TensorSpec, ops, trace
from attnpass.lowering import lower
from tests.util import assert_close, random_array, requires, target_params

TARGETS = target_params("numpy", "mlx", "jax")


def lse_graph(dtype: str, mask: str | None, causal: str | None, hq: int = 6, hkv: int = 2, s: int = 3, t: int = 10):
    specs = [TensorSpec((2, hq, s, 16), dtype), TensorSpec((2, hkv, t, 16), dtype), TensorSpec((2, hkv, t, 8), dtype)]
    if mask is not None:
        specs.append(TensorSpec((1, 1, s, t), "bool" if mask == "bool" else dtype))

    def masked(q, k, v, m):
        return ops.sdpa_lse(q, k, v, scale=0.3, mask=m, causal=causal)

    def unmasked(q, k, v):
        return ops.sdpa_lse(q, k, v, scale=0.3, causal=causal)

    return trace(unmasked if mask is None else masked, *specs)


def inputs(graph, rng: np.random.Generator) -> list[np.ndarray]:
    """Random q/k/v and mask; key 0 is visible to every row (so top-left causal rows attend something)."""
    arrays = [random_array(rng, t.shape, t.dtype) for t in graph.input_types()]
    if len(arrays) == 4:
        if arrays[3].dtype != np.bool_:
            arrays[3] = np.where(rng.random(arrays[3].shape) < 0.3, -np.inf, arrays[3]).astype(arrays[3].dtype)
        arrays[3][..., 0] = True if arrays[3].dtype == np.bool_ else 0
    return arrays


def test_the_shape_rule_is_sdpas_with_the_value_axis_dropped_in_float32():
    graph = lse_graph("bfloat16", "bool", None)
    assert str(graph.node("sdpa_lse").type) == "f32[2,6,3]"
    with pytest.raises(ShapeError, match="query heads 6 not divisible by kv heads 4"):
        lse_graph("float32", None, None, hkv=4)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("dtype", "mask", "causal"),
    [
        ("float32", "bool", None),
        ("bfloat16", "additive", None),
        ("float32", None, "bottom_right"),
        ("float16", "bool", "top_left"),
    ],
)
def test_every_target_computes_the_float64_references_lse(target, dtype, mask, causal, rng):
    graph = lse_graph(dtype, mask, causal)
    arrays = inputs(graph, rng)
    expected = run(lower(graph, "numpy"), *arrays)
    assert expected.dtype == np.float32 and np.isfinite(expected).all()
    assert_close(run(lower(graph, target), *arrays), expected, DType.float32, rtol=1e-5)


@requires("jax")
def test_it_is_jaxs_return_residual_in_float32(rng):
    import jax

    graph = lse_graph("float32", "bool", None)
    q, k, v, m = inputs(graph, rng)
    swap = [np.swapaxes(x, 1, 2) for x in (q, k, k)]  # the residual does not read v (jax wants Dv == D)
    _, residual = jax.nn.dot_product_attention(*swap, mask=m, scale=0.3, return_residual=True)
    ours = run(lower(graph, "jax"), q, k, v, m)
    np.testing.assert_allclose(ours, np.swapaxes(np.asarray(residual), 1, 2), rtol=1e-6, atol=0)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("mask", "causal"), [("bool", None), (None, "bottom_right"), ("additive", "bottom_right")])
def test_a_row_that_attends_no_key_is_minus_infinity_on_every_target(target, mask, causal, rng):
    """sdpa gives such a row the mean of V (docs/semantics.md §4); its log-sum-exp says it attended nothing.

    (JAX's own return_residual is its finite fill there, -0.7 * float32 max + log T: not a value to combine by.)
    """
    graph = lse_graph("float32", mask, causal, s=12)  # bottom-right with S = 12 > T = 10: rows 0 and 1 see nothing
    arrays = inputs(graph, rng)
    if mask == "bool":
        arrays[3][..., :2, :] = False
    out = run(lower(graph, target), *arrays)
    assert np.all(out[:, :, :2] == -np.inf)
    assert np.isfinite(out[:, :, 2:]).all()
    assert_close(out[:, :, 2:], run(lower(graph, "numpy"), *arrays)[:, :, 2:], DType.float32, rtol=1e-5)
