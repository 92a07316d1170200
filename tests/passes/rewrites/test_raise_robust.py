"""raise-attention on the attention real code writes, and honest about what it does not raise.

- mlx-lm's prefill: V a plain transpose of its projection while Q and K come through
  norm and RoPE (hand-written in :mod:`tests.attention_sources`, mlx.core/mlx.nn only);
- roots [B,H,S,D], [B,S,H,D], unbatched [H,S,D]/[S,H,D]; GQA through repeat,
  broadcast and a grouped 5-d einsum; JAX's attention with and without masks;
- bf16 with the softmax accumulated in float32 (JAX, MLX ``precise``), raised with
  the rounding stated;
- scales moved only where the algebra allows (the two wrong rewrites found by
  fuzzing are regression tests here);
- attention sinks and logit soft-capping declined with the reason; a bf16 additive
  mask with float32 q expressed (checked against MLX's own fast sdpa);
- exactly one remark per candidate, and no remark names an axis it does not mean.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, from_jax, from_mlx, ops, registered_ops, trace
from attnpass.lowering import lower
from attnpass.passes import PassManager, RaiseAttention
from tests.attention_sources import llama_attention
from tests.util import assert_bits_equal, assert_close, random_array, requires

B, HQ, HKV, S, T, D = 1, 4, 2, 3, 5, 8
G = HQ // HKV


def _raise(graph, **options):
    return PassManager([RaiseAttention(**options)]).run(graph)


def _sdpas(graph):
    return [n for n in graph.nodes() if n.op == "sdpa"]


def _decisions(result, rule):
    return [r for r in result.remarks if r.kind in ("applied", "declined") and r.rule == rule]


def _same_function(before, after, *args, rtol=None, dtype=None):
    """The raised graph computes the source's function on the numpy reference."""
    assert_close(run(lower(after, "numpy"), *args), run(lower(before, "numpy"), *args), dtype, rtol=rtol)


def _softmax(x, axis=-1):
    e = ops.exp(ops.sub(x, ops.max(x, axis, keepdims=True)))
    return ops.div(e, ops.sum(e, axis, keepdims=True))


def _inputs(rng, dtype="float32", mask_shape=(S, T)):
    q = random_array(rng, (B, HQ, S, D), dtype)
    k = random_array(rng, (B, HKV, T, D), dtype)
    v = random_array(rng, (B, HKV, T, D), dtype)
    mask = random_array(rng, mask_shape, dtype, low=-3.0, high=3.0)
    return q, k, v, mask


def _specs(dtype="float32", mask_shape=(S, T)):
    return (TensorSpec((B, HQ, S, D), dtype), TensorSpec((B, HKV, T, D), dtype), TensorSpec((B, HKV, T, D), dtype),
            TensorSpec(mask_shape, dtype))  # fmt: skip


def _repeat(x):
    b, h, t, d = x.type.shape
    return ops.reshape(ops.broadcast_to(ops.reshape(x, (b, h, 1, t, d)), (b, h, G, t, d)), (b, h * G, t, d))


# ----------------------------------------------------------------------------- the fuzz reproducers


def test_a_scale_after_the_mask_scales_the_mask_too(rng):
    """softmax((q·kᵀ + m)·0.5) is sdpa(scale=0.5, mask=m·0.5), never sdpa(scale=0.5, mask=m)."""

    def attention(q, k, v, m):
        return ops.matmul(_softmax((ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2))) + m) * 0.5), _repeat(v))

    graph = trace(attention, *_specs())
    result = _raise(graph)
    (sdpa,) = _sdpas(result.graph)
    mask = result.graph.node(sdpa.inputs[3])
    (remark,) = _decisions(result, "attention")
    assert sdpa.attrs["scale"] == 0.5 and mask.op == "mul" and "mask m·0.5 (additive)" in remark.message
    _same_function(graph, result.graph, *_inputs(rng))


@pytest.mark.parametrize("factor", [0.3, 3.0])
def test_a_scale_after_the_mask_that_would_round_is_declined(factor):
    def attention(q, k, v, m):
        return ops.matmul(_softmax((ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2))) + m) * factor), _repeat(v))

    result = _raise(trace(attention, *_specs()))
    (remark,) = _decisions(result, "attention")
    assert not _sdpas(result.graph) and (remark.kind, remark.reason) == ("declined", "inexact")


def test_a_scale_on_the_mask_is_kept_in_the_mask(rng):
    """q·kᵀ·0.5 + m·2 keeps its ×2: the mask sdpa reads is the source's own m·2."""

    def attention(q, k, v, m):
        scores = ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2))) * 0.5 + m * 2.0
        return ops.matmul(_softmax(scores), _repeat(v))

    graph = trace(attention, *_specs())
    result = _raise(graph)
    (sdpa,) = _sdpas(result.graph)
    mask = result.graph.node(sdpa.inputs[3])
    assert sdpa.attrs["scale"] == 0.5 and mask.op == "mul" and mask.inputs[0] == "m"
    _same_function(graph, result.graph, *_inputs(rng))


