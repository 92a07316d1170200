"""The QSA dialect and the mask-building ops: shape rules, semantics, and equality across targets."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import DType, ShapeError, TensorSpec, ops, trace
from attnpass.lowering import lower
from tests.util import lazy_import, requires, target_params

jax = lazy_import("jax")

R, K, NB, T = 4, 5, 20, 83  # T is not a multiple of R: 20 complete blocks + 3 cells
WIDTH = K * R + R - 1 + 2  # two padding slots
B, S = 2, 3


def selection_graph():
    def qsa_selection(scores, positions):
        sel = ops.qsa_select(scores, positions, ratio=R, top_k_blocks=K)
        keep = ops.qsa_mask(sel, positions, ratio=R, kv_len=T)
        cells = ops.qsa_cells(sel, positions, ratio=R, width=WIDTH, kv_len=T)
        valid = ops.qsa_cell_valid(sel, positions, ratio=R, width=WIDTH, kv_len=T)
        return sel, keep, cells, valid

    return trace(qsa_selection, TensorSpec((B, S, NB)), TensorSpec((B, S), "int32"))


GRAPH = selection_graph()
PROGRAMS: dict[str, object] = {}


def call(target: str, *args):
    """Run GRAPH on ``target`` (JAX jitted once, so hypothesis examples stay cheap)."""
    if target not in PROGRAMS:
        program = lower(GRAPH, target)
        if target == "jax":
            fn = jax.jit(program.fn)
            PROGRAMS[target] = lambda *a, p=program, f=fn: tuple(np.asarray(x) for x in f(*p.bind(*a)))
        else:
            PROGRAMS[target] = lambda *a, p=program: run(p, *a)
    return PROGRAMS[target](*args)


def brute_force(scores: np.ndarray, p: int) -> tuple[list[int], set[int]]:
    """The selection and the attended cell set of one row, straight from docs/semantics.md §3.2."""
    n_complete = (p + 1) // R
    visible = [(-(-math.inf if math.isnan(s) else s), b) for b, s in enumerate(scores[:n_complete])]
    chosen = sorted(b for _, b in sorted(visible)[: min(K, n_complete)])
    cells = {b * R + i for b in chosen for i in range(R)} | set(range(n_complete * R, p + 1))
    return chosen, cells


def check_row(sel, keep, cells, valid, scores_row, p):
    chosen, attended = brute_force(scores_row, p)
    assert list(sel[: len(chosen)]) == chosen and (sel[len(chosen) :] == -1).all()
    assert set(np.flatnonzero(keep)) == attended
    assert sorted(cells[valid]) == sorted(attended)  # each attended cell exactly once
    assert (cells[~valid] == 0).all()
    block_slots = cells[: K * R][valid[: K * R]]
    assert list(block_slots) == sorted(block_slots)  # ascending block order


scores_st = st.lists(
    st.sampled_from([0.0, -0.0, 1.0, 2.0, 2.0, -1.0, math.inf, -math.inf, math.nan, 0.5]),
    min_size=B * S * NB,
    max_size=B * S * NB,
).map(lambda v: np.array(v, dtype=np.float32).reshape(B, S, NB))
positions_st = st.lists(st.integers(0, T - 1), min_size=B * S, max_size=B * S).map(
    lambda v: np.array(v, dtype=np.int32).reshape(B, S)
)


@requires("mlx.core", "jax")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scores=scores_st, positions=positions_st)
def test_selection_mask_and_cells_follow_the_spec_on_every_target(scores, positions):
    expected = call("numpy", scores, positions)
    for b in range(B):
        for s in range(S):
            sel, keep, cells, valid = (x[b, s] for x in (expected[0], expected[1][:, 0], expected[2], expected[3]))
            check_row(sel, keep, cells, valid, scores[b, s], int(positions[b, s]))
    for target in ("mlx", "jax"):
        for want, got in zip(expected, call(target, scores, positions)):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want, err_msg=target)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_every_tail_length_and_ties_to_the_lower_block(target):
    scores = np.zeros((B, S, NB), dtype=np.float32)  # all tied
    scores[..., 7] = 1.0
    scores[0, 1] = -0.0  # signed zeros tie with +0.0
    positions = np.array([[42, 43, 44], [45, 2, 82]], dtype=np.int32)  # tails 3, 0, 1, 2; short; last cell
    sel, keep, cells, valid = call(target, scores, positions)
    np.testing.assert_array_equal(sel[0, 0], [0, 1, 2, 3, 7])
    np.testing.assert_array_equal(sel[0, 1], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(sel[1, 1], [-1] * K)  # p=2: no complete block, tail 0..2 only
    tails = [set(cells[b, s, K * R : K * R + R - 1][valid[b, s, K * R : K * R + R - 1]]) for b, s in np.ndindex(B, S)]
    assert tails == [{40, 41, 42}, set(), {44}, {44, 45}, {0, 1, 2}, {80, 81, 82}]


@requires("mlx.core", "jax")
def test_fewer_blocks_than_k_pad_with_minus_one():
    def f(scores, positions):
        return ops.qsa_select(scores, positions, ratio=4, top_k_blocks=6)

    g = trace(f, TensorSpec((1, 1, 3)), TensorSpec((1, 1), "int32"))
    scores, positions = np.array([[[1.0, 3.0, 2.0]]], np.float32), np.array([[40]], np.int32)
    for target in ("numpy", "mlx", "jax"):
        np.testing.assert_array_equal(run(lower(g, target), scores, positions), [[[0, 1, 2, -1, -1, -1]]])


@requires("mlx.core", "jax")
def test_numpy_reference_rejects_out_of_contract_values_and_backends_never_read_out_of_bounds():
    scores = np.ones((B, S, NB), dtype=np.float32)
    beyond = np.full((B, S), T + 9, dtype=np.int32)  # positions past the cache
    with pytest.raises(ValueError, match=r"position 92 is outside the cache \[0, 83\)"):
        call("numpy", scores, beyond)
    for target in ("mlx", "jax"):
        _sel, keep, cells, valid = call(target, scores, beyond)
        assert (cells >= 0).all() and (cells < T).all()
        assert (cells[~valid] == 0).all()
        for b, s in np.ndindex(B, S):
            assert sorted(cells[b, s][valid[b, s]]) == list(np.flatnonzero(keep[b, 0, s]))

    def masked(selection, positions):
        return ops.qsa_mask(selection, positions, ratio=R, kv_len=T)

    g = trace(masked, TensorSpec((1, 1, 2), "int32"), TensorSpec((1, 1), "int32"))
    bad = np.array([[[3, 21]]], dtype=np.int32)  # ceil(83 / 4) = 21 blocks: id 21 is out of range
    with pytest.raises(ValueError, match=r"block id 21 is out of range \[-1, 21\)"):
        run(lower(g, "numpy"), bad, np.array([[80]], np.int32))
    for target in ("mlx", "jax"):
        got = run(lower(g, target), bad, np.array([[80]], np.int32))
        assert set(np.flatnonzero(got)) == set(range(12, 16)) | {80}  # block 3 and the tail; id 21 dropped


def pool_and_score_graph():
    def indexer(q, raw_keys):
        return ops.qsa_pool(raw_keys, ratio=3), ops.qsa_block_scores(q, ops.qsa_pool(raw_keys, ratio=3))

    return trace(indexer, TensorSpec((2, 2, 4, 8)), TensorSpec((2, 14, 8)))


@requires("mlx.core", "jax")
def test_pool_is_the_float32_block_mean_bit_identical_across_targets_and_scores_match_the_formula():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2, 4, 8), dtype=np.float32)
    keys = rng.standard_normal((2, 14, 8), dtype=np.float32)
    g = pool_and_score_graph()
    outs = {t: run(lower(g, t), q, keys) for t in ("numpy", "mlx", "jax")}
    pooled = outs["numpy"][0]
    assert pooled.shape == (2, 4, 8)  # 14 // 3 complete blocks; the last 2 rows are dropped
    np.testing.assert_allclose(pooled, keys[:, :12].reshape(2, 4, 3, 8).mean(axis=2), rtol=1e-6)
    dots = np.einsum("bshd,bnd->bshn", q.astype(np.float64), pooled.astype(np.float64))
    expected = np.maximum(dots, 0).sum(axis=2) / math.sqrt(8)
    for target, (p, s) in outs.items():
        if target == "jax":  # XLA's CPU float32 division is not correctly rounded (1 ulp off at ratio 3)
            np.testing.assert_array_max_ulp(p, pooled, maxulp=1)
        else:
            np.testing.assert_array_equal(p, pooled, err_msg=target)
        assert s.dtype == np.float32 and s.shape == (2, 2, 4)
        np.testing.assert_allclose(s, expected, rtol=1e-5, err_msg=target)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: trace(
                lambda s, p: ops.qsa_select(s, p, ratio=4, top_k_blocks=2), TensorSpec((1, 1, 8)), TensorSpec((1, 1))
            ),
            "positions has dtype float32",
        ),
        (
            lambda: trace(
                lambda s, p: ops.qsa_select(s, p, ratio=4, top_k_blocks=2),
                TensorSpec((1, 1, 8), "float16"),
                TensorSpec((1, 1), "int32"),
            ),
            "block_scores has dtype float16",
        ),
        (
            lambda: trace(
                lambda s, p: ops.qsa_select(s, p, ratio=0, top_k_blocks=2),
                TensorSpec((1, 1, 8)),
                TensorSpec((1, 1), "int32"),
            ),
            "ratio=0 must be >= 1",
        ),
        (
            lambda: trace(
                lambda s, p: ops.qsa_select(s, p, ratio=4, top_k_blocks=2),
                TensorSpec((1, 2, 8)),
                TensorSpec((1, 1), "int32"),
            ),
            r"positions i32\[1,1\] must be \[B, S\] = \[1, 2\]",
        ),
        (
            lambda: trace(
                lambda s, p: ops.qsa_mask(s, p, ratio=4, kv_len=16), TensorSpec((1, 1, 2)), TensorSpec((1, 1), "int32")
            ),
            "selection has dtype float32",
        ),
        (
            lambda: trace(
                lambda s, p: ops.qsa_cells(s, p, ratio=4, width=10, kv_len=64),
                TensorSpec((1, 1, 2), "int32"),
                TensorSpec((1, 1), "int32"),
            ),
            "width=10 is too small .* need K\\*ratio \\+ ratio - 1 = 11",
        ),
        (
            lambda: trace(lambda q, k: ops.qsa_block_scores(q, k), TensorSpec((1, 1, 4, 8)), TensorSpec((1, 5, 16))),
            "disagree on B or Di",
        ),
        (lambda: trace(lambda k: ops.qsa_pool(k, ratio=4), TensorSpec((16,))), "rank >= 2"),
        (lambda: trace(lambda k: ops.qsa_pool(k, ratio=4), TensorSpec((1, 16, 8), "int32")), "float tensor"),
    ],
)
def test_shape_rules_reject_bad_operands_with_the_reason(build, message):
    with pytest.raises(ShapeError, match=message):
        build()


def test_shape_rules_give_the_documented_types():
    def f(idx_q, raw, positions):
        pooled = ops.qsa_pool(raw, ratio=4)
        scores = ops.qsa_block_scores(idx_q, pooled)
        sel = ops.qsa_select(scores, positions, ratio=4, top_k_blocks=3)
        return (
            pooled, scores, sel, ops.qsa_mask(sel, positions, ratio=4, kv_len=50),
            ops.qsa_cells(sel, positions, ratio=4, width=16, kv_len=50),
            ops.qsa_cell_valid(sel, positions, ratio=4, width=16, kv_len=50),
        )  # fmt: skip

    g = trace(f, TensorSpec((2, 1, 4, 8), "bfloat16"), TensorSpec((2, 50, 8), "bfloat16"), TensorSpec((2, 1), "int32"))
    assert [str(g.node(o).type) for o in g.outputs] == [
        "bf16[2,12,8]", "f32[2,1,12]", "i32[2,1,3]", "bool[2,1,1,50]", "i32[2,1,16]", "bool[2,1,16]",
    ]  # fmt: skip
    assert {g.node(o).opdef.family for o in g.outputs} == {"qsa"}


@requires("mlx.core", "jax")
def test_mask_ops_take_python_scalars_and_lower_on_every_target():
    def f(x, y, m):
        return (
            ops.logical_and(m, ops.less(x, 0.5)), ops.logical_or(m, False), ops.equal(x, y),
            ops.greater_equal(x, y), ops.rsqrt(y),
        )  # fmt: skip

    g = trace(f, TensorSpec((3, 4)), TensorSpec((4,)), TensorSpec((3, 1), "bool"))
    x = np.array([[0.0, 1.0, 2.0, 0.25]] * 3, np.float32)
    y = np.array([0.0, 1.0, 4.0, 0.25], np.float32) + np.float32(1.0)
    m = np.array([[True], [False], [True]])
    want = (m & (x < 0.5), m, x == y, x >= y, 1 / np.sqrt(y))
    for target in ("numpy", "mlx", "jax"):
        for w, got in zip(want, run(lower(g, target), x, y, m)):
            assert got.shape == w.shape and got.dtype == w.dtype
            np.testing.assert_allclose(got, w, rtol=1e-6, err_msg=target)
    with pytest.raises(ShapeError, match="logical_and: operand has dtype float32"):
        trace(lambda a: ops.logical_and(a, True), TensorSpec((2,)))


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize(("b", "h", "s"), [(1, 1, 1), (1, 2, 1), (2, 2, 3), (3, 1, 2)])
def test_qsa_gather_reads_every_rows_cells_bit_for_bit(target, b, h, s):
    """out[b*S + s, h, w] = x[b, h, cells[b, s, w]] (bf16 bits), whichever gather the target lowers it to."""
    t, d, w = 40, 8, 9
    graph = trace(ops.qsa_gather, TensorSpec((b, h, t, d), "bfloat16"), TensorSpec((b, s, w), "int32"))
    assert graph.node(graph.outputs[0]).type.shape == (b * s, h, w, d)
    rng = np.random.default_rng(b * 100 + h * 10 + s)
    x = rng.standard_normal((b, h, t, d)).astype(np.float32).astype(DType.bfloat16.numpy)
    cells = rng.integers(0, t, (b, s, w)).astype(np.int32)
    cells[..., 0] = t - 1  # the last cell of every plane
    want = np.stack([x[i][:, cells[i, j]] for i in range(b) for j in range(s)])
    got = run(lower(graph, target), x, cells)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@requires("mlx.core", "jax")
def test_qsa_gather_lowering_choices_agree_bit_for_bit():
    """The flat [B*H*T, D] view (MLX's choice) and the one take_along_axis (JAX's) gather the same bits."""
    import dataclasses

    import jax.numpy as jnp
    import mlx.core as mx

    from attnpass.lowering.targets.jax.runtime import qsa as jax_qsa
    from attnpass.lowering.targets.mlx.runtime import qsa as mlx_qsa

    assert mlx_qsa.flat_gather and not jax_qsa.flat_gather
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 50, 4)).astype(np.float32)
    cells = rng.integers(0, 50, (2, 5, 11)).astype(np.int32)
    outs = [np.asarray(ops_.gather(xp.asarray(x), xp.asarray(cells)))
            for xp, qsa in ((mx, mlx_qsa), (jnp, jax_qsa))
            for ops_ in (qsa, dataclasses.replace(qsa, flat_gather=not qsa.flat_gather))]  # fmt: skip
    for out in outs[1:]:
        np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32))


def test_qsa_gather_shape_rule_and_the_reference_contract():
    x, cells = TensorSpec((2, 2, 16, 4)), TensorSpec((2, 3, 5), "int32")
    with pytest.raises(ShapeError, match=r"qsa_gather: x must be \[B, H, T, D\] \(rank 4\), got x=f32\[2,16,4\]"):
        trace(ops.qsa_gather, TensorSpec((2, 16, 4)), cells)
    with pytest.raises(ShapeError, match=r"qsa_gather: cells must be \[B, S, W\] with the B=1 of x=f32\[1,2,16,4\]"):
        trace(ops.qsa_gather, TensorSpec((1, 2, 16, 4)), cells)
    with pytest.raises(ShapeError, match=r"qsa_gather: cells has dtype float32"):
        trace(ops.qsa_gather, x, TensorSpec((2, 3, 5)))
    program = lower(trace(ops.qsa_gather, x, cells), "numpy")
    bad = np.zeros((2, 3, 5), np.int32)
    bad[1, 2, 4] = 16
    with pytest.raises(ValueError, match=r"qsa_gather: cell 16 is outside the cache \[0, 16\)"):
        run(program, np.zeros((2, 2, 16, 4), np.float32), bad)
