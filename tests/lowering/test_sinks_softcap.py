"""sdpa's attention sinks and logit soft-capping (issue 23): every target against a float64 oracle.

The oracle is written here, row by row, independently of the numpy reference:
scores ``q·k * scale``, soft-capped ``c tanh(s / c)``, then masked, then the
head's sink logit appended as one more softmax column that carries no value.
A row the bool mask leaves without keys weighs only its sink: 0 (what MLX's
fused ``sinks=`` call returns, pinned against it below).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, ShapeError, TensorSpec, ops, trace
from attnpass.lowering import lower
from tests.util import assert_close, random_array, requires

TARGETS = ("numpy", "mlx", "jax")
F32, BF16 = DType.float32, DType.bfloat16
HQ, HKV, D, S, T = 4, 2, 8, 3, 5


def oracle(q, k, v, keep, bias, sinks, softcap, *, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, hq, s, _ = q.shape
    group = hq // k.shape[1]
    out = np.zeros((b_, hq, s, v.shape[3]))
    for b, h, i in np.ndindex(b_, hq, s):
        kv = h // group
        scores = k[b, kv] @ q[b, h, i] * scale
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        if bias is not None:
            scores = scores + np.asarray(bias, np.float64)[i]
        scores = np.where(keep[i], scores, -np.inf)
        if sinks is None and not keep[i].any():
            out[b, h, i] = v[b, kv].mean(axis=0)
            continue
        column = [] if sinks is None else [float(np.asarray(sinks, np.float64)[h])]
        logits = np.concatenate([scores, column])
        weights = np.exp(logits - logits.max())
        out[b, h, i] = (weights / weights.sum())[:T] @ v[b, kv]
    return out


def case(dtype: DType, *, sinks: bool, softcap: float | None, mask: str | None, causal: str = "none", seed=0):
    rng = np.random.default_rng(seed)
    q = random_array(rng, (1, HQ, S, D), dtype, low=-3, high=3)
    k = random_array(rng, (1, HKV, T, D), dtype, low=-3, high=3)
    v = random_array(rng, (1, HKV, T, D), dtype)
    xs = [q, k, v]
    keep, bias = np.ones((S, T), bool), None
    if causal != "none":
        keep = np.arange(T)[None, :] <= np.arange(S)[:, None] + (T - S if causal == "bottom_right" else 0)
    if mask == "bool":
        m = rng.random((S, T)) < 0.6
        m[:, 0] = True
        m[1] = False  # row 1 attends no key
        keep = keep & m
        xs.append(m)
    elif mask == "additive":
        bias = random_array(rng, (S, T), dtype)
        xs.append(bias)
    if sinks:
        xs.append(random_array(rng, (HQ,), dtype, low=-1, high=3))
    has_mask = mask is not None

    def call(q, k, v, rest):
        return ops.sdpa(
            q, k, v, mask=rest[0] if has_mask else None, sinks=rest[-1] if sinks else None, causal=causal,
            logit_softcap=softcap,
        )  # fmt: skip

    fn = {3: lambda q, k, v: call(q, k, v, ()), 4: lambda q, k, v, a: call(q, k, v, (a,)),
          5: lambda q, k, v, a, b: call(q, k, v, (a, b))}[len(xs)]  # fmt: skip
    graph = trace(fn, *[TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs], name="attention")
    expected = oracle(q, k, v, keep, bias, xs[-1] if sinks else None, softcap, scale=1 / math.sqrt(D))
    return graph, xs, expected.astype(dtype.numpy)


VARIANTS = [
    dict(sinks=True, softcap=None, mask=None),
    dict(sinks=True, softcap=None, mask="bool"),
    dict(sinks=True, softcap=None, mask="additive"),
    dict(sinks=True, softcap=None, mask=None, causal="bottom_right"),
    dict(sinks=False, softcap=2.0, mask=None),
    dict(sinks=False, softcap=2.0, mask="bool"),
    dict(sinks=False, softcap=2.0, mask="additive", causal="top_left"),
    dict(sinks=True, softcap=2.0, mask="bool"),
]
IDS = ["-".join(f"{k}={v}" for k, v in variant.items()) for variant in VARIANTS]


@pytest.mark.parametrize("target", [pytest.param(t, marks=requires({"mlx": "mlx.core", "jax": "jax"}[t]))
                                    if t != "numpy" else t for t in TARGETS])  # fmt: skip
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_every_target_matches_the_oracle(variant, dtype, target):
    graph, xs, expected = case(dtype, **variant)
    out = run(lower(graph, target), *xs)
    assert_close(out, expected)


def test_the_softcap_and_the_sinks_change_the_result():
    """Not vacuous: the oracle with neither differs from each variant's."""
    for variant in (dict(sinks=True, softcap=None, mask=None), dict(sinks=False, softcap=2.0, mask=None)):
        graph, xs, expected = case(F32, **variant)
        plain = trace(lambda q, k, v: ops.sdpa(q, k, v), *[TensorSpec(x.shape, DType.float32) for x in xs[:3]])
        assert np.max(np.abs(run(lower(plain, "numpy"), *xs[:3]) - expected)) > 1e-2


@requires("mlx.core")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_a_row_without_keys_is_zero_as_mlx_gives_it(dtype):
    import mlx.core as mx

    graph, xs, expected = case(dtype, sinks=True, softcap=None, mask="bool")
    q, k, v, m, sinks = (mx.array(x) for x in xs)
    peer = np.asarray(mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(D), mask=m, sinks=sinks)
                      .astype(mx.float32))  # fmt: skip
    assert np.all(peer[:, :, 1] == 0) and np.all(expected[:, :, 1] == 0)
    for target in TARGETS:
        out = run(lower(graph, target), *xs)
        assert np.all(out[:, :, 1].astype(np.float32) == 0), target
    assert_close(peer.astype(dtype.numpy), expected)


def test_the_verifier_names_bad_sinks_and_caps():
    spec = [TensorSpec((1, HQ, S, D), BF16), TensorSpec((1, HKV, T, D), BF16), TensorSpec((1, HKV, T, D), BF16)]
    for sinks, message in ((TensorSpec((HKV,), BF16), r"sinks .* must be \[Hq\] = \[4\]"),
                           (TensorSpec((HQ,), F32), "must have q's dtype bfloat16")):  # fmt: skip
        with pytest.raises(ShapeError, match=message):
            trace(lambda q, k, v, s: ops.sdpa(q, k, v, sinks=s), *spec, sinks)
    with pytest.raises(ShapeError, match="logit_softcap -1.0 must be > 0"):
        trace(lambda q, k, v: ops.sdpa(q, k, v, logit_softcap=-1.0), *spec)


@pytest.mark.parametrize("target", ["numpy", pytest.param("mlx", marks=requires("mlx.core")),
                                    pytest.param("jax", marks=requires("jax"))])  # fmt: skip
def test_bfloat16_sinks_with_float32_q_are_promoted_exactly(target):
    graph, xs, _ = case(F32, sinks=True, softcap=None, mask="bool")
    sinks16 = xs[-1].astype(DType.bfloat16.numpy)
    specs = [TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs[:-1]] + [TensorSpec((HQ,), DType.bfloat16)]
    mixed = trace(lambda q, k, v, m, s: ops.sdpa(q, k, v, mask=m, sinks=s), *specs, name="attention")
    exact = [*xs[:-1], sinks16.astype(np.float32)]  # the same values, as float32
    assert_close(run(lower(mixed, target), *xs[:-1], sinks16), run(lower(graph, "numpy"), *exact))
