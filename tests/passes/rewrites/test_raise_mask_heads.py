"""raise-attention reads a mask whose head axes come in another order than sdpa's query head ``h = kv * G + g``.

``jax.nn.dot_product_attention(mask=..., is_causal=True)`` with fewer KV heads than query heads vmaps its core
over the group, so the combined mask reaches the scores as ``[G, B, Hkv, T, S]`` (EasyDeL's
``attn_mechanism="sdpa"`` Llama prefill, docs/zoo.md). The raised sdpa gets that mask transposed to
``[B, Hq, T, S]``. Differential: raised vs unraised vs a float64 numpy attention on numpy, MLX and JAX, for a
mask broadcast over the heads and one per query head; the control builds the sdpa with the mask read in the
source's order (no transpose) and shows the comparison catches it. Hand-written masks cover a head order (G, Hkv)
and masks that vary over one factor of the head axis only (broadcast over the other).
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import TensorSpec, from_jax, ops, trace
from attnpass.lowering import lower
from attnpass.passes import PassManager, RaiseAttention
from tests.util import assert_close, lazy_import, requires

jax = lazy_import("jax")

T, HQ, HKV, D = 8, 4, 2, 8
G = HQ // HKV
TARGETS = ["numpy", "mlx", "jax"]


def _raise(graph):
    return PassManager([RaiseAttention()]).run(graph)


def _sdpas(graph):
    return [n for n in graph.nodes() if n.op == "sdpa"]


def _attention_remark(result):
    (remark,) = [r for r in result.remarks if r.rule == "attention"]
    return remark


def _reference(q, k, v, allowed, scale):
    """float64 attention of [B, Hq, S, D] q over [B, Hkv, T, D] k and v, query head h reading kv head h // G;
    ``allowed`` broadcasts to [B, Hq, S, T] (a row without keys is the mean of V, as with a finite fill)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    k, v = (np.repeat(a, q.shape[1] // a.shape[1], axis=1) for a in (k, v))
    scores = np.where(allowed, q @ np.swapaxes(k, -1, -2) * scale, -1e300)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _differential(before, after, expected, *args, targets=TARGETS):
    """Raised vs unraised on every target, and both vs the float64 attention."""
    for target in targets:
        raised = run(lower(after, target), *args)
        source = run(lower(before, target), *args)
        assert_close(raised, source, "float32")
        assert_close(source, np.float32(expected), "float32")
        assert_close(raised, np.float32(expected), "float32")


def _per_head_mask(rng, b, heads):
    """A mask that differs on every head (each head keeps a different random third of the keys, key 0 always)."""
    m = rng.random((b, heads, T, T)) < 0.6
    m[..., 0] = True
    assert all((m[:, i] != m[:, j]).any() for i in range(heads) for j in range(i))
    return m


# ----------------------------------------------------------------------------- jax.nn.dot_product_attention


def _jax_case(rng, b, heads):
    q = rng.standard_normal((b, T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((b, T, HKV, D)).astype(np.float32)
    v = rng.standard_normal((b, T, HKV, D)).astype(np.float32)
    m = _per_head_mask(rng, b, heads)

    def attention(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True)

    imported = from_jax(attention, q, k, v, m)
    allowed = m & np.tril(np.ones((T, T), bool))
    expected = np.swapaxes(_reference(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), allowed, D**-0.5), 1, 2)
    return imported.graph, (q, k, v, m), expected


@requires("jax", "mlx.core")
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads", [1, HQ], ids=["broadcast", "per-head"])
def test_jax_gqa_mask_and_causal_raise_with_the_heads_reordered(rng, batch, heads):
    graph, args, expected = _jax_case(rng, batch, heads)
    before = graph.fingerprint()
    result = _raise(graph)
    assert graph.fingerprint() == before
    (sdpa,) = _sdpas(result.graph)
    mask = result.graph.node(sdpa.operand("mask"))
    assert mask.type.shape == (batch, HQ, T, T)
    remark = _attention_remark(result)
    assert remark.kind == "applied" and "(GQA 2)" in remark.message, remark.message
    assert "transposed by" in remark.message, remark.message  # the summary says the mask's heads are reordered
    _differential(graph, result.graph, expected, *args)


@requires("jax", "mlx.core")
def test_control_the_mask_read_in_the_sources_head_order_is_caught(rng):
    """The same raise with the transpose of the mask's factors left out (the (G, Hkv) root reshaped straight to
    [B, Hq, S, T]) swaps query heads 1 and 2's masks: the differential comparison fails on every target."""
    graph, args, expected = _jax_case(rng, 1, HQ)
    result = _raise(graph)
    raised = result.graph
    (sdpa,) = _sdpas(raised)
    (transpose,) = [
        n
        for n in raised.ancestors([sdpa.operand("mask")])
        if raised.node(n).op == "transpose" and raised.node(n).attrs["perm"] == (1, 0, 2, 3)
    ]
    source = raised.node(raised.node(transpose).inputs[0])
    assert source.op == "reshape" and source.type.shape == (G, HKV, T, T)
    wrong = raised.copy()
    wrong.replace_with(transpose, source.name)  # the factors kept in the source's (G, Hkv) order
    for target in TARGETS:
        got = run(lower(wrong, target), *args)
        with pytest.raises(AssertionError):
            assert_close(got, np.float32(expected), "float32")
        with pytest.raises(AssertionError):
            assert_close(got, run(lower(graph, target), *args), "float32")


# ----------------------------------------------------------------------------- hand-written head orders


def _softmax(x, axis=-1):
    e = ops.exp(ops.sub(x, ops.max(x, axis, keepdims=True)))
    return ops.div(e, ops.sum(e, axis, keepdims=True))


def grouped(q, k, v, mask, *, to_grouped):
    """A grouped 5-d attention ([B, Hkv, G, S, T] scores, query head h = kv * G + g) with a bool mask laid out
    by ``to_grouped`` onto the scores and filled with -1e30."""
    b = q.type.shape[0]
    q5 = ops.reshape(q, (b, HKV, G, T, D))
    k5 = ops.broadcast_to(ops.reshape(ops.transpose(k, (0, 1, 3, 2)), (b, HKV, 1, D, T)), (b, HKV, G, D, T))
    scores = ops.mul(ops.matmul(q5, k5), 0.25)
    fill = ops.broadcast_to(ops.constant(np.float32(-1e30), scores.dtype), scores.type.shape)
    p = _softmax(ops.where(to_grouped(mask), scores, fill))
    v5 = ops.broadcast_to(ops.reshape(v, (b, HKV, 1, T, D)), (b, HKV, G, T, D))
    return ops.reshape(ops.matmul(p, v5), (b, HQ, T, D))


CASES = {
    # mask [G, B, Hkv, S, T] (jax's vmapped order), moved onto the scores by a transpose
    "group-major": (
        (G, 2, HKV, T, T),
        lambda m: ops.transpose(m, (1, 2, 0, 3, 4)),
        lambda m: m.transpose(1, 2, 0, 3, 4),
    ),
    # mask [B, G, Hkv, S, T]: the head factors swapped, moved onto the scores by a transpose
    "heads-swapped": (
        (2, G, HKV, T, T),
        lambda m: ops.transpose(m, (0, 2, 1, 3, 4)),
        lambda m: m.transpose(0, 2, 1, 3, 4),
    ),
    # varies over the KV head only, broadcast over the group: [B, Hkv, 1, S, T]
    "kv-only": ((2, HKV, 1, T, T), lambda m: m, lambda m: m),
    # varies over the group only, broadcast over the KV heads: [B, 1, G, S, T]
    "group-only": ((2, 1, G, T, T), lambda m: m, lambda m: m),
}


@requires("mlx.core", "jax")
@pytest.mark.parametrize("case", sorted(CASES))
def test_handwritten_masks_in_other_head_orders_raise(rng, case):
    shape, to_grouped, to_grouped_np = CASES[case]
    specs = [TensorSpec(s, "float32") for s in ((2, HQ, T, D), (2, HKV, T, D), (2, HKV, T, D))]
    graph = trace(lambda q, k, v, m: grouped(q, k, v, m, to_grouped=to_grouped), *specs, TensorSpec(shape, "bool"))
    result = _raise(graph)
    assert len(_sdpas(result.graph)) == 1 and _attention_remark(result).kind == "applied"
    q, k, v = (rng.standard_normal(s.shape).astype(np.float32) for s in specs)
    m = rng.random(shape) < 0.6
    m[..., 0] = True
    allowed = np.broadcast_to(to_grouped_np(m), (2, HKV, G, T, T)).reshape(2, HQ, T, T)
    _differential(graph, result.graph, _reference(q, k, v, allowed, 0.25), q, k, v, m)


def test_a_mask_that_reorders_rows_and_keys_is_still_declined():
    """Only the batch and head factors may come in another order: a mask [B, T, S] used transposed is declined
    with the reason, and the graph is left as it was."""
    specs = [TensorSpec(s, "float32") for s in ((2, HQ, T, D), (2, HKV, T, D), (2, HKV, T, D))]
    graph = trace(
        lambda q, k, v, m: grouped(
            q, k, v, m, to_grouped=lambda m: ops.reshape(ops.transpose(m, (0, 2, 1)), (2, 1, 1, T, T))
        ),
        *specs,
        TensorSpec((2, T, T), "bool"),
    )
    before = graph.fingerprint()
    result = PassManager([RaiseAttention(canonicalize=False)]).run(graph)
    assert not _sdpas(result.graph)
    remark = _attention_remark(result)
    assert (remark.kind, remark.reason) == ("declined", "mask_layout"), remark.message
    assert "query rows and keys are not its last axes in that order" in remark.message
    assert [r.rule for r in result.applied()] == ["softmax"]  # the softmax is still raised; nothing else changes
    assert result.graph.fingerprint() != before
