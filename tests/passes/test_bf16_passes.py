"""Every registered pass runs on bf16 graphs: traced, imported from MLX and from JAX.

bf16 is what real checkpoints use, and numpy's own dtype queries reject it
(``np.finfo(bfloat16)`` raised inside raise-attention for every bf16 attention
with a bool mask). Each pass must run, leave a valid graph and compute the same
function on the numpy reference: bit for bit for the passes that only move values
(canonicalize, dce, narrow-inputs, head-chunk), within bf16 rounding where a
decomposed attention becomes an sdpa, an sdpa becomes f32 matmuls and a
softmax (decompose-sdpa) or an sdpa is split over its keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, from_jax, from_mlx, ops, trace
from attnpass.lowering import lower
from attnpass.models.catalog import build_example
from attnpass.passes import PassManager, available_passes, get_pass
from tests.attention_sources import llama_attention
from tests.util import RTOL, assert_bits_equal, assert_close, available, random_array

B, HQ, HKV, S, T, D = 1, 4, 2, 3, 6, 8
# Passes whose rewrite may round differently: raise-attention (stated in its remarks), decompose-sdpa (f32
# matmuls and softmax); split-kv and shard-attention's seq split round each shard's partial to the sdpa's dtype
# before the float32 combine.
ROUNDING = {"raise-attention", "decompose-sdpa", "split-kv", "shard-attention"}
# Passes built with options (shard-attention names mesh axes), and the mesh declared on the graph for them.
OPTIONS = {"shard-attention": {"heads": "x", "seq": "y"}}
MESH = {"x": 2, "y": 2}


def _traced_bool_mask_attention():
    """MLX's spelling: where(mask, scores, dtype min) before the softmax, repeated K/V."""

    def attention(q, k, v, mask):
        def repeat(x):
            return ops.reshape(
                ops.broadcast_to(ops.reshape(x, (B, HKV, 1, T, D)), (B, HKV, HQ // HKV, T, D)), (B, HQ, T, D)
            )

        scores = ops.matmul(q * 0.35, ops.transpose(repeat(k), (0, 1, 3, 2)))
        fill = ops.constant(float(np.finfo(np.float32).min), "bfloat16", like=q)  # rounds to the bf16 min
        scores = ops.where(mask, scores, fill)
        e = ops.exp(scores - ops.max(scores, -1, keepdims=True))
        return ops.matmul(e / ops.sum(e, -1, keepdims=True), repeat(v))

    specs = [TensorSpec(s, "bfloat16") for s in ((B, HQ, S, D), (B, HKV, T, D), (B, HKV, T, D))]
    return trace(attention, *specs, TensorSpec((S, T), "bool"), name="bool_mask_attention"), {}


def _mlx_llama():
    import mlx.core as mx

    attention, x = llama_attention(mx.bfloat16)
    imported = from_mlx(attention, x)
    return imported.graph, imported.params


def _mlx_fast_sdpa_with_a_bool_mask():
    import mlx.core as mx

    def attention(q, k, v, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=mask)

    shapes = ((B, HQ, S, D), (B, HKV, T, D), (B, HKV, T, D))
    args = [mx.zeros(s, dtype=mx.bfloat16) for s in shapes] + [mx.ones((B, 1, S, T), dtype=mx.bool_)]
    return from_mlx(attention, *args).graph, {}


def _jax_dot_product_attention_with_a_bool_mask():
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask)

    shapes = ((B, S, HQ, D), (B, T, HKV, D), (B, T, HKV, D))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes] + [jax.ShapeDtypeStruct((B, 1, S, T), jnp.bool_)]
    return from_jax(attention, *args).graph, {}


def _jax_einsum_attention_with_a_where_mask():
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, mask):
        scores = jnp.einsum("bhsd,bhtd->bhst", q, jnp.repeat(k, HQ // HKV, axis=1)) / np.sqrt(D)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.bfloat16).min)
        return jnp.einsum("bhst,bhtd->bhsd", jax.nn.softmax(scores, axis=-1), jnp.repeat(v, HQ // HKV, axis=1))

    shapes = ((B, HQ, S, D), (B, HKV, T, D), (B, HKV, T, D))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes] + [jax.ShapeDtypeStruct((S, T), jnp.bool_)]
    return from_jax(attention, *args).graph, {}


GRAPHS = {
    "traced-bool-mask-attention": (_traced_bool_mask_attention, None),
    "traced-qwen38-verify": (lambda: (build_example("qwen38-verify", q_len=3, n_kv=64), {}), None),
    "mlx-llama-prefill": (_mlx_llama, "mlx.core"),
    "mlx-fast-sdpa-bool-mask": (_mlx_fast_sdpa_with_a_bool_mask, "mlx.core"),
    "jax-dot-product-attention-bool-mask": (_jax_dot_product_attention_with_a_bool_mask, "jax"),
    "jax-einsum-where-mask": (_jax_einsum_attention_with_a_where_mask, "jax"),
}


def _arrays(graph, params, rng):
    """Inputs of every type; a bool mask attends key 0 on every row (no row attends nothing)."""
    arrays = []
    for name, t in zip(graph.inputs, graph.input_types()):
        if name in params:
            arrays.append(params[name])
            continue
        value = random_array(rng, t.shape, t.dtype)
        if t.dtype.value == "bool":
            value[..., 0] = True
        arrays.append(value)
    return arrays


@pytest.mark.parametrize("pass_name", available_passes())
@pytest.mark.parametrize("graph_name", list(GRAPHS))
def test_every_pass_runs_on_bf16_graphs(rng, graph_name, pass_name):
    build, needs = GRAPHS[graph_name]
    if needs is not None and not available(needs):
        pytest.skip(f"needs {needs}")
    graph, params = build()
    assert any(t.dtype.value == "bfloat16" for t in graph.input_types())
    if pass_name in OPTIONS:
        graph.set_mesh(MESH)
    result = PassManager([get_pass(pass_name)(**OPTIONS.get(pass_name, {}))]).run(graph)
    assert result.remarks, "every pass leaves at least one remark"
    arrays = _arrays(graph, params, rng)
    expected = run(lower(graph, "numpy"), *arrays)
    actual = run(lower(result.graph, "numpy"), *arrays)
    if pass_name in ROUNDING:  # one side rounds its intermediates to bf16 or f32 where the other rounds once
        assert_close(actual, expected, rtol=RTOL[DType.bfloat16])
    else:
        assert_bits_equal(actual, expected)


def test_bool_masked_bf16_attention_is_raised_not_crashed():
    graph, _params = _traced_bool_mask_attention()
    result = PassManager([get_pass("raise-attention")()]).run(graph)
    (sdpa,) = [n for n in result.graph.nodes() if n.op == "sdpa"]
    mask = result.graph.node(sdpa.inputs[3])
    # a -inf fill keeps the source's NaN rows: the bool mask becomes where(mask, 0, -inf) in q's dtype
    bool_mask = mask if mask.type.dtype.value == "bool" else result.graph.node(mask.inputs[0])
    assert sdpa.type.dtype.value == "bfloat16" and bool_mask.type.dtype.value == "bool"
