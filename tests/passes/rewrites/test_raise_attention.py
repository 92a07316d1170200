"""RaiseAttention: decomposed attention (attnpass ops, MLX's fallback, JAX, hand-written) -> sdpa.

Positive cases check the raised graph's structure (one sdpa with the right
scale, mask and GQA operands) and its numerics against the source; negative
cases check that each is declined with a remark naming what did not match and
that the graph is left unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import TensorSpec, from_jax, from_mlx, ops, trace
from attnpass.lowering import lower
from attnpass.passes import HeadChunkSDPA, PassManager, RaiseAttention, head_chunk_plan
from tests.passes.claims import audit, fuzzed
from tests.util import lazy_import, requires

mx = lazy_import("mlx.core")
jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")

B, HQ, HKV, S, T, D = 1, 6, 2, 3, 7, 8
G = HQ // HKV
SCALE = 0.125


def _specs(*shapes, dtype="float32"):
    return [TensorSpec(s, dtype) for s in shapes]


def _raise(graph):
    return RaiseAttention()(graph)


def _sdpas(graph):
    return [n for n in graph.nodes() if n.op == "sdpa"]


def _raised(result):
    """The rules that raised something (raise-attention also canonicalizes; those remarks are left out)."""
    return [r.rule for r in result.applied() if r.rule in ("softmax", "attention")]


def _repeat_kv(x, groups, *, tile=False):
    """[B, Hkv, T, D] -> [B, Hkv*groups, T, D]: repeat (h // groups) or, with tile, h % Hkv."""
    b, h, t, d = x.shape
    if tile:
        return ops.reshape(
            ops.broadcast_to(ops.reshape(x, (b, 1, h, t, d)), (b, groups, h, t, d)), (b, h * groups, t, d)
        )
    return ops.reshape(ops.broadcast_to(ops.reshape(x, (b, h, 1, t, d)), (b, h, groups, t, d)), (b, h * groups, t, d))


def _softmax(x, axis=-1):
    e = ops.exp(ops.sub(x, ops.max(x, axis, keepdims=True)))
    return ops.div(e, ops.sum(e, axis, keepdims=True))


def handwritten(q, k, v, mask, *, tile=False, k_perm=(0, 1, 3, 2), softmax_axis=-1, scale_v=False, mask_t=False):
    kk, vv = _repeat_kv(k, G, tile=tile), _repeat_kv(v, G, tile=tile)
    scores = ops.mul(ops.matmul(q, ops.transpose(kk, k_perm)), SCALE)
    scores = ops.add(scores, ops.transpose(mask) if mask_t else mask)
    p = _softmax(scores, softmax_axis)
    return ops.matmul(p, ops.mul(vv, SCALE) if scale_v else vv)


def _inputs(rng, mask_shape=(S, T)):
    q = rng.standard_normal((B, HQ, S, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, T, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, T, D)).astype(np.float32)
    mask = np.where(rng.random(mask_shape) < 0.8, 0.0, -1e9).astype(np.float32)
    return q, k, v, mask


def test_handwritten_repeat_kv_raises_to_one_gqa_sdpa(rng):
    graph = trace(handwritten, *_specs((B, HQ, S, D), (B, HKV, T, D), (B, HKV, T, D), (S, T)))
    result = _raise(graph)
    (sdpa,) = _sdpas(result.graph)
    assert sdpa.inputs[:3] == ("q", "k", "v")  # K/V are not repeated: GQA stays in the op
    assert sdpa.attrs["scale"] == SCALE and result.graph.node(sdpa.inputs[3]).op == "input"
    assert not [n for n in result.graph.nodes() if n.op in ("matmul", "softmax", "exp", "broadcast_to")]
    assert _raised(result) == ["softmax", "attention"]
    args = _inputs(rng)
    expected = run(lower(graph, "numpy"), *args)
    np.testing.assert_allclose(run(lower(result.graph, "numpy"), *args), expected, rtol=1e-6, atol=1e-6)
    assert _raise(result.graph).changed is False  # a second run finds nothing: the fixed point terminates


def test_an_untransposed_k_is_a_k_stored_transposed(rng):
    """q·k without the transpose (T == D) contracts k's axis 2: that is attention over keys k[..., :, t] (k stored
    [B, H, D, T]), and sdpa gets k transposed; the same function, not a decline."""
    specs = _specs((B, HQ, S, D), (B, HKV, D, D), (B, HKV, D, D), (S, D))
    graph = trace(lambda q, k, v, mask: handwritten(q, k, v, mask, k_perm=(0, 1, 2, 3)), *specs)
    result = _raise(graph)
    (sdpa,) = _sdpas(result.graph)
    (remark,) = [r for r in result.applied() if r.rule == "attention"]
    assert "k k ([B, H, D, T])" in remark.message, remark.message
    q, k, v, mask = _inputs(rng, (S, D))
    k, v = (rng.standard_normal((B, HKV, D, D)).astype(np.float32) for _ in range(2))
    expected = run(lower(graph, "numpy"), q, k, v, mask)
    np.testing.assert_allclose(run(lower(result.graph, "numpy"), q, k, v, mask), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"softmax_axis": -2}, "axes_mismatch"),
        ({"mask_t": True}, "mask_layout"),
    ],
    ids=["softmax-wrong-axis", "mask-wrong-axes"],
)
def test_negative_cases_are_declined_and_leave_the_graph(options, reason):
    mask_shape = (T, S) if options.get("mask_t") else (S, T)
    specs = _specs((B, HQ, S, D), (B, HKV, T, D), (B, HKV, T, D), mask_shape)
    graph = trace(lambda q, k, v, mask: handwritten(q, k, v, mask, **options), *specs, name="negative")
    before = graph.fingerprint()
    result = PassManager([RaiseAttention()]).run(graph)
    assert not _sdpas(result.graph)
    declined = [(r.rule, r.reason) for r in result.declined() if r.rule == "attention"]
    assert declined == [("attention", reason)], [str(r) for r in result.remarks]
    if not options.get("softmax_axis"):  # the softmax itself is still raised; nothing else changes
        assert _raised(result) == ["softmax"]
    else:
        assert before != result.graph.fingerprint()