def test_a_scale_on_v_stays_on_v(rng):
    def attention(q, k, v, m):
        scores = ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2))) * 0.25 + m
        return ops.matmul(_softmax(scores), _repeat(v) * 3.0)

    graph = trace(attention, *_specs())
    result = _raise(graph)
    (sdpa,) = _sdpas(result.graph)
    v = result.graph.node(sdpa.inputs[2])
    assert sdpa.attrs["scale"] == 0.25 and v.op == "mul" and v.inputs[0] == "v" and v.type.shape == (B, HKV, T, D)
    _same_function(graph, result.graph, *_inputs(rng))


# ----------------------------------------------------------------------------- layouts and GQA


def _decomposed(q_order, kv_orders, gqa, batched):
    """An attention whose q, k, v roots are each in their own layout."""
    perms = {"heads-first": (0, 1, 2, 3), "rows-first": (0, 2, 1, 3)}

    def canonical(x, order):  # root -> [B, H, rows, D]
        x = x if batched else ops.reshape(x, (1, *x.type.shape))
        return ops.transpose(x, perms[order])

    def attention(q, k, v):
        q, k, v = canonical(q, q_order), canonical(k, kv_orders[0]), canonical(v, kv_orders[1])
        if gqa == "repeat":
            scores = ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2)))
            return ops.matmul(_softmax(scores * 0.125), _repeat(v))
        q5 = ops.reshape(q, (B, HKV, G, S, D))  # broadcast: the group axis meets K/V of size 1
        k5, v5 = ops.reshape(k, (B, HKV, 1, T, D)), ops.reshape(v, (B, HKV, 1, T, D))
        if gqa == "broadcast":
            p = _softmax(ops.matmul(q5, ops.transpose(k5, (0, 1, 2, 4, 3))) * 0.125)
            return ops.reshape(ops.matmul(p, v5), (B, HQ, S, D))
        rows = ops.reshape(q5, (B, HKV, G * S, D))  # grouped einsum: the group folded into the rows
        p = _softmax(ops.matmul(rows, ops.transpose(k, (0, 1, 3, 2))) * 0.125)
        return ops.reshape(ops.matmul(p, v), (B, HQ, S, D))

    def shape(order, heads, rows):
        dims = (heads, rows, D) if order == "heads-first" else (rows, heads, D)
        return dims if not batched else (B, *dims)

    return attention, [TensorSpec(shape(q_order, HQ, S)), TensorSpec(shape(kv_orders[0], HKV, T)),
                       TensorSpec(shape(kv_orders[1], HKV, T))]  # fmt: skip


