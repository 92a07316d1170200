"""qsa-gather's prefill tiling (``prefill_tile``): rows cut into tiles, each tile gathering its rows' cells.

Against the masked form it replaces, on the same target: the numpy oracle, MLX and JAX, float32 and bfloat16;
the tiling property under hypothesis (any row count, tile and positions: the same output as the masked
form); the plan stated in the applied remark; the named declines.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, make_inputs
from attnpass.passes import DeadCodeElimination, PassManager, QSAGather, default_pipeline, parse_pipeline
from attnpass.passes.analysis.devices import DEVICES
from tests.passes.rewrites.test_qsa_gather import reason_of, remark_of
from tests.util import requires

CFG = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=32, rotary_dim=8)
W = 8 * 4 + 3  # K = 32 / 4 blocks, ratio 4


def tiled(graph, tile: int, **options):
    return PassManager([QSAGather(prefill_tile=tile, **options), DeadCodeElimination()]).run(graph)


def prefill_case(rows: int, n_kv: int, *, dtype: str = "float32", batch: int = 1, seed: int = 0):
    """The masked layer over ``rows`` prompt rows ending at the cache's last cell, and its inputs."""
    cfg = QSAConfig(**{**CFG.__dict__, "dtype": dtype})
    positions = np.tile(np.arange(n_kv - rows, n_kv, dtype=np.int32), (batch, 1))
    return build_layer(cfg, n_kv, batch=batch, rows=rows), make_inputs(cfg, n_kv, positions, seed=seed)


def test_prefill_is_cut_into_tiles_with_the_plan_in_the_remark():
    masked, inputs = prefill_case(rows=20, n_kv=96)
    kept = PassManager([QSAGather()]).run(masked)  # prefill_tile=0: prefill stays masked, as before
    assert reason_of(kept) == "too_many_rows"
    result = tiled(masked, 6)
    message = remark_of(result, "applied")
    assert message.startswith("prefill tiled: 1 stream(s) x 20 rows in 4 tile(s) of 6 row(s) (prefill_tile=6")
    assert f"[B*tile, Hkv, W, D] = {6 * W} cells per stream" in message
    assert f"W={W}" in message and f"n_kv=96 -> {W} per row, FLOP ratio vs dense W/n_kv = {W / 96:.4f}" in message
    nodes = list(result.graph.nodes())
    assert "qsa_mask" not in {n.op for n in nodes}
    sdpas = [n for n in nodes if n.op == "sdpa"]
    gathers = [n for n in nodes if n.op == "qsa_gather"]
    # 3 full tiles and a last one of 2 rows; each sdpa attends W cells with one query row per batch entry
    assert [n.type.shape for n in sdpas] == [(6, 4, 1, 16)] * 3 + [(2, 4, 1, 16)]
    assert [g.type.shape for g in gathers] == [(r, 2, W, 16) for r in (6, 6, 6, 6, 6, 6, 2, 2)]
    assert all(result.graph.node(s.inputs[1]).type.shape[2] == W for s in sdpas)
    want = run(lower(masked, "numpy"), **inputs)
    np.testing.assert_allclose(run(lower(result.graph, "numpy"), **inputs), want, rtol=1e-6, atol=1e-7)


def test_a_tile_covering_every_row_is_one_gather_and_decode_is_unchanged():
    masked, inputs = prefill_case(rows=12, n_kv=96)
    result = tiled(masked, 64)
    assert sum(n.op == "sdpa" for n in result.graph.nodes()) == 1
    assert "in 1 tile(s) of 12 row(s)" in remark_of(result, "applied")
    np.testing.assert_allclose(
        run(lower(result.graph, "numpy"), **inputs), run(lower(masked, "numpy"), **inputs), rtol=1e-6, atol=1e-7
    )
    decode, _ = prefill_case(rows=1, n_kv=96)
    assert str(tiled(decode, 4).graph) == str(PassManager([QSAGather(), DeadCodeElimination()]).run(decode).graph)


MLX, JAX = requires("mlx.core"), requires("jax")