def test_softmax_rule_checks_the_axes():
    def mismatched(x):
        e = ops.exp(ops.sub(x, ops.max(x, -1, keepdims=True)))
        return ops.div(e, ops.sum(e, -2, keepdims=True))

    graph = trace(mismatched, TensorSpec((4, 5), "float32"))
    result = _raise(graph)
    assert result.changed is False and graph.fingerprint() == result.graph.fingerprint()
    (remark,) = result.declined()
    assert (remark.rule, remark.reason) == ("softmax", "not_softmax")
    assert "max reduces axes [1] and the sum axes [0]" in remark.message  # it names the two axes


# ----------------------------------------------------------------------------- MLX's fallback form


@requires("mlx.core")
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "causal"])
@pytest.mark.parametrize("hkv", [HKV, HQ])
def test_mlx_fast_sdpa_fallback_raises_bit_exactly(rng, mask_kind, hkv):
    q, k, v, _ = _inputs(rng)
    k, v = k[:, :1].repeat(hkv, 1), v[:, :1].repeat(hkv, 1)
    bool_mask = rng.random((B, 1, S, T)) < 0.8
    bool_mask[..., 0] = True
    masks = {
        "none": None,
        "bool": bool_mask,
        "additive": np.where(bool_mask, 0.0, -1e9).astype(np.float32),
        "causal": "causal",
    }
    mask = masks[mask_kind]
    args = [mx.array(a) for a in (q, k, v)] + ([mx.array(mask)] if isinstance(mask, np.ndarray) else [])

    def attention(q, k, v, *m):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=m[0] if m else mask)

    imported = from_mlx(attention, *args)
    result = _raise(imported.graph)
    (sdpa,) = _sdpas(result.graph)
    assert sdpa.attrs["scale"] == SCALE and len(sdpa.inputs) == (3 if mask_kind in ("none", "causal") else 4)
    assert sdpa.attrs["causal"] == ("bottom_right" if mask_kind == "causal" else "none")  # the mask's positions
    assert result.graph.node(sdpa.inputs[1]).type.shape[1] == hkv
    expected = np.array(attention(*args))
    np.testing.assert_array_equal(run(lower(result.graph, "mlx"), *args), expected)


