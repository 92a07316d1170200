"""raise-attention reads each root in the layout the matmuls prove, not only with the head dim last.

Regression tests for the three model-zoo gaps, written without the libraries that showed them:

- a projection computed feature-major (``W @ xᵀ`` = ``[H*D, S]``, as JAX writes a vmapped
  matrix-vector product: equinox's ``MultiheadAttention``), so that k reaches ``q·kᵀ`` as
  ``[H, D, S]``, unbatched or vmapped over a batch;
- a head dim spread over two root axes that one reshape merges (interleaved RoPE's
  ``[..., D/2, 2]``, cohere2's sliding-window layers), with no ``[B, H, S, D]`` value on the path;
- the scale written ``/ jnp.sqrt(d)`` (a sqrt of a constant that canonicalize folds in its dtype).

Each is differential: the raised graph against the unraised one and against an independent float64
numpy attention, in float32 and bfloat16; canonicalize's folds bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, from_jax, ops, trace
from attnpass.lowering import lower
from attnpass.passes import Canonicalize, PassManager, RaiseAttention
from tests.util import assert_bits_equal, assert_close, random_array, requires

HQ, HKV, S, D, E = 4, 2, 5, 8, 16
G = HQ // HKV
SCALE = 0.25
DTYPES = ["float32", "bfloat16"]


def _raise(graph):
    return PassManager([RaiseAttention()]).run(graph)


def _sdpas(graph):
    return [n for n in graph.nodes() if n.op == "sdpa"]


def _attention_remark(result):
    (remark,) = [r for r in result.remarks if r.rule == "attention"]
    return remark


def _softmax(x, axis=-1):
    e = ops.exp(ops.sub(x, ops.max(x, axis, keepdims=True)))
    return ops.div(e, ops.sum(e, axis, keepdims=True))


def _reference(q, k, v, scale):
    """float64 attention of [..., Hq, S, D] q over [..., Hkv, T, D] k and v (query head h reads kv head h // G)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = (np.repeat(a, group, axis=-3) for a in (k, v))
    scores = q @ np.swapaxes(k, -1, -2) * scale
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _differential(before, after, expected, *args, dtype, params=None):
    """Raised vs unraised on the numpy reference target, and both vs the float64 attention."""
    raised = run(lower(after, "numpy"), *args, **(params or {}))
    source = run(lower(before, "numpy"), *args, **(params or {}))
    assert_close(raised, source, dtype)
    expected = np.asarray(expected, np.float64).astype(DType.parse(dtype).numpy)
    assert_close(source, expected, dtype)
    assert_close(raised, expected, dtype)
    return raised


def _as64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


# ----------------------------------------------------------------------------- feature-major projections


def _repeat3(x):
    """[Hkv, A, B] -> [Hq, A, B], query head h reading kv head h // G."""
    h, a, b = x.type.shape
    return ops.reshape(ops.broadcast_to(ops.reshape(x, (h, 1, a, b)), (h, G, a, b)), (h * G, a, b))


def feature_major_attention(x, wq, wk, wv):
    """Unbatched self-attention whose projections are ``W @ xᵀ`` ([H*D, S]): q read back as [H, S, D], k used
    as it comes ([H, D, S], already kᵀ), v transposed; GQA by repeating the kv heads."""
    xt = ops.transpose(x, (1, 0))
    q = ops.transpose(ops.reshape(ops.transpose(ops.matmul(wq, xt), (1, 0)), (S, HQ, D)), (1, 0, 2))
    kt = _repeat3(ops.reshape(ops.matmul(wk, xt), (HKV, D, S)))
    v = _repeat3(ops.transpose(ops.reshape(ops.matmul(wv, xt), (HKV, D, S)), (0, 2, 1)))
    return ops.matmul(_softmax(ops.mul(ops.matmul(q, kt), SCALE)), v)


def _feature_major_inputs(rng, dtype):
    shapes = ((S, E), (HQ * D, E), (HKV * D, E), (HKV * D, E))
    return [random_array(rng, shape, dtype, low=-1.0, high=1.0) for shape in shapes]


def _feature_major_reference(x, wq, wk, wv):
    x, wq, wk, wv = _as64(x, wq, wk, wv)
    q, k, v = (np.swapaxes((w @ x.T).reshape(-1, D, S), 1, 2) for w in (wq, wk, wv))  # [H, S, D]
    return _reference(q, k, v, SCALE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_feature_major_unbatched_k_is_read_as_heads_dim_rows(rng, dtype):
    specs = [TensorSpec(a.shape, dtype) for a in _feature_major_inputs(rng, dtype)]
    graph = trace(feature_major_attention, *specs)
    result = _raise(graph)
    (sdpa,) = _sdpas(result.graph)
    assert [result.graph.node(i).type.shape for i in sdpa.inputs] == [(1, HQ, S, D), (1, HKV, S, D), (1, HKV, S, D)]
    remark = _attention_remark(result)
    assert remark.kind == "applied" and "([B, H, D, T])" in remark.message and "(GQA 2)" in remark.message
    args = _feature_major_inputs(rng, dtype)
    _differential(graph, result.graph, _feature_major_reference(*args), *args, dtype=dtype)


@requires("jax")
@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "vmapped"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_per_head_attention_vmapped_over_heads_raises(rng, dtype, batched):
    """equinox's way, without equinox: projections as a per-token ``W @ x`` vmapped over the sequence, a per-head
    ``[S, D]`` attention vmapped over the heads (axis 1 of [S, H, D]) and, batched, the whole vmapped again. JAX
    writes k as [H, D, S]; canonicalize leaves it a reshape of the feature-major projection [H*D, S]."""
    import jax
    import jax.numpy as jnp

    x, wq, wk, wv = _feature_major_inputs(rng, dtype)

    def head(q, k, v):  # [S, D] each
        weights = jax.nn.softmax(jnp.einsum("sd,Sd->sS", q * SCALE, k), axis=-1)
        return jnp.einsum("sS,Sd->sd", weights, v)

    def attention(x):  # [S, E], no batch axis
        q, k, v = (jax.vmap(lambda t, w=w: w @ t)(x).reshape(S, -1, D) for w in (wq, wk, wv))  # [S, H, D]
        k, v = (jnp.repeat(a, G, axis=1) for a in (k, v))
        return jax.vmap(head, in_axes=1, out_axes=1)(q, k, v)

    fn = jax.vmap(attention) if batched else attention
    xs = np.stack([x, random_array(rng, x.shape, dtype, low=-1.0, high=1.0)]) if batched else x
    imported = from_jax(fn, xs)
    result = _raise(imported.graph)
    (sdpa,) = _sdpas(result.graph)
    batch = 2 if batched else 1
    assert [result.graph.node(i).type.shape for i in sdpa.inputs] == [(batch, HQ, S, D)] + [(batch, HKV, S, D)] * 2
    remark = _attention_remark(result).message
    assert batched or "([B, H, D, T])" in remark, remark  # vmapped: JAX keeps the batch in [B, S, H, D]
    rows = xs if batched else xs[None]
    expected = np.stack([np.swapaxes(_feature_major_reference(r, wq, wk, wv), 0, 1) for r in rows])
    expected = expected if batched else expected[0]
    raised = _differential(imported.graph, result.graph, expected, xs, dtype=dtype, params=imported.params)
    assert_close(run(lower(result.graph, "jax"), xs, **imported.params), raised, dtype)


# ----------------------------------------------------------------------------- a head dim over two root axes


def _interleaved(x, cos, sin):
    """RoPE in its interleaved form: pairs (x[2i], x[2i+1]) rotated, stacked back as [..., D/2, 2]."""
    shape = x.type.shape
    even = ops.slice(x, (0,) * 4, shape, (1, 1, 1, 2))
    odd = ops.slice(x, (0, 0, 0, 1), shape, (1, 1, 1, 2))
    pair = (*shape[:3], D // 2, 1)
    return ops.concat([ops.reshape(even * cos - odd * sin, pair), ops.reshape(even * sin + odd * cos, pair)], axis=4)


def interleaved_rope_attention(q, k, v):
    """q [1, Hq, S, D], k and v [1, Hkv, S, D]; q and k rotated pairwise, then reshaped straight to the grouped
    5-d form (no [B, H, S, D] value on their path: the head dim is the root's last two axes)."""
    angles = np.outer(np.arange(S), 0.5 ** np.arange(D // 2))
    cos, sin = (ops.constant(f(angles).astype(np.float32), q.dtype) for f in (np.cos, np.sin))
    q5 = ops.reshape(_interleaved(q, cos, sin), (1, HKV, G, S, D))
    k5 = ops.transpose(ops.reshape(_interleaved(k, cos, sin), (1, HKV, 1, S, D)), (0, 1, 2, 4, 3))
    scores = ops.matmul(q5, ops.broadcast_to(k5, (1, HKV, G, D, S))) * SCALE
    v5 = ops.broadcast_to(ops.reshape(v, (1, HKV, 1, S, D)), (1, HKV, G, S, D))
    return ops.reshape(ops.matmul(_softmax(scores), v5), (1, HQ, S, D))


def _rotated(x, dtype):
    x = np.asarray(x, np.float64)
    angles = np.outer(np.arange(S), 0.5 ** np.arange(D // 2))
    cos, sin = (
        f(angles).astype(np.float32).astype(DType.parse(dtype).numpy).astype(np.float64) for f in (np.cos, np.sin)
    )
    even, odd = x[..., 0::2], x[..., 1::2]
    return np.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_head_dim_over_two_root_axes_is_one_head_dim(rng, dtype):
    shapes = ((1, HQ, S, D), (1, HKV, S, D), (1, HKV, S, D))
    graph = trace(interleaved_rope_attention, *(TensorSpec(s, dtype) for s in shapes))
    result = _raise(graph)
    (sdpa,) = _sdpas(result.graph)
    assert [result.graph.node(i).type.shape for i in sdpa.inputs] == list(shapes)
    assert _attention_remark(result).kind == "applied"
    q, k, v = (random_array(rng, s, dtype) for s in shapes)
    expected = _reference(_rotated(q, dtype), _rotated(k, dtype), v, SCALE)
    _differential(graph, result.graph, expected, q, k, v, dtype=dtype)


# ----------------------------------------------------------------------------- a 1 / jnp.sqrt(d) scale


@requires("jax")
@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_gqa_einsum_scaled_by_a_sqrt_of_the_head_dim_raises(rng, dtype):
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):  # JAX's [B, T, N, H]
        b, s, h, d = q.shape
        groups = q.reshape(b, s, k.shape[2], h // k.shape[2], d)
        scores = jnp.einsum("bskgd,btkd->bkgst", groups, k) / jnp.sqrt(jnp.asarray(d, q.dtype))
        return jnp.einsum("bkgst,btkd->bskgd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, h, d)

    q, k, v = (random_array(rng, s, dtype) for s in ((1, S, HQ, D), (1, 7, HKV, D), (1, 7, HKV, D)))
    imported = from_jax(attention, q, k, v)
    canonical = PassManager([Canonicalize()]).run(imported.graph)
    assert not [n for n in canonical.graph.nodes() if n.op == "sqrt"]
    for target in ("numpy", "jax"):  # the fold keeps every bit
        assert_bits_equal(run(lower(canonical.graph, target), q, k, v), run(lower(imported.graph, target), q, k, v))
    result = _raise(imported.graph)
    (sdpa,) = _sdpas(result.graph)
    root8 = float(np.sqrt(np.asarray(8.0, DType.parse(dtype).numpy)).astype(DType.parse(dtype).numpy))
    assert sdpa.attrs["scale"] == 1.0 / root8  # sqrt(8) rounded to the dtype once, as the source divides by it
    expected = np.swapaxes(_reference(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), 1.0 / root8), 1, 2)
    raised = _differential(imported.graph, result.graph, expected, q, k, v, dtype=dtype)
    assert_close(run(lower(result.graph, "jax"), q, k, v), raised, dtype)