@pytest.mark.parametrize("gqa", ["repeat", "broadcast", "grouped-einsum"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize(
    "q_order, kv_orders",
    [("heads-first", ("heads-first", "rows-first")), ("rows-first", ("rows-first", "heads-first")),
     ("heads-first", ("rows-first", "rows-first"))],
    ids=["v-rows-first", "k-heads-first", "kv-rows-first"],
)  # fmt: skip
def test_each_root_in_its_own_layout(rng, q_order, kv_orders, gqa, batched):
    attention, specs = _decomposed(q_order, kv_orders, gqa, batched)
    graph = trace(attention, *specs)
    result = _raise(graph)
    (sdpa,) = _sdpas(result.graph)
    k_operand = result.graph.node(sdpa.inputs[1]).type.shape
    assert k_operand == (B, HKV, T, D) and sdpa.attrs["scale"] == 0.125  # GQA stays in the op: K/V not repeated
    (remark,) = _decisions(result, "attention")
    assert f"k k ({kv_orders[0]})" in remark.message and f"v v ({kv_orders[1]})" in remark.message
    _same_function(graph, result.graph, *(random_array(rng, s.shape, "float32") for s in specs))


# ----------------------------------------------------------------------------- MLX


@requires("mlx.core")
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-norm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_lm_prefill_attention_is_raised_bit_exactly(dtype, qk_norm):
    import mlx.core as mx

    attention, x = llama_attention(getattr(mx, dtype), qk_norm=qk_norm)
    imported = from_mlx(attention, x)
    result = _raise(imported.graph)
    assert len(_sdpas(result.graph)) == 1
    (remark,) = _decisions(result, "attention")
    assert remark.kind == "applied" and "(rows-first); 4 query heads over 2 KV heads (GQA 2)" in remark.message
    assert ("rounding:" in remark.message) == (dtype == "bfloat16")
    x_np = np.array(x.astype(mx.float32)).astype(DType.parse(dtype).numpy)
    expected = np.array(attention(x).astype(mx.float32)).astype(DType.parse(dtype).numpy)
    assert_bits_equal(run(lower(result.graph, "mlx"), x_np, **imported.params), expected)


@requires("mlx.core")
def test_mlx_precise_softmax_in_float32_is_raised_with_its_rounding(rng):
    import mlx.core as mx

    def attention(q, k, v):
        scores = (q * 0.25) @ mx.repeat(k, G, axis=1).transpose(0, 1, 3, 2)
        return mx.softmax(scores.astype(mx.float32), axis=-1).astype(mx.bfloat16) @ mx.repeat(v, G, axis=1)

    q, k, v, _ = _inputs(rng, "bfloat16")
    args = [mx.array(a.astype(np.float32)).astype(mx.bfloat16) for a in (q, k, v)]
    result = _raise(from_mlx(attention, *args).graph)
    (sdpa,) = _sdpas(result.graph)
    (remark,) = _decisions(result, "attention")
    assert sdpa.type.dtype is DType.bfloat16 and "the softmax in f32, P·V in bf16" in remark.message
    expected = np.array(attention(*args).astype(mx.float32)).astype(DType.bfloat16.numpy)
    assert_close(run(lower(result.graph, "mlx"), q, k, v), expected)


@requires("mlx.core")
def test_attention_sinks_are_raised_to_sdpa_sinks(rng):
    import mlx.core as mx

    attention, x = llama_attention(mx.float32, sinks=True)
    imported = from_mlx(attention, x)
    result = _raise(imported.graph)
    (remark,) = _decisions(result, "attention")
    (sdpa,) = _sdpas(result.graph)
    assert remark.kind == "applied" and "sinks" in remark.message and sdpa.sinks is not None
    expected = np.array(attention(x))
    for target in ("numpy", "mlx"):
        assert_close(run(lower(result.graph, target), np.array(x), **imported.params), expected)


@requires("mlx.core")
def test_a_bf16_mask_with_float32_q_is_expressed_as_mlx_promotes_it(rng):
    import mlx.core as mx

    q, k, v, _ = _inputs(rng)
    mask = random_array(rng, (B, 1, S, T), "bfloat16", low=-3.0, high=3.0)

    def attention(q, k, v, mask):
        return ops.sdpa(q, k, v, scale=0.25, mask=mask)

    graph = trace(attention, *_specs()[:3], TensorSpec(mask.shape, "bfloat16"))
    mlx_args = [mx.array(a) for a in (q, k, v)] + [mx.array(mask.astype(np.float32)).astype(mx.bfloat16)]
    expected = np.array(mx.fast.scaled_dot_product_attention(*mlx_args[:3], scale=0.25, mask=mlx_args[3]))
    for target in ("numpy", "mlx", "jax"):
        assert_close(run(lower(graph, target), q, k, v, mask), expected)

    def imported_fn(q, k, v, m):  # MLX's own fallback, imported and raised: the bf16 mask stays bf16
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)

    result = _raise(from_mlx(imported_fn, *mlx_args).graph)
    (sdpa,) = _sdpas(result.graph)
    assert result.graph.node(sdpa.inputs[3]).type.dtype is DType.bfloat16
    assert_close(run(lower(result.graph, "mlx"), q, k, v, mask), expected)


# ----------------------------------------------------------------------------- JAX


@requires("jax")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_dot_product_attention_without_a_mask(rng, dtype):
    import jax

    q, k, v = (np.swapaxes(a, 1, 2) for a in _inputs(rng, dtype)[:3])

    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v)

    result = _raise(from_jax(attention, q, k, v).graph)
    (sdpa,) = _sdpas(result.graph)
    (remark,) = _decisions(result, "attention")
    assert sdpa.type.dtype is DType.parse(dtype) and ("the softmax in f32, P·V in bf16" in remark.message) == (
        dtype == "bfloat16"
    )
    # op by op against jax's own eager call: under jax.jit XLA fuses the two graphs differently
    assert_bits_equal(run(lower(result.graph, "jax", jit=False), q, k, v), np.asarray(attention(q, k, v)))


@requires("jax")
def test_jax_bf16_softmax_summed_in_float32_is_raised_with_its_rounding(rng):
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        kk, vv = jnp.repeat(k, G, axis=1), jnp.repeat(v, G, axis=1)
        p = jax.nn.softmax(jnp.einsum("bhsd,bhtd->bhst", q, kk) * 0.35, axis=-1)  # exp in bf16, the sum in f32
        return jnp.einsum("bhst,bhtd->bhsd", p, vv, preferred_element_type=jnp.bfloat16)

    q, k, v, _ = _inputs(rng, "bfloat16")
    imported = from_jax(attention, q, k, v)
    result = _raise(imported.graph)
    (softmax,) = _decisions(result, "softmax")
    assert "precise" in softmax.message and "the sum in f32" in softmax.message
    (sdpa,) = _sdpas(result.graph)
    assert sdpa.type.dtype is DType.bfloat16
    assert_close(run(lower(result.graph, "jax"), q, k, v), np.asarray(attention(q, k, v)))


