"""block-sparse (issue 23): a structured-mask sdpa as per-tile calls over only the keys each tile sees.

Differential: the rewritten graph against the unrewritten one on the same target (raw bits on the numpy
reference and MLX, where the remark's "summation order only" is measured to be no difference; within rounding
on JAX, whose XLA sums over fewer keys associate differently) and against the float64 reference. The tile plan
is checked by a property test: every visible (query, key) pair is covered exactly once with the dense call's
visibility, and no tile's first or last key column is hidden from all its rows.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.ir.dialects.attention import Window, key_ranges
from attnpass.lowering import lower
from attnpass.passes import BlockSparse, PassManager, parse_pipeline
from attnpass.passes.analysis.devices import DEVICES
from attnpass.passes.rewrites.block_sparse import tile_plan
from tests.util import assert_bits_equal, assert_close, random_array, requires, target_params

F32, BF16 = DType.float32, DType.bfloat16
HQ, HKV, D = 4, 2, 16


def case(dtype, s, t, causal, window, mask=None, sinks=False, seed=0):
    rng = np.random.default_rng(seed)
    xs = [random_array(rng, (1, HQ, s, D), dtype, low=-3, high=3), random_array(rng, (1, HKV, t, D), dtype),
          random_array(rng, (1, HKV, t, D), dtype)]  # fmt: skip
    if mask == "additive":
        xs.append(random_array(rng, (1, HQ, s, t), dtype))
    elif mask == "additive_rows":  # broadcast over the keys
        xs.append(random_array(rng, (s, 1), dtype))
    elif mask == "bool":
        xs.append(rng.random((s, t)) < 0.7)
    if sinks:
        xs.append(random_array(rng, (HQ,), dtype))

    def call(q, k, v, rest):
        m = rest[0] if mask else None
        return ops.sdpa(q, k, v, mask=m, sinks=rest[-1] if sinks else None, causal=causal, window=window)

    fn = {3: lambda q, k, v: call(q, k, v, ()), 4: lambda q, k, v, a: call(q, k, v, (a,)),
          5: lambda q, k, v, a, b: call(q, k, v, (a, b))}[len(xs)]  # fmt: skip

    specs = [TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs]
    return trace(fn, *specs, name="attention"), xs


CASES = [  # (S, T, causal, window, mask, sinks)
    (40, 40, "bottom_right", None, None, False),  # causal
    (40, 40, "bottom_right", (7, None, None), None, False),  # sliding window
    (24, 56, "bottom_right", (9, None, None), "additive", False),  # q_len < k_len: the last 24 positions
    (40, 40, "top_left", (None, None, 12), None, False),  # llama4 chunks, cut at every chunk start
    (30, 45, "top_left", (6, None, 16), "additive_rows", True),  # window and chunk, sinks, a mask over rows
    (40, 40, "bottom_right", (5, None, None), "bool", True),  # a bool mask with sinks: an empty row is 0 both ways
]
IDS = [f"S{s}T{t}-{c}-{w}-{m}{'-sinks' if k else ''}" for s, t, c, w, m, k in CASES]


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("s, t, causal, window, mask, sinks", CASES, ids=IDS)
def test_tiles_equal_the_dense_call(s, t, causal, window, mask, sinks, dtype, target):
    graph, xs = case(dtype, s, t, causal, window, mask, sinks)
    result = BlockSparse(block_q=8, enabled=True)(graph)
    (applied,) = result.applied()
    assert sum(n.op == "sdpa" for n in result.graph.nodes()) > 1
    dense, tiled = run(lower(graph, target), *xs), run(lower(result.graph, target), *xs)
    if target == "jax":
        assert_close(tiled, dense)
    else:
        assert_bits_equal(tiled, dense)
    assert_close(tiled, run(lower(graph, "numpy"), *xs))


def tiles_of(result) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) of each tile, read from the rewritten graph's slices."""
    out = []
    for n in result.graph.nodes():
        if n.op == "sdpa":
            q, k = (result.graph.node(i) for i in n.inputs[:2])
            qs = (q.attrs["start"][2], q.attrs["stop"][2]) if q.op == "slice" else (0, q.type.shape[2])
            ks = (k.attrs["start"][2], k.attrs["stop"][2]) if k.op == "slice" else (0, k.type.shape[2])
            out.append(qs + ks)
    return out


def test_the_remark_states_the_plan_the_graph_has():
    s, t = 40, 40
    graph, _ = case(F32, s, t, "bottom_right", (7, None, None))
    result = BlockSparse(block_q=8, enabled=True)(graph)
    (remark,) = result.applied()
    spans = [tuple(map(int, m)) for m in re.findall(r"(\d+):(\d+)->(\d+):(\d+)", remark.message)]
    assert spans == tiles_of(result)
    visited = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in spans)
    assert f"visit {visited} of {s * t} (q, k) pairs (FLOP ratio {s * t / visited:.2f})" in remark.message
    assert "block_q 8 (given)" in remark.message
    windows = [n.attrs["window"] for n in result.graph.nodes() if n.op == "sdpa"]
    stated = re.findall(r"\d+:\d+->\d+:\d+(?: w(\d+))?", remark.message)
    assert [w and w.left for w in windows] == [int(w) if w else None for w in stated]


def test_the_device_plan_gives_block_q():
    graph, _ = case(F32, 1100, 1100, "bottom_right", (100, None, None))
    (remark,) = BlockSparse(enabled=True)(graph).applied()
    assert remark.message.startswith("block_q 512 (the cpu plan); 3 tiles")
    assert (remark.data["block_q"], remark.data["tiles"]) == (DEVICES["cpu"].block_q, 3)