@requires("mlx.core")
def test_mlx_handwritten_attention_with_repeat_kv(rng):
    q, k, v, mask = (mx.array(a) for a in _inputs(rng))

    def attention(q, k, v, mask):
        kk = mx.repeat(k, G, axis=1)
        vv = mx.repeat(v, G, axis=1)
        scores = (q @ kk.transpose(0, 1, 3, 2)) * SCALE + mask
        return mx.softmax(scores, axis=-1) @ vv

    result = _raise(from_mlx(attention, q, k, v, mask).graph)
    (sdpa,) = _sdpas(result.graph)
    assert result.graph.node(sdpa.inputs[1]).type.shape == (B, HKV, T, D)
    np.testing.assert_allclose(
        run(lower(result.graph, "mlx"), q, k, v, mask), np.array(attention(q, k, v, mask)), rtol=1e-5, atol=1e-6
    )


# ----------------------------------------------------------------------------- JAX


@requires("jax", "mlx.core")
@pytest.mark.parametrize("kind", ["mask", "bias", "causal"])
def test_jax_dot_product_attention_raises(rng, kind):
    q, k, v, _ = _inputs(rng)
    q, k, v = (np.swapaxes(a, 1, 2) for a in (q, k, v))  # JAX layout [B, T, N, H]
    m = rng.random((B, 1, S, T)) < 0.8
    m[..., 0] = True

    def attention(q, k, v, m):
        if kind == "mask":
            return jax.nn.dot_product_attention(q, k, v, mask=m, scale=SCALE)
        if kind == "bias":
            return jax.nn.dot_product_attention(q, k, v, bias=jnp.where(m, 0.0, -1e9).astype(jnp.float32))
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    result = PassManager([RaiseAttention(), HeadChunkSDPA(enabled=True, budget=4)]).run(
        from_jax(attention, q, k, v, m).graph
    )
    assert _raised(result)[-1] == "attention"
    assert len(_sdpas(result.graph)) == head_chunk_plan(S, HQ, HKV, budget=4)[1] == 6  # one head per subcall
    expected = np.asarray(attention(q, k, v, m))
    for target in ("jax", "mlx"):
        np.testing.assert_allclose(run(lower(result.graph, target), q, k, v, m), expected, rtol=1e-5, atol=1e-6)


@requires("jax")
def test_jax_handwritten_einsum_attention_with_repeat_kv(rng):
    q, k, v, mask = _inputs(rng)

    def attention(q, k, v, mask):
        kk, vv = jnp.repeat(k, G, axis=1), jnp.repeat(v, G, axis=1)
        scores = jnp.einsum("bhsd,bhtd->bhst", q, kk) / np.sqrt(64.0) + mask
        return jnp.einsum("bhst,bhtd->bhsd", jax.nn.softmax(scores, axis=-1), vv)

    result = _raise(from_jax(attention, q, k, v, mask).graph)
    (sdpa,) = _sdpas(result.graph)
    assert sdpa.attrs["scale"] == SCALE
    np.testing.assert_allclose(
        run(lower(result.graph, "jax"), q, k, v, mask), np.asarray(attention(q, k, v, mask)), rtol=1e-5, atol=1e-6
    )


def test_every_attention_remark_states_the_sdpa_it_made():
    """Each attention remark's heads, GQA, S, T, D, scale and mask are the new sdpa's; a scale it puts on v is applied
    to v; the dtypes its rounding clause names are the source's q·kᵀ, softmax and P·V, and a half-precision sdpa
    always has one (tests/passes/claims.py)."""
    counts = audit(RaiseAttention(), fuzzed(("decomposed",), 300))
    assert counts["checked"] >= 150
