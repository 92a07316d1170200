"""The multi-row gather: one qsa_gather of every row's cells, one attention, exact against the masked form.

Small model (K = 8 blocks of ratio 4, W = 35), 2 streams of up to 8 consecutive verify rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import assert_primitive_counts, run
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, make_inputs, narrowed_inputs
from attnpass.passes import DeadCodeElimination, NarrowInputs, PassManager, QSAGather
from tests.util import assert_close, requires, target_params

SMALL = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=8, rotary_dim=8)
N_KV, W, BATCH = 96, 35, 2


def rewrite(graph, **options):
    return PassManager([QSAGather(**options), DeadCodeElimination(), NarrowInputs(), DeadCodeElimination()]).run(graph)


def verify_positions(rows: int) -> np.ndarray:
    """Consecutive rows per stream: one at the end of the cache, one mid-block in the middle."""
    return np.stack([np.arange(N_KV - rows, N_KV), np.arange(50, 50 + rows)]).astype(np.int32)


@requires("mlx.core", "jax")
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_each_row_gathers_exactly_its_own_masked_cells(rows):
    """K holds its own coordinates, so the gathered K says which cells every (stream, row, head) attends."""
    masked = build_layer(SMALL, N_KV, batch=BATCH, rows=rows, visibility="none")
    graph = QSAGather()(masked).graph  # the masked path's qsa_mask is still there
    graph.set_outputs(["k_gathered", "cell_ok", "qsa_mask"])
    graph = DeadCodeElimination()(graph).graph
    inputs = make_inputs(SMALL, N_KV, verify_positions(rows), seed=rows)
    b, h, c = np.meshgrid(np.arange(BATCH), np.arange(2), np.arange(N_KV), indexing="ij")
    inputs["k_cache"] = np.broadcast_to((b * 10_000 + h * 1_000 + c)[..., None], (BATCH, 2, N_KV, 16)).astype(
        np.float32
    )
    for target in ("numpy", "mlx", "jax"):
        k, ok, keep = run(lower(graph, target), **narrowed_inputs(graph, inputs))
        k, ok = k.reshape(BATCH, rows, 2, W, 16)[..., 0], ok.reshape(BATCH, rows, W)
        for i in range(BATCH):
            for s in range(rows):
                for head in range(2):
                    cells = k[i, s, head][ok[i, s]].astype(int)
                    assert (cells // 10_000 == i).all() and (cells // 1_000 % 10 == head).all()
                    np.testing.assert_array_equal(np.sort(cells % 1_000), np.flatnonzero(keep[i, 0, s]))


@pytest.mark.parametrize("visibility", ["additive", "none"])
@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_verify_step_agrees_with_masked(target, visibility):
    rows = 5
    masked = build_layer(SMALL, N_KV, batch=BATCH, rows=rows, visibility=visibility)
    gathered = rewrite(masked).graph
    assert [n.op for n in gathered.nodes()].count("sdpa") == 1
    assert [n.op for n in gathered.nodes()].count("qsa_gather") == 2
    inputs = make_inputs(SMALL, N_KV, verify_positions(rows), seed=11, hidden_fraction=0.15)
    want = run(lower(masked, "numpy"), **inputs)
    assert_close(run(lower(gathered, target), **narrowed_inputs(gathered, inputs)), want)


def test_bool_visibility_keeps_the_masked_path():
    """logical_and(qsa_mask, vis): a row vis hides completely is the mean of V over n_kv cells, not gatherable."""
    masked = build_layer(SMALL, N_KV, batch=BATCH, rows=5, visibility="bool")
    result = QSAGather()(masked)
    (remark,) = [r for r in result.remarks if r.pass_name == "qsa-gather"]
    assert (remark.kind, remark.reason) == ("declined", "rows_without_keys")
    assert not result.changed and result.graph == masked


@requires("mlx.core", "jax")
def test_per_head_visibility_is_gathered_per_head():
    def step(q, k, v, scores, positions, vis):
        sel = ops.qsa_select(scores, positions, ratio=2, top_k_blocks=2)
        keep = ops.qsa_mask(sel, positions, ratio=2, kv_len=12)
        return ops.sdpa(q, k, v, mask=ops.where(keep, vis, -np.inf))

    specs = (
        TensorSpec((2, 4, 3, 8)), TensorSpec((2, 2, 12, 8), role="resident"), TensorSpec((2, 2, 12, 8), role="resident"),
        TensorSpec((2, 3, 6)), TensorSpec((2, 3), "int32"), TensorSpec((2, 4, 3, 12)),
    )  # fmt: skip
    g = trace(step, *specs)
    result = QSAGather(min_depth_factor=0)(g)
    (applied,) = [r.message for r in result.applied()]
    assert "one qsa_gather each of K and V [B*S, Hkv, W, D] and one sdpa over 6 row(s)" in applied
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(s.shape).astype(np.float32) for s in specs[:4]]
    positions = np.array([[7, 8, 9], [9, 10, 11]], np.int32)
    seen = rng.random((2, 4, 3, 12)) < 0.6
    seen[np.arange(2)[:, None, None], :, np.arange(3)[None, :, None], positions[..., None]] = (
        True  # tokens see themselves
    )
    vis = np.where(seen, 0.0, -np.inf).astype(np.float32)  # additive, per query head
    want = run(lower(g, "numpy"), *args, positions, vis)
    assert np.isfinite(want).all()
    for target in ("numpy", "mlx", "jax"):
        assert_close(run(lower(result.graph, target), *args, positions, vis), want)


@requires("mlx.core", "jax")
def test_one_gather_per_cache_and_one_softmax_read_from_the_backends():
    rows = 5
    masked = build_layer(SMALL, N_KV, batch=BATCH, rows=rows)
    inputs = make_inputs(SMALL, N_KV, verify_positions(rows), seed=2)
    graph = rewrite(masked).graph
    args = narrowed_inputs(graph, inputs)
    # MLX: K and V by one flat Gather each, the visibility row by one GatherAxis (take_along_axis)
    assert_primitive_counts(lower(graph, "mlx"), {"Softmax": 1, "GatherAxis": 1}, **args)
    assert_primitive_counts(lower(graph, "jax"), {"exp": 1}, **args)
    from attnpass.lowering.targets.mlx import primitives

    gathers = [p for p in primitives(lower(graph, "mlx"), **narrowed_inputs(graph, inputs)) if p.name == "Gather"]
    kv = [p.outputs[0][0] for p in gathers if p.inputs[0][0] == (BATCH * 2 * N_KV, 16)]
    assert kv == [(BATCH, rows, 2, W, 1, 16)] * 2  # K once and V once: [B, S, Hkv, W, (1,) D]
