"""A query row that attends no key: every target, the reference and the peers agree (issue 14, item 0).

Pinned semantics (``sdpa``'s op doc): a bool mask and ``causal`` exclude keys;
a row they leave without any key weighs all ``T`` keys equally, so it is the
mean of V over the row's KV head, never NaN. That is what MLX's fused call
and ``jax.nn.dot_product_attention`` return: they fill excluded scores with a
large finite negative (MLX the dtype's min, JAX ``-0.7 * max``), so such a
row's scores are all equal. An additive mask is arithmetic: a row it sets to
``-inf`` everywhere is NaN, in both peers and here.

The peers' cases: an all-False bool mask row (the MLX test suite's
``test_sdpa_fully_masked``), bottom-right causal with ``q_len > kv_len``
(its rows ``< q_len - kv_len`` see no key), and both with an additive mask.
Each runs on every target, against the peers' own fused functions, and after
head-chunk and decompose-sdpa (its bool fill is finite, as the peers'); qsa-gather keeps a hidden row NaN (additive visibility) or keeps
the masked path (bool visibility).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes import DecomposeSDPA, HeadChunkSDPA, PassManager, QSAGather, parse_pipeline
from tests.util import assert_close, random_array, requires

pytestmark = requires("mlx.core", "jax")

TARGETS = ("numpy", "mlx", "jax")
F32, F16, BF16 = DType.float32, DType.float16, DType.bfloat16
HQ, HKV, D = 4, 2, 8


def oracle(q, k, v, keep, bias=None, *, scale):
    """Row by row in float64: softmax over the kept keys of scores + bias; no key kept -> mean of V."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, hq, s, _ = q.shape
    t, group = k.shape[2], hq // k.shape[1]
    keep = np.broadcast_to(keep, (b_, hq, s, t))
    bias = np.zeros((b_, hq, s, t)) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), (b_, hq, s, t))
    out = np.zeros((b_, hq, s, v.shape[3]))
    for b, h, i in np.ndindex(b_, hq, s):
        kv = h // group
        if not keep[b, h, i].any():
            out[b, h, i] = v[b, kv].mean(axis=0)
            continue
        scores = np.where(keep[b, h, i], k[b, kv] @ q[b, h, i] * scale + bias[b, h, i], -np.inf)
        with np.errstate(invalid="ignore"):  # an additive row of -inf: 0/0, NaN as in the peers
            weights = np.exp(scores - scores.max())
            out[b, h, i] = weights / weights.sum() @ v[b, kv]
    return out


def causal_keep(s: int, t: int, causal: str) -> np.ndarray:
    offset = {"none": None, "top_left": 0, "bottom_right": t - s}[causal]
    return np.ones((s, t), bool) if offset is None else np.arange(t)[None, :] <= np.arange(s)[:, None] + offset


def case(name: str, dtype: DType, dv: int = D):
    """(graph, inputs, expected): ``name`` picks the mask and causal alignment (see the module docstring)."""
    s, t, causal, mask = {
        "bool-row": (3, 5, "none", "bool"),  # row 1 of every head masked, the rest partly
        "bool-per-head": (3, 5, "none", "bool-heads"),  # only query head 2's row 0
        "bottom-right": (6, 3, "bottom_right", None),  # rows 0..2 see no key
        "bottom-right-bool": (6, 3, "bottom_right", "bool"),
        "bottom-right-additive": (6, 3, "bottom_right", "additive"),
        "top-left-bool": (3, 5, "top_left", "bool"),
    }[name]
    rng = np.random.default_rng(len(name) + 10 * dv)
    q = random_array(rng, (1, HQ, s, D), dtype)
    k = random_array(rng, (1, HKV, t, D), dtype)
    v = random_array(rng, (1, HKV, t, dv), dtype)
    xs, keep, bias = [q, k, v], causal_keep(s, t, causal), None
    if mask in ("bool", "bool-heads"):
        m = rng.random((1, HQ, s, t) if mask == "bool-heads" else (s, t)) < 0.6
        m[..., :, 0] = True
        if mask == "bool-heads":
            m[0, 2, 0, :] = False
        else:
            m[1, :] = False
        xs.append(m)
        keep = keep & m
    elif mask == "additive":
        bias = random_array(rng, (s, t), dtype)
        xs.append(bias)
    fn = (lambda q, k, v, m: ops.sdpa(q, k, v, mask=m, causal=causal)) if len(xs) == 4 else None
    fn = fn or (lambda q, k, v: ops.sdpa(q, k, v, causal=causal))
    graph = trace(fn, *[TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs], name="attention")
    expected = oracle(q, k, v, keep, bias, scale=1 / math.sqrt(D)).astype(dtype.numpy)
    return graph, xs, expected


NAMES = ("bool-row", "bool-per-head", "bottom-right", "bottom-right-bool", "bottom-right-additive", "top-left-bool")
CASES = [pytest.param(n, F32, D, id=f"{n}-f32") for n in NAMES]
CASES += [
    pytest.param(n, dt, D, id=f"{n}-{dt.short}") for n in ("bool-row", "bottom-right-additive") for dt in (F16, BF16)
]
CASES += [pytest.param(n, F32, 4, id=f"{n}-dv4") for n in ("bool-row", "bottom-right-additive")]  # JAX's explicit form