@requires("jax")
def test_jax_unbatched_attention_as_equinox_writes_it(rng):
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):  # [S, H, D], no batch axis
        scores = jnp.einsum("shd,thd->hst", q, k) / np.sqrt(D)
        return jnp.einsum("hst,thd->shd", jax.nn.softmax(scores, axis=-1), v)

    q, k, v = (random_array(rng, shape, "float32") for shape in ((S, HQ, D), (T, HQ, D), (T, HQ, D)))
    result = _raise(from_jax(attention, q, k, v).graph)
    (sdpa,) = _sdpas(result.graph)
    assert sdpa.inputs and result.graph.node(sdpa.inputs[0]).type.shape == (1, HQ, S, D)
    assert_close(run(lower(result.graph, "jax"), q, k, v), np.asarray(attention(q, k, v)))


# ----------------------------------------------------------------------------- what sdpa does not express


def test_a_step_on_the_scores_sdpa_lacks_is_declined_naming_it():
    def attention(q, k, v, m):
        return ops.matmul(_softmax(ops.sin(ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2))))), _repeat(v))

    result = _raise(trace(attention, *_specs()))
    (remark,) = _decisions(result, "attention")
    assert (remark.kind, remark.reason) == ("declined", "not_attention") and "sin" in remark.message


@pytest.mark.skipif("tanh" not in registered_ops(), reason="the tanh op is not registered")
@pytest.mark.parametrize("outer, raised", [(50.0, True), (40.0, False)], ids=["cap", "not-a-cap"])
def test_logit_soft_capping_is_raised_or_declined(outer, raised):
    def attention(q, k, v, m):
        scores = ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2)))
        capped = ops.mul(ops.emit("tanh", [ops.div(scores, 50.0)]), outer)
        return ops.matmul(_softmax(capped), _repeat(v))

    result = _raise(trace(attention, *_specs()))
    (remark,) = _decisions(result, "attention")
    if raised:
        (sdpa,) = _sdpas(result.graph)
        assert remark.kind == "applied" and sdpa.attrs["logit_softcap"] == 50.0
    else:
        assert (remark.kind, remark.reason) == ("declined", "not_attention")


@pytest.mark.parametrize(
    "probabilities, op",
    [(lambda p: p * 2.0, "mul"), (lambda p: p + 0.5, "add")],
    ids=["scaled", "biased"],
)  # fmt: skip
def test_a_change_to_the_probabilities_is_declined(probabilities, op):
    def attention(q, k, v, m):
        return ops.matmul(probabilities(_softmax(ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2))))), _repeat(v))

    result = _raise(trace(attention, *_specs()))
    (remark,) = _decisions(result, "attention")
    assert (remark.kind, remark.reason) == ("declined", "probabilities_changed")
    assert result.graph.node(remark.message.split()[1]).op == op  # it names the op between softmax and P·V


def test_a_head_mismatch_names_shapes_not_misread_axes():
    def attention(q, k, v):  # one v head broadcast over two k heads: no sdpa reads them together
        scores = ops.matmul(ops.reshape(q, (B, HKV, G * S, D)), ops.transpose(k, (0, 1, 3, 2)))
        return ops.matmul(_softmax(scores), v)

    specs = TensorSpec((B, HQ, S, D)), TensorSpec((B, HKV, T, D)), TensorSpec((B, 1, T, D))
    result = _raise(trace(attention, *specs))
    (remark,) = _decisions(result, "attention")
    assert (remark.kind, remark.reason) == ("declined", "axes_mismatch") and not _sdpas(result.graph)
    assert "q [1, 4, 3, 8], k [1, 2, 5, 8], v [1, 1, 5, 8]" in remark.message  # it names the shapes


@pytest.mark.parametrize("fill", [float("nan"), -1e4, 1.0])
def test_a_fill_that_does_not_mask_is_declined(fill):
    def attention(q, k, v, m):
        scores = ops.matmul(q, ops.transpose(_repeat(k), (0, 1, 3, 2)))
        masked = ops.where(ops.greater_equal(m, 0.0), scores, ops.constant(fill, like=scores))
        return ops.matmul(_softmax(masked), _repeat(v))

    result = _raise(trace(attention, *_specs()))
    (remark,) = _decisions(result, "attention")
    assert (remark.kind, remark.reason) == ("declined", "inexact")
