"""The structured-mask rule on decomposed attention (issue 32): a position-built mask reached through
``where(m, s, -inf)``, ``s + where(m, 0, -inf)`` or a finite fill becomes sdpa's causal kind and window, so
block-sparse applies, bit-exact against the unrewritten function; any other mask stays dense with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import from_mlx
from attnpass.ir.dialects.attention import Window
from attnpass.lowering import lower
from attnpass.passes import PassManager, parse_pipeline
from tests.util import assert_bits_equal, lazy_import, requires

mx = lazy_import("mlx.core")
base = lazy_import("mlx_lm.models.base")
SCALE = 0.125


def _qkv(t: int, heads: int, d: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((1, heads, t, d)).astype(np.float32)) for _ in range(3)]


def _positions(t: int):
    return mx.arange(t)[:, None], mx.arange(t)[None, :]


def _scores(q, k):
    return (q @ k.swapaxes(-1, -2)) * SCALE


def hand_where(t: int, w: int | None):
    """``where(m, s, -inf)`` over a hand-written (windowed) causal mask."""

    def f(q, k, v):
        i, j = _positions(t)
        m = (j <= i) & (j > i - w) if w else j <= i
        return mx.softmax(mx.where(m, _scores(q, k), -mx.inf), -1) @ v

    return f


def lm_additive(t: int, w: int | None):
    """mlx-lm's ``create_causal_mask`` as an additive ``where(m, 0, -inf)``."""

    def f(q, k, v):
        m = base.create_causal_mask(t, 0, window_size=w)
        return mx.softmax(_scores(q, k) + mx.where(m, 0.0, -mx.inf), -1) @ v

    return f


def lm_finite_fill(t: int, w: int | None):
    """mlx-lm's ``create_causal_mask`` filled with float32's min (a bool mask once raised)."""

    def f(q, k, v):
        m = base.create_causal_mask(t, 0, window_size=w)
        return mx.softmax(mx.where(m, _scores(q, k), mx.finfo(mx.float32).min), -1, precise=True) @ v

    return f


def _pipeline(fn, args, text: str):
    result = PassManager(parse_pipeline(text)).run(from_mlx(fn, *args).graph)
    sdpas = [n for n in result.graph.nodes() if n.op == "sdpa"]
    remarks = {
        r.rule or r.pass_name: r for r in result.remarks if r.rule == "structured-mask" or r.pass_name == "block-sparse"
    }
    return result, sdpas, remarks


@requires("mlx.core", "mlx_lm")
@pytest.mark.parametrize("build", [hand_where, lm_additive, lm_finite_fill])
@pytest.mark.parametrize("window", [None, 16])
def test_decomposed_attention_over_a_position_mask_gets_the_structure_and_tiles(build, window):
    t = 64
    args, fn = _qkv(t, 2, 16), build(t, window)
    expected = np.array(fn(*args))
    raised, (sdpa,), remarks = _pipeline(fn, args, "raise-attention")
    assert (
        remarks["structured-mask"].kind == "applied"
        and f"all {t * t} pairs checked" in remarks["structured-mask"].message
    )
    assert len(sdpa.inputs) == 3 and sdpa.attrs["causal"] == "bottom_right"
    assert sdpa.attrs["window"] == (Window(window) if window else None)
    assert_bits_equal(run(lower(raised.graph, "mlx"), *args), expected)
    tiled, sdpas, remarks = _pipeline(fn, args, "raise-attention,block-sparse{block_q=16}")
    assert remarks["block-sparse"].kind == "applied" and len(sdpas) == 4
    assert_bits_equal(run(lower(tiled.graph, "mlx"), *args), expected)


@requires("mlx.core")
def test_issue_32_repro_hand_written_sliding_window_is_tiled():
    """T 2048, window 256, 8 heads, head dim 64, ``raise-attention,block-sparse``: was ``structured-mask 0`` and
    block-sparse's ``no_structured_mask``."""
    t, w = 2048, 256
    args, fn = _qkv(t, 8, 64, seed=1), hand_where(t, w)
    result, sdpas, remarks = _pipeline(fn, args, "raise-attention,block-sparse")
    assert (
        remarks["structured-mask"].kind == "applied"
        and "window=(256, None, None)" in remarks["structured-mask"].message
    )
    assert remarks["block-sparse"].kind == "applied" and len(sdpas) == 4  # 512-row tiles on CPU
    assert_bits_equal(run(lower(result.graph, "mlx"), *args), np.array(fn(*args)))


def _dense_remark(fn, args):
    result, (sdpa,), remarks = _pipeline(fn, args, "raise-attention")
    assert len(sdpa.inputs) == 4 and sdpa.attrs["window"] is None and sdpa.attrs["causal"] == "none"
    assert_bits_equal(run(lower(result.graph, "mlx"), *args), np.array(fn(*args)))
    return remarks["structured-mask"]


@requires("mlx.core")
def test_an_additive_mask_that_empties_a_row_stays_dense_and_says_why():
    """Row 0 sees no key: -inf everywhere is NaN in the source, the mean of V under a causal kind."""
    t = 8

    def f(q, k, v):
        i, j = _positions(t)
        return mx.softmax(_scores(q, k) + mx.where((j < i), 0.0, -mx.inf), -1) @ v

    remark = _dense_remark(f, _qkv(t, 2, 16))
    assert (remark.kind, remark.reason) == ("declined", "rows_without_keys") and "row 0" in remark.message


@requires("mlx.core")
def test_a_static_additive_mask_with_other_values_stays_dense_and_says_why():
    """A finite additive fill is not a structure: the remark names the value."""
    t = 8

    def f(q, k, v):
        i, j = _positions(t)
        return mx.softmax(_scores(q, k) + mx.where(j <= i, 0.0, -1e9), -1) @ v

    remark = _dense_remark(f, _qkv(t, 2, 16))
    assert (remark.kind, remark.reason) == ("declined", "mask_not_structured") and "-1000000000.0" in remark.message


@requires("mlx.core")
def test_a_run_time_additive_mask_stays_dense_and_says_why():
    args = _qkv(8, 2, 16) + [mx.zeros((8, 8))]

    def f(q, k, v, m):
        return mx.softmax(_scores(q, k) + m, -1) @ v

    _result, (sdpa,), remarks = _pipeline(f, args, "raise-attention")
    remark = remarks["structured-mask"]
    assert len(sdpa.inputs) == 4
    assert (remark.kind, remark.reason) == ("declined", "mask_not_static") and "graph input m" in remark.message