def test_oracle_pins_the_mean_of_v():
    _graph, (_q, _k, v, _m), expected = case("bool-row", F32)
    mean = v.astype(np.float64).mean(axis=2)  # [B, Hkv, Dv]
    np.testing.assert_allclose(expected[0, :, 1], np.repeat(mean[0], HQ // HKV, axis=0), rtol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name, dtype, dv", CASES)
def test_every_target_returns_the_mean_of_v(name, dtype, dv, target):
    graph, xs, expected = case(name, dtype, dv)
    out = run(lower(graph, target), *xs)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_close(out, expected)


@pytest.mark.parametrize("name, dtype, dv", CASES)
def test_head_chunk_keeps_it(name, dtype, dv):
    graph, xs, expected = case(name, dtype, dv)
    q_len = graph.input_types()[0].shape[2]
    chunked = HeadChunkSDPA(budget=q_len, enabled=True)(graph).graph  # one query head per subcall
    assert sum(n.op == "sdpa" for n in chunked.nodes()) == HQ
    for target in TARGETS:
        assert_close(run(lower(chunked, target), *xs), expected)


@pytest.mark.parametrize("name, dtype, dv", CASES)
def test_decompose_sdpa_keeps_it(name, dtype, dv):
    graph, xs, expected = case(name, dtype, dv)
    result = DecomposeSDPA()(graph)
    causal = graph.node(graph.outputs[0]).attrs["causal"]
    assert result.changed == (causal == "none")  # a causal call stays fused on every device
    for target in TARGETS:
        out = run(lower(result.graph, target), *xs)
        assert np.isfinite(out.astype(np.float32)).all() or name.endswith("additive")
        assert_close(out, expected)


def _mlx_direct(q, k, v, mask, dtype: DType):
    import mlx.core as mx

    from attnpass.backends import to_numpy

    arrays = [mx.array(x.astype(np.float32)).astype(getattr(mx, dtype.value)) for x in (q, k, v)]
    return to_numpy(mx.fast.scaled_dot_product_attention(*arrays, scale=1 / math.sqrt(D), mask=mask))


def _jax_direct(q, k, v, mask, dtype: DType, *, bias=None):
    import jax
    import jax.numpy as jnp

    swap = lambda x: jnp.swapaxes(jnp.asarray(x), 1, 2)  # noqa: E731  [B, H, S, D] <-> [B, S, H, D]
    out = jax.nn.dot_product_attention(swap(q), swap(k), swap(v), scale=1 / math.sqrt(D), mask=mask, bias=bias)
    return np.asarray(swap(out))


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=lambda d: d.short)
def test_peers_fully_masked_bool_row(dtype):
    """MLX's and JAX's own fused calls on an all-False row: the mean of V, like every target."""
    import mlx.core as mx

    _, (q, k, v, m), expected = case("bool-row", dtype)
    assert_close(_mlx_direct(q, k, v, mx.array(m), dtype), expected)
    assert_close(_jax_direct(q, k, v, m, dtype), expected)


def test_peers_bottom_right_causal_with_more_queries_than_keys():
    """MLX's ``mask="causal"`` aligns bottom-right; with q_len > kv_len its first rows see no key."""
    _, (q, k, v), expected = case("bottom-right", F32)
    assert_close(_mlx_direct(q, k, v, "causal", F32), expected)
    assert_close(_jax_direct(q, k, v, causal_keep(6, 3, "bottom_right"), F32), expected)


def test_additive_rows_of_minus_infinity_are_nan_everywhere():
    """An additive mask is arithmetic: a row of -inf is 0/0 in the peers, the reference and every target."""
    import mlx.core as mx

    rng = np.random.default_rng(5)
    q, k, v = (random_array(rng, shape, F32) for shape in ((1, HQ, 3, D), (1, HKV, 5, D), (1, HKV, 5, D)))
    bias = np.where(rng.random((3, 5)) < 0.6, 0.0, -np.inf).astype(np.float32)
    bias[0], bias[1] = -np.inf, 0.0
    graph = trace(lambda q, k, v, m: ops.sdpa(q, k, v, mask=m), *[TensorSpec(x.shape) for x in (q, k, v, bias)])
    outs = [run(lower(graph, t), q, k, v, bias) for t in TARGETS]
    outs += [_mlx_direct(q, k, v, mx.array(bias), F32), _jax_direct(q, k, v, None, F32, bias=bias)]
    expected = oracle(q, k, v, np.ones((3, 5), bool), bias, scale=1 / math.sqrt(D)).astype(np.float32)
    assert np.isnan(expected[:, :, 0]).all() and np.isfinite(expected[:, :, 1:]).all()
    for out in outs:
        assert_close(out, expected)


def test_qsa_gather_keeps_a_hidden_row_nan_and_bool_visibility_masked():
    """The additive visibility form hides a row to NaN on both paths; the bool form is not gathered at all."""

    def decode(q, k, v, scores, positions, vis):
        sel = ops.qsa_select(scores, positions, ratio=2, top_k_blocks=2)
        keep = ops.qsa_mask(sel, positions, ratio=2, kv_len=12)
        mask = ops.where(keep, vis, -math.inf) if vis.dtype is F32 else ops.logical_and(keep, vis)
        return ops.sdpa(q, k, v, mask=mask)

    shapes = [(1, HQ, 1, D), (1, HKV, 12, D), (1, HKV, 12, D), (1, 1, 6)]
    rng = np.random.default_rng(3)
    xs = [random_array(rng, s, F32) for s in shapes] + [np.array([[10]], np.int32)]
    vis = np.full((1, 1, 1, 12), -np.inf, np.float32)  # every cell hidden
    graph = trace(decode, *[TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs + [vis]])
    gathered = PassManager(parse_pipeline("qsa-gather{enabled=true},dce")).run(graph).graph
    assert "qsa_gather" in {n.op for n in gathered.nodes()}
    for target in TARGETS:
        assert np.isnan(run(lower(graph, target), *xs, vis)).all()
        assert np.isnan(run(lower(gathered, target), *xs, vis)).all()
    specs = [TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs]
    bool_graph = trace(decode, *specs, TensorSpec((1, 1, 1, 12), "bool"))
    assert not QSAGather(enabled=True)(bool_graph).changed
