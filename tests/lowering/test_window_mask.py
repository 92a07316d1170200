"""sdpa's structured mask, ``window=(left, right, chunk)`` (issue 23, docs/semantics.md §1.4), in the IR and on
every target against a float64 oracle written here row by row from the rule's plain comparisons."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import DType, Graph, ShapeError, TensorSpec, get_op, ops, parse_graph, trace
from attnpass.ir.dialects.attention import Window, key_ranges
from attnpass.ir.dialects.attention import visible as visible_mask
from attnpass.lowering import lower
from tests.util import assert_close, random_array, target_params

F32, BF16 = DType.float32, DType.bfloat16
HQ, HKV, D = 4, 2, 8


def visible(i: int, j: int, s: int, t: int, causal: str, window) -> bool:
    """docs/semantics.md §1.4, one (query, key) pair at a time."""
    p = i + (t - s if causal == "bottom_right" else 0)
    left, right, chunk = window or (None, None, None)
    return (
        (causal == "none" or j <= p)
        and (left is None or p - j < left)
        and (right is None or j - p <= right)
        and (chunk is None or j // chunk == p // chunk)
    )


def oracle(q, k, v, bias_or_keep, causal, window, *, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, hq, s, _ = q.shape
    t, group = k.shape[2], hq // k.shape[1]
    out = np.zeros((b_, hq, s, v.shape[3]))
    for b, h, i in np.ndindex(b_, hq, s):
        kv = h // group
        keep = np.array([visible(i, j, s, t, causal, window) for j in range(t)])
        scores = k[b, kv] @ q[b, h, i] * scale
        if bias_or_keep is not None and bias_or_keep.dtype == np.bool_:
            keep = keep & bias_or_keep[i]
        elif bias_or_keep is not None:
            scores = scores + np.asarray(bias_or_keep, np.float64)[i]
        if not keep.any():
            out[b, h, i] = v[b, kv].mean(axis=0)
            continue
        scores = np.where(keep, scores, -np.inf)
        weights = np.exp(scores - scores.max())
        out[b, h, i] = weights / weights.sum() @ v[b, kv]
    return out


def case(dtype, s, t, causal, window, mask=None, seed=0):
    rng = np.random.default_rng(seed)
    xs = [random_array(rng, (1, HQ, s, D), dtype, low=-3, high=3), random_array(rng, (1, HKV, t, D), dtype),
          random_array(rng, (1, HKV, t, D), dtype)]  # fmt: skip
    extra = None
    if mask == "bool":
        extra = rng.random((s, t)) < 0.7
    elif mask == "additive":
        extra = random_array(rng, (s, t), dtype)
    if extra is not None:
        xs.append(extra)
    specs = [TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs]
    fn = (lambda q, k, v: ops.sdpa(q, k, v, causal=causal, window=window)) if extra is None else (
        lambda q, k, v, m: ops.sdpa(q, k, v, mask=m, causal=causal, window=window))  # fmt: skip
    graph = trace(fn, *specs, name="attention")
    return graph, xs, oracle(*xs[:3], extra, causal, window, scale=1 / math.sqrt(D)).astype(dtype.numpy)


CASES = [  # (S, T, causal, window, mask)
    (6, 6, "bottom_right", (3, None, None), None),  # sliding window, as mlx-lm's create_causal_mask(window_size=3)
    (4, 9, "bottom_right", (3, None, None), "bool"),  # q_len < k_len: the last 4 positions
    (5, 5, "top_left", (None, None, 2), "additive"),  # llama4's chunked attention
    (7, 7, "none", (2, 1, None), None),  # a two-sided local window
    (4, 9, "top_left", (2, None, None), "additive"),  # top-left with q_len < k_len
    (6, 3, "top_left", (2, None, None), "additive"),  # rows 4 and 5 see no key: the mean of V
    (6, 3, "bottom_right", (None, None, 2), "bool"),  # bottom-right with q_len > k_len: rows 0-2 see no key
]
IDS = [f"S{s}T{t}-{c}-{w}-{m}" for s, t, c, w, m in CASES]


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("s, t, causal, window, mask", CASES, ids=IDS)
def test_every_target_matches_the_oracle(s, t, causal, window, mask, dtype, target):
    graph, xs, expected = case(dtype, s, t, causal, window, mask)
    assert_close(run(lower(graph, target), *xs), expected)


def test_the_window_changes_the_result():
    """Not vacuous: without the window the oracle differs."""
    graph, xs, expected = case(F32, 6, 6, "bottom_right", (3, None, None))
    plain = trace(lambda q, k, v: ops.sdpa(q, k, v, causal="bottom_right"), *graph.input_types())
    assert np.max(np.abs(run(lower(plain, "numpy"), *xs) - expected)) > 1e-2


@settings(max_examples=200, deadline=None)
@given(
    s=st.integers(1, 12),
    t=st.integers(1, 12),
    causal=st.sampled_from(["none", "top_left", "bottom_right"]),
    left=st.none() | st.integers(1, 6),
    right=st.none() | st.integers(0, 4),
    chunk=st.none() | st.integers(1, 5),
)
def test_key_ranges_are_exactly_the_visible_keys(s, t, causal, left, right, chunk):
    window = Window(left, None if causal != "none" else right, chunk)
    if window == Window():
        window = None
    lo, hi = key_ranges(s, t, causal, window)
    for i in range(s):
        seen = {j for j in range(t) if visible(i, j, s, t, causal, window)}
        assert seen == set(range(lo[i], hi[i])), (i, seen, lo[i], hi[i])


STRUCTURES = st.tuples(
    st.integers(1, 10),
    st.integers(1, 10),
    st.sampled_from(["none", "top_left", "bottom_right"]),
    st.none() | st.integers(1, 6),
    st.none() | st.integers(0, 4),
    st.none() | st.integers(1, 5),
)


def _structure(s, t, causal, left, right, chunk) -> tuple[int, int, str, Window | None]:
    window = Window(left, None if causal != "none" else right, chunk)
    return s, t, causal, None if window == Window() else window


@settings(max_examples=200, deadline=None)
@given(STRUCTURES)
def test_the_one_visibility_is_key_ranges_on_every_array_library(structure):
    """``visible`` (what the reference and the emitters call) is exactly ``key_ranges``' intervals, on numpy and on
    each array library the emitted programs pass it."""
    s, t, causal, window = _structure(*structure)
    seen = visible_mask(s, t, causal, window)
    if causal == "none" and window is None:
        assert seen is None
        return
    lo, hi = key_ranges(s, t, causal, window)
    assert seen.dtype == np.bool_ and np.array_equal(seen, (np.arange(t) >= lo[:, None]) & (np.arange(t) < hi[:, None]))
    for module in ("mlx.core", "jax.numpy"):
        xp = pytest.importorskip(module)
        assert np.array_equal(np.asarray(visible_mask(s, t, causal, window, xp)), seen), module


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@settings(max_examples=40, deadline=None)
@given(structure=STRUCTURES)
def test_each_program_attends_exactly_the_visible_keys(target, structure):
    """What a lowered sdpa attends, read off its output: zero scores and V the identity make row i the mean of the
    keys it sees (the mean of all T for a row that sees none), on the reference and the emitted programs."""
    s, t, causal, window = _structure(*structure)
    q, k = np.zeros((1, HQ, s, t), np.float32), np.zeros((1, HKV, t, t), np.float32)
    v = np.broadcast_to(np.eye(t, dtype=np.float32), (1, HKV, t, t)).copy()
    specs = [TensorSpec(x.shape, F32) for x in (q, k, v)]
    graph = trace(lambda q, k, v: ops.sdpa(q, k, v, causal=causal, window=window), *specs)
    out = np.asarray(run(lower(graph, target), q, k, v))
    seen = visible_mask(s, t, causal, window)
    seen = np.ones((s, t), bool) if seen is None else seen
    counts = seen.sum(axis=1, keepdims=True)
    expected = np.where(counts > 0, seen / np.maximum(counts, 1), 1 / t)
    assert_close(out, np.broadcast_to(expected, out.shape).astype(np.float32))


QT, KT = TensorSpec((1, 4, 3, 8), BF16), TensorSpec((1, 2, 5, 8), BF16)


def test_printed_and_json_forms_round_trip_the_window():
    g = trace(lambda q, k, v: ops.sdpa(q, k, v, causal="bottom_right", window=(2, None, 4)), QT, KT, KT)
    (line,) = [line for line in str(g).splitlines() if "= sdpa[" in line]
    assert "window=(2, None, 4)]" in line
    assert parse_graph(str(g)) == g and Graph.from_json(g.to_json()) == g
    assert parse_graph(str(g)).node(g.outputs[0]).attrs["window"] == Window(2, None, 4)
    assert parse_graph(str(g)).fingerprint() == Graph.from_json(g.to_json()).fingerprint() == g.fingerprint()
    prints = {trace(lambda q, k, v: ops.sdpa(q, k, v, causal="bottom_right", window=w), QT, KT, KT).fingerprint()
              for w in (None, (2, None, None), (3, None, None), (None, None, 2), (2, None, 2))}  # fmt: skip
    assert len(prints) == 5


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"window": (0, None, None)}, "window left 0 must be >= 1"),
        ({"window": (None, -1, None)}, "window right -1 must be >= 0"),
        ({"window": (None, None, 0)}, "window chunk 0 must be >= 1"),
        ({"window": (None, None, None)}, r"bounds nothing; write window=None"),
        ({"window": (2, None)}, r"expected None or \(left, right, chunk\)"),
        ({"window": (2.5, None, None)}, "window left must be an int or None"),
        ({"window": (2, 1, None), "causal": "top_left"}, "window right 1 with causal='top_left'"),
    ],
)
def test_the_verifier_names_a_bad_window(attrs, message):
    with pytest.raises(ShapeError, match=message):
        get_op("sdpa").result_type([QT.type, KT.type, KT.type], attrs)


def test_sdpa_lse_refuses_a_window():
    with pytest.raises(ShapeError, match=r"sdpa_lse: window \(2, None, None\) is not supported"):
        get_op("sdpa_lse").result_type([QT.type, KT.type, KT.type], {"window": (2, None, None)})
