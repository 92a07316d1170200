"""raise-attention's structured-mask rule (issue 23): a bool mask built from positions becomes sdpa's causal kind
and ``window``, proven on every pair; any other mask stays dense with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, from_jax, from_mlx, ops, trace
from attnpass.ir.dialects.attention import Window
from attnpass.lowering import lower
from attnpass.passes import RaiseAttention
from tests.util import assert_bits_equal, assert_close, lazy_import, requires

mx = lazy_import("mlx.core")
jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")
base = lazy_import("mlx_lm.models.base")
HQ, HKV, D, SCALE = 4, 2, 16, 0.25


def raised(graph):
    result = RaiseAttention()(graph)
    (sdpa,) = [n for n in result.graph.nodes() if n.op == "sdpa"]
    (remark,) = [r for r in result.remarks if r.rule == "structured-mask"]
    return result, sdpa, remark


@requires("mlx.core", "mlx_lm")
@pytest.mark.parametrize("n, offset, window", [(8, 0, 3), (5, 7, 4), (8, 0, None), (6, 10, None), (9, 0, 16)])
def test_mlx_lm_create_causal_mask_becomes_the_window(n, offset, window):
    """mlx-lm's mask of a (sliding-window) prefill: q_len n after ``offset`` cached keys, bottom-right aligned."""
    rng = np.random.default_rng(0)
    args = [mx.array(rng.standard_normal((1, h, t, D)).astype(np.float32))
            for h, t in ((HQ, n), (HKV, n + offset), (HKV, n + offset))]  # fmt: skip

    def layer(q, k, v):
        mask = base.create_causal_mask(q.shape[2], offset, window_size=window)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)

    result, sdpa, remark = raised(from_mlx(layer, *args).graph)
    assert remark.kind == "applied" and len(sdpa.inputs) == 3
    binding = window is not None and window < n + offset
    assert sdpa.attrs["causal"] == "bottom_right"
    assert sdpa.attrs["window"] == (Window(window) if binding else None)
    assert f"all {n * (n + offset)} pairs checked" in remark.message
    expected = np.array(layer(*args))
    assert_bits_equal(run(lower(result.graph, "mlx"), *args), expected)  # the same mask, MLX's same call
    assert_close(run(lower(result.graph, "numpy"), *args), expected)


@requires("mlx.core")
@pytest.mark.parametrize("spelling", ["equal", "llama4"])
def test_a_chunked_mask_built_in_the_function_becomes_the_chunk(spelling):
    """Chunked attention: same chunk of 4 and causal, from aranges (llama4 spells it with mx.abs)."""
    rng = np.random.default_rng(1)
    args = [mx.array(rng.standard_normal((1, h, 10, D)).astype(np.float32)) for h in (HQ, HKV, HKV)]

    def layer(q, k, v):
        pos = mx.arange(10)
        if spelling == "equal":
            mask = (pos[:, None] >= pos[None]) & ((pos[:, None] // 4) == (pos[None] // 4))
        else:
            mask = (mx.abs(pos[None] // 4 - pos[:, None] // 4) == 0) & (pos[None] <= pos[:, None])
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)

    result, sdpa, remark = raised(from_mlx(layer, *args).graph)
    assert sdpa.attrs["window"] == Window(None, None, 4) and len(sdpa.inputs) == 3
    assert_bits_equal(run(lower(result.graph, "mlx"), *args), np.array(layer(*args)))


@requires("jax")
def test_jax_local_window_size_becomes_the_window():
    """jax.nn.dot_product_attention(is_causal=True, local_window_size=(3, 0)): key i-3 .. i, i.e. left 4."""
    rng = np.random.default_rng(2)
    q, k = (rng.standard_normal((1, 9, h, D)).astype(np.float32) for h in (HQ, HKV))

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 0))

    result, sdpa, remark = raised(from_jax(attend, q, k, k).graph)
    assert (sdpa.attrs["causal"], sdpa.attrs["window"]) in {("bottom_right", Window(4)), ("top_left", Window(4))}
    assert_close(run(lower(result.graph, "jax"), q, k, k), np.asarray(attend(q, k, k)))


def _traced(mask: np.ndarray):
    q, kv = TensorSpec((1, HQ, 6, D), DType.float32), TensorSpec((1, HKV, 6, D), DType.float32)
    return trace(lambda q, k, v, m: ops.sdpa(q, k, v, mask=m), q, kv, kv, TensorSpec(mask.shape, DType.bool))


def test_a_mask_that_is_an_input_stays_dense_and_says_so():
    _result, sdpa, remark = raised(_traced(np.tril(np.ones((6, 6), bool))))
    assert (remark.kind, remark.reason, remark.node) == ("declined", "mask_not_static", sdpa.name)
    assert len(sdpa.inputs) == 4 and "graph input m" in remark.message  # it names the mask


@requires("mlx.core")
@pytest.mark.parametrize(
    "flip, names",
    [((4, 3), "row 4"),  # a hole in a window row: the remark names the row
     ((1, 2), "")],  # one key past the diagonal
)  # fmt: skip
def test_a_mask_one_pair_off_a_structure_stays_dense(flip, names):
    rng = np.random.default_rng(3)
    args = [mx.array(rng.standard_normal((1, h, 6, D)).astype(np.float32)) for h in (HQ, HKV, HKV)]
    dense = np.tril(np.ones((6, 6), bool)) & ~np.tril(np.ones((6, 6), bool), -3)  # window 3
    dense[flip] = not dense[flip]

    def layer(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.array(dense))

    result, sdpa, remark = raised(from_mlx(layer, *args).graph)
    assert (remark.kind, remark.reason) == ("declined", "mask_not_structured") and names in remark.message
    assert sdpa.attrs["window"] is None and len(sdpa.inputs) == 4
    assert_bits_equal(run(lower(result.graph, "mlx"), *args), np.array(layer(*args)))