@pytest.mark.parametrize(
    "target, dtype, tol",
    [("numpy", "float32", 2e-6), pytest.param("mlx", "float32", 2e-6, marks=MLX),
     pytest.param("jax", "float32", 2e-6, marks=JAX), pytest.param("mlx", "bfloat16", 2e-2, marks=MLX),
     pytest.param("jax", "bfloat16", 2e-2, marks=JAX)],
)  # fmt: skip
@pytest.mark.parametrize("visibility", ["additive", "none"])
def test_tiled_prefill_matches_the_masked_form_on_each_target(target, dtype, tol, visibility):
    cfg = QSAConfig(**{**CFG.__dict__, "dtype": dtype})
    rows, n_kv = 19, 80
    positions = np.array([np.arange(n_kv - rows, n_kv), np.arange(30, 30 + rows)], dtype=np.int32)
    masked = build_layer(cfg, n_kv, batch=2, rows=rows, visibility=visibility)
    inputs = make_inputs(cfg, n_kv, positions, seed=4, hidden_fraction=0.1)
    result = tiled(masked, 5)
    assert "2 stream(s) x 19 rows in 4 tile(s) of 5 row(s)" in remark_of(result, "applied")
    want = run(lower(masked, target), **inputs).astype(np.float32)
    if visibility == "none":
        del inputs["mask"]  # the gathered form never reads the padded mask
    got = run(lower(result.graph, target), **inputs).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(9, 24),
    tile=st.integers(1, 30),
    n_kv=st.sampled_from([72, 88]),
    start=st.integers(0, 60),
    seed=st.integers(0, 2**16),
)
def test_any_tiling_attends_each_row_to_exactly_its_masked_cells(rows, tile, n_kv, start, seed):
    """Tiling property: whatever the tile and the row positions, every row's output is the masked form's."""
    positions = np.minimum(np.arange(start, start + rows), n_kv - 1).astype(np.int32)[None]
    cfg = CFG
    masked = build_layer(cfg, n_kv, rows=rows)
    inputs = make_inputs(cfg, n_kv, positions, seed=seed, hidden_fraction=0.2)
    result = tiled(masked, tile)
    message = remark_of(result, "applied")
    tiles = -(-rows // min(tile, rows))
    assert f"in {tiles} tile(s) of {min(tile, rows)} row(s)" in message
    assert sum(n.op == "sdpa" for n in result.graph.nodes()) == tiles
    np.testing.assert_allclose(
        run(lower(result.graph, "numpy"), **inputs), run(lower(masked, "numpy"), **inputs), rtol=1e-6, atol=1e-7
    )


def test_shallow_prefill_and_a_bool_visibility_are_declined_by_reason():
    shallow, _ = prefill_case(rows=20, n_kv=60)
    assert reason_of(tiled(shallow, 8)) == "little_gain"
    boolean = build_layer(CFG, 96, rows=20, visibility="bool")
    assert reason_of(tiled(boolean, 8)) == "rows_without_keys"


def test_prefill_tile_option_and_the_per_device_defaults():
    assert parse_pipeline("qsa-gather{prefill_tile=16}") == [QSAGather(prefill_tile=16)]
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="QSAGather: prefill_tile must be an int >= 0"):
            QSAGather(prefill_tile=bad)
    for device, facts in DEVICES.items():
        for keep in (True, False):
            (gather,) = [p for p in default_pipeline(device, keep_signature=keep) if isinstance(p, QSAGather)]
            assert gather.prefill_tile == facts.prefill_tile > 0


def test_a_selection_input_prefill_is_tiled():
    def f(q, k, v, sel, positions):
        keep = ops.qsa_mask(sel, positions, ratio=2, kv_len=24)
        return ops.sdpa(q, k, v, mask=ops.where(keep, ops.constant(0.0, "float32", like=q), -math.inf), scale=0.5)

    rows = 10
    specs = (TensorSpec((1, 2, rows, 4)), TensorSpec((1, 1, 24, 4)), TensorSpec((1, 1, 24, 4)),
             TensorSpec((1, rows, 2), "int32"), TensorSpec((1, rows), "int32"))  # fmt: skip
    graph = trace(f, *specs)
    rng = np.random.default_rng(1)
    positions = np.arange(14, 24, dtype=np.int32)[None]
    sel = np.stack([rng.permutation((p + 1) // 2)[:2] for p in positions[0]]).astype(np.int32)[None]
    args = [rng.standard_normal(s.shape).astype(np.float32) for s in specs[:3]] + [sel, positions]
    result = tiled(graph, 3, selection_input="sel", min_depth_factor=0)
    assert "distinct ids promised by the caller" in remark_of(result, "applied")
    np.testing.assert_allclose(
        run(lower(result.graph, "numpy"), *args), run(lower(graph, "numpy"), *args), rtol=1e-6, atol=1e-7
    )