@settings(max_examples=300, deadline=None)
@given(
    s=st.integers(1, 40),
    extra=st.integers(0, 20),
    causal=st.sampled_from(["top_left", "bottom_right"]),
    left=st.none() | st.integers(1, 30),
    chunk=st.none() | st.integers(1, 25),
    block_q=st.integers(1, 16),
)
def test_the_tile_plan_covers_every_visible_pair_once(s, extra, causal, left, chunk, block_q):
    t = s + extra
    window = None if left is None and chunk is None else Window(left, None, chunk)
    lo, hi = key_ranges(s, t, causal, window)
    dense = (np.arange(t)[None, :] >= lo[:, None]) & (np.arange(t)[None, :] < hi[:, None])
    covered = np.zeros((s, t), int)
    tiles = tile_plan(s, t, causal, window, block_q)
    assert [q0 for q0, *_ in tiles] == sorted({q0 for q0, *_ in tiles}) and tiles[0].q0 == 0 and tiles[-1].q1 == s
    assert all(a.q1 == b.q0 for a, b in zip(tiles, tiles[1:]))  # the tiles partition the rows, in order
    for q0, q1, k0, k1, tile_window in tiles:
        assert q1 - q0 <= block_q
        tlo, thi = key_ranges(q1 - q0, k1 - k0, "bottom_right", tile_window)  # the tile's own visibility
        seen = (np.arange(k1 - k0)[None, :] >= tlo[:, None]) & (np.arange(k1 - k0)[None, :] < thi[:, None])
        np.testing.assert_array_equal(seen, dense[q0:q1, k0:k1])  # the dense call's visibility, exactly
        assert seen[:, 0].any() and seen[:, -1].any()  # no leading or trailing key column the tile cannot see
        covered[q0:q1, k0:k1] += seen
    np.testing.assert_array_equal(covered, dense.astype(int))  # every visible pair once, no hidden one


@pytest.mark.parametrize(
    "s, t, causal, window, mask, sinks, reason",
    [
        (40, 40, "none", None, None, False, "no_structured_mask"),
        (40, 40, "none", (4, 2, None), None, False, "no_structured_mask"),
        (40, 30, "bottom_right", None, None, False, "rows_without_keys"),
        (8, 40, "bottom_right", None, None, False, "too_few_rows"),
        (40, 40, "bottom_right", None, "bool", False, "rows_without_keys"),
        (16, 400, "bottom_right", None, None, False, "little_gain"),
    ],
)
def test_declines_by_reason(s, t, causal, window, mask, sinks, reason):
    graph, _ = case(F32, s, t, causal, window, mask, sinks)
    result = BlockSparse(block_q=8, enabled=True)(graph)
    assert not result.changed
    (remark,) = result.declined()
    (sdpa,) = [n.name for n in graph.nodes() if n.op == "sdpa"]
    assert (remark.node, remark.rule, remark.reason) == (sdpa, "block-sparse", reason)
    if reason == "little_gain":
        assert "FLOP ratio 1.01 < 1.2" in remark.message  # the ratio the plan reached and the bound it missed


def test_switched_off_by_its_variable(monkeypatch):
    graph, _ = case(F32, 40, 40, "bottom_right", None)
    monkeypatch.setenv("ATTNPASS_BLOCK_SPARSE", "off")
    result = BlockSparse(block_q=8)(graph)
    assert not result.changed and result.declined()[0].reason == "disabled"
    assert "ATTNPASS_BLOCK_SPARSE" in result.declined()[0].message  # it names the switch


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_composes_with_head_chunk_and_decompose_sdpa(target):
    graph, xs = case(F32, 16, 16, "bottom_right", (5, None, None), "additive")
    pipeline = parse_pipeline("block-sparse{block_q=2},head-chunk{budget=2},decompose-sdpa")
    result = PassManager(pipeline).run(graph)
    names = {r.pass_name for r in result.applied()}
    assert {"block-sparse", "head-chunk"} <= names
    assert any(r.reason == "unsupported_variant" for r in result.declined() if r.pass_name == "decompose-sdpa")
    assert_close(run(lower(result.graph, target), *xs), run(lower(graph, "numpy"), *xs))


def test_other_passes_decline_a_window_by_name():
    graph, _ = case(F32, 40, 40, "none", (4, 2, None))
    graph.set_mesh({"model": 2})
    for text in ("split-kv{shards=2}", "decompose-sdpa", "qsa-gather{enabled=true}", "shard-attention{heads=model}"):
        result = PassManager(parse_pipeline(text)).run(graph)
        assert not result.changed and [r.reason for r in result.declined()] == ["unsupported_variant"], result.remarks
        assert "window=(4, 2, None)" in result.declined()[0].message  # the remark names the window


@requires("jax")
def test_the_benchmarks_quick_run_reports_each_mask(capsys):
    """benchmarks/block_sparse.py --quick on JAX (seconds): one row per mask and dtype, the plan's FLOP ratio."""
    bench = runpy.run_path(str(Path(__file__).resolve().parents[3] / "benchmarks" / "block_sparse.py"))
    bench["main"](["--quick", "--reps", "1", "--backends", "jax"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] in (["window"], ["causal"], ["chunked"])]
    wanted = [(m, d) for m in ("window", "causal", "chunked") for d in ("float32", "bfloat16")]
    assert [(r[0], r[3]) for r in rows] == wanted
    for r in rows:
        dense, sparse, speedup, ratio = (float(x) for x in (r[5], r[6], r[7], r[8]))
        assert dense > 0 and sparse > 0 and ratio > 1.2
        assert r[11] == "same" or float(r[11]) < (2e-2 if r[3] == "bfloat16" else 1e-5)
