"""The DSAGather pass: the rewrite, exactly the selected cells per row, tiles, every decline, the numerics.

The gather is exact in the cells attended (docs/mla.md, "Numerics"): each row's softmax runs over its K
selected cells, each once; the float64 attention over exactly those cells (:func:`selected_attention`) is what
the masked call computes up to rounding, and the rewritten graph is within :data:`BOUND` of it.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, ops, parse_graph, trace
from attnpass.lowering import lower
from attnpass.passes import DeadCodeElimination, DSAGather, MLAAbsorb, PassManager
from tests.passes.claims import audit, fuzzed
from tests.passes.rewrites.mla_graphs import Geometry, draw_geometry, lowest, mla_graph, mla_inputs
from tests.passes.rewrites.test_mla_absorb import BOUND, PROMISED, relative
from tests.util import target_params

GOLDEN_AFTER = """\
graph dsa(q:f32[1,2,2,2], latent:f32[1,1,8,4]{resident}, w_uk:f32[2,4,2]{resident}, w_uv:f32[2,2,4]{resident}, mask:f32[1,2,2,8], idx:i32[1,1,2,3]) {
  transpose:f32[2,4,2] = transpose[perm=(0, 2, 1)] w_uv
  w_uk_t:f32[2,2,4] = transpose[perm=(0, 2, 1)] w_uk
  q_latent:f32[1,2,2,4] = matmul q w_uk_t
  cells:i32[1,2,3] = reshape[shape=(1, 2, 3)] idx
  kv_gathered:f32[2,1,3,4] = qsa_gather latent cells
  transpose_1:f32[1,2,2,4] = transpose[perm=(0, 2, 1, 3)] q_latent
  q_latent_rows:f32[2,2,1,4] = reshape[shape=(2, 2, 1, 4)] transpose_1
  mask_cells:i32[1,1,2,3] = reshape[shape=(1, 1, 2, 3)] cells
  mask_gathered:f32[1,2,2,3] = take_along_axis[axis=3] mask mask_cells
  transpose_2:f32[1,2,2,3] = transpose[perm=(0, 2, 1, 3)] mask_gathered
  mask_gathered_1:f32[2,2,1,3] = reshape[shape=(2, 2, 1, 3)] transpose_2
  sdpa_gather:f32[2,2,1,4] = sdpa[scale=0.25, causal='none'] q_latent_rows kv_gathered kv_gathered mask=mask_gathered_1
  reshape:f32[1,2,2,4] = reshape[shape=(1, 2, 2, 4)] sdpa_gather
  sdpa_gather_1:f32[1,2,2,4] = transpose[perm=(0, 2, 1, 3)] reshape
  mla_out:f32[1,2,2,2] = matmul sdpa_gather_1 transpose
  return mla_out
}"""


def pipeline(*, absorb: bool = True, **options) -> list:
    gather = DSAGather(**{**PROMISED, **options})
    return ([MLAAbsorb(crossover_factor=1e6, **PROMISED)] if absorb else []) + [gather, DeadCodeElimination()]


def remark(result, kind: str):
    (r,) = [r for r in result.remarks if r.pass_name == "dsa-gather"]
    assert r.kind == kind, str(r)
    return r


def selected_attention(x: dict, g: Geometry, fill: float | None = None) -> np.ndarray:
    """float64 attention of each row over exactly its selected cells (the masked call's weights elsewhere are 0)."""
    f = {n: np.asarray(a, np.float64) for n, a in x.items() if n != "idx"}
    k = f["latent"] @ f["w_uk"]  # [B, H, T, Dn]
    v = f["latent"] @ np.swapaxes(f["w_uv"], -1, -2)
    scale = 1 / math.sqrt(g.dn) if g.scale is None else g.scale
    out = np.empty((g.b, g.h, g.rows, g.dv))
    for b, i in np.ndindex(g.b, g.rows):
        cells = x["idx"][b, 0, i]
        s = np.einsum("hd,htd->ht", f["q"][b, :, i], k[b][:, cells]) * scale + f["mask"][b, :, i][:, cells]
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b, :, i] = np.einsum("ht,htd->hd", p / p.sum(-1, keepdims=True), v[b][:, cells])
    return out


def test_golden_rewrite_gathers_the_latent_once_per_row():
    graph = mla_graph(Geometry(b=1, h=2, rows=2, t=8, r=4, dn=2, dv=2, top_k=3))
    result = PassManager(pipeline()).run(graph)
    assert str(result.graph) == GOLDEN_AFTER and parse_graph(GOLDEN_AFTER) == result.graph
    r = remark(result, "applied")
    assert (r.data["top_k"], r.data["kv_len"], r.data["gathered_arrays"], r.data["tiles"]) == (3, 8, 1, 1)
    assert "exact in the cells attended" in r.message


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_each_row_attends_exactly_its_selected_cells(absorb):
    g = Geometry(b=2, h=2, rows=5, t=40, r=16, dn=8, dv=4, top_k=7)
    graph = mla_graph(g)
    result = PassManager(pipeline(absorb=absorb)).run(graph)
    assert remark(result, "applied").data["gathered_arrays"] == (1 if absorb else 2)
    x = mla_inputs(g, 3)
    want = selected_attention(x, g)
    if absorb:  # the pipeline's output is after W_uv; compare the masked graph's too
        assert relative(run(lower(graph, "numpy"), **x), want) < 1e-6
    assert relative(run(lower(result.graph, "numpy"), **x), want) < 1e-6


@pytest.mark.parametrize("tile_bytes, tiles", [(0, 1), (1, 7), (2 * 6 * 16 * 4, 4), (10**9, 1)])
def test_rows_go_in_tiles_of_at_most_tile_bytes(tile_bytes, tiles):
    g = Geometry(b=1, h=2, rows=7, t=30, r=16, top_k=6)  # one row gathers 6 cells x 16 x 4 bytes = 384 bytes
    graph = mla_graph(g)
    result = PassManager(pipeline(tile_bytes=tile_bytes)).run(graph)
    r = remark(result, "applied")
    assert (r.data["tiles"], r.data["row_bytes"]) == (tiles, 384)
    assert sum(n.op == "qsa_gather" for n in result.graph.nodes()) == tiles
    x = mla_inputs(g, 1)
    assert relative(run(lower(result.graph, "numpy"), **x), run(lower(graph, "numpy"), **x)) < 1e-6


def test_an_argpartition_proves_the_indices_distinct_without_a_promise():
    g = Geometry(b=1, h=2, rows=3, t=20, r=8, dn=4, dv=4, top_k=None)

    def f(q, latent, w_uk, w_uv, mask, scores):
        idx = ops.slice(ops.argpartition(scores, 15, axis=-1), (0, 0, 0, 15), (1, 1, 3, 20))
        sel = ops.put_along_axis(ops.constant(np.zeros((1, 1, 3, 20), bool)), idx, ops.constant(True), axis=-1)
        k, v = ops.matmul(latent, w_uk), ops.matmul(latent, ops.transpose(w_uv, (0, 2, 1)))
        return ops.sdpa(q, k, v, mask=ops.where(sel, mask, -math.inf), scale=0.5)

    graph = trace(f, *g.specs, TensorSpec((1, 1, 3, 20)))
    result = PassManager([DSAGather(), DeadCodeElimination()]).run(graph)
    r = remark(result, "applied")
    assert (r.data["distinct"], r.data["keys"], r.data["top_k"]) == ("argpartition", "neg_inf", 5)
    x = mla_inputs(g, 2)
    x["scores"] = np.random.default_rng(0).standard_normal((1, 1, 3, 20)).astype(np.float32)
    assert relative(run(lower(result.graph, "numpy"), **x), run(lower(graph, "numpy"), **x)) < 1e-6


def _selection_graph(*, fill=None, idx_shape=None, causal=None, bool_mask=False, top_k=4, t=12, dtype=DType.float32):
    """A plain (not MLA) sdpa masked by a token selection, with the variations the declines need."""
    idx_shape = idx_shape or (1, 1, 2, top_k)

    def f(q, k, v, mask, idx):
        base = ops.constant(np.zeros((1, idx_shape[1], 2, t), bool))
        sel = ops.put_along_axis(base, idx, ops.constant(True), axis=-1)
        m = sel if bool_mask else ops.where(sel, mask, ops.constant(lowest(dtype) if fill is None else fill, dtype))
        return ops.sdpa(q, k, v, mask=m, causal=causal)

    kv = TensorSpec((1, 2, t, 8), dtype)
    return trace(f, TensorSpec((1, 2, 2, 8), dtype), kv, kv, TensorSpec((1, 2, 2, t), dtype),
                 TensorSpec(idx_shape, "int32"))  # fmt: skip


@pytest.mark.parametrize(
    "graph, options, reason",
    [
        (lambda: _selection_graph(), {}, "indices_not_distinct"),  # idx is not promised
        (lambda: _selection_graph(), {"selection_input": "idx"}, "rows_without_keys"),  # finite fill, no promise
        (lambda: _selection_graph(fill=-1e4), PROMISED, "mask_form"),  # above finfo.min: not exactly 0
        (lambda: _selection_graph(causal="bottom_right"), PROMISED, "unsupported_variant"),
        (lambda: _selection_graph(idx_shape=(1, 2, 2, 4)), PROMISED, "mask_layout"),  # one selection per head
        (lambda: _selection_graph(top_k=12), PROMISED, "little_gain"),  # K = T
        (lambda: trace(lambda q, k, v: ops.sdpa(q, k, v), *[TensorSpec((1, 2, 2, 8))] * 3), {}, "mask_not_selection"),
        (lambda: _selection_graph(), PROMISED, None),  # the controls: these apply
        (lambda: _selection_graph(fill=-math.inf), {"selection_input": "idx"}, None),  # -inf: no promise needed
        (lambda: _selection_graph(bool_mask=True), {"selection_input": "idx"}, None),
        (lambda: _selection_graph(dtype=DType.bfloat16), PROMISED, None),
    ],
)
def test_each_precondition_declines_with_its_reason(graph, options, reason):
    g = graph()
    result = DSAGather(**options)(g)
    if reason is None:
        remark(result, "applied")
        return
    assert remark(result, "declined").reason == reason
    assert not result.changed and result.graph == g


def _cells_graph(*, other=False, t=16, top_k=8):
    """sdpa masked by where(sel, cells, other): bool cells kept where a head-shared selection keeps them."""

    def f(q, k, v, cells, idx):
        sel = ops.put_along_axis(ops.constant(np.zeros((1, 1, 3, t), bool)), idx, ops.constant(True), axis=-1)
        return ops.sdpa(q, k, v, mask=ops.where(sel, cells, ops.constant(other)), scale=0.5)

    kv = TensorSpec((1, 1, t, 8))
    specs = (TensorSpec((1, 2, 3, 8)), kv, kv, TensorSpec((1, 1, 3, t), "bool"), TensorSpec((1, 1, 3, top_k), "int32"))
    return trace(f, *specs)


def test_bool_cells_kept_where_selected_gather_exactly_those_cells():
    """A block selection widened to its tokens: each row's selected cells, of which its bool cells attend;
    unselected True cells weigh nothing on either path. The control: a row whose selected cells are all False
    attends no key, the mean of all T values masked but of its K gathered, which is why the form needs the
    rows_have_keys promise."""
    rng = np.random.default_rng(3)
    graph = _cells_graph()
    result = PassManager([DSAGather(**PROMISED), DeadCodeElimination()]).run(graph)
    r = remark(result, "applied")
    assert (r.data["form"], r.data["keys"], r.data["top_k"]) == ("bool_where", "promised", 8)
    assert "where(selection, cells, False)" in r.message
    idx = np.stack([rng.permutation(16)[:8] for _ in range(3)]).astype(np.int32)[None, None]
    cells = rng.random((1, 1, 3, 16)) < 0.5
    cells[0, 0, :, idx[0, 0, :, 0]] = True  # every row has a key
    x = {"q": rng.standard_normal((1, 2, 3, 8)), "k": rng.standard_normal((1, 1, 16, 8))}
    x = {**x, "v": rng.standard_normal((1, 1, 16, 8)), "cells": cells, "idx": idx}
    x = {n: a.astype(np.float32) if a.dtype == np.float64 else a for n, a in x.items()}
    assert relative(run(lower(result.graph, "numpy"), **x), run(lower(graph, "numpy"), **x)) < 1e-6
    x["cells"][0, 0, 1, idx[0, 0, 1]] = False  # row 1: no selected cell attends
    got, want = run(lower(result.graph, "numpy"), **x), run(lower(graph, "numpy"), **x)
    assert relative(got[:, :, 1], want[:, :, 1]) > 1e-3


@pytest.mark.parametrize("other, options, reason", [(True, PROMISED, "mask_form"), (False, {"selection_input": "idx"},
                         "rows_without_keys")])  # fmt: skip
def test_bool_cells_decline_without_a_false_fill_or_the_keys_promise(other, options, reason):
    graph = _cells_graph(other=other)
    result = DSAGather(**options)(graph)
    assert remark(result, "declined").reason == reason and not result.changed and result.graph == graph


def test_rows_whose_selected_cells_are_all_hidden_match_with_a_neg_inf_fill():
    """Masked: the unselected cells are -inf, so such a row softmaxes over its selected (finfo.min) cells; the
    gather sees the same cells. (With a finfo.min fill it would weigh all T cells: rows_without_keys.)"""
    g = Geometry(b=1, h=2, rows=3, t=16, r=8, dn=4, dv=4, top_k=4)
    graph = mla_graph(g, fill=-math.inf)
    x = mla_inputs(g, 4, offset=0)
    x["idx"][0, 0, 0] = [12, 13, 14, 15]  # row 0 (position 0) sees cell 0 only: none of these
    result = PassManager(pipeline(absorb=False, selection_input="idx")).run(graph)
    assert remark(result, "applied").data["keys"] == "neg_inf"
    assert relative(run(lower(result.graph, "numpy"), **x), run(lower(graph, "numpy"), **x)) < 1e-6


def test_sinks_and_softcap_are_carried():
    def f(q, k, v, mask, idx, sinks):
        sel = ops.put_along_axis(ops.constant(np.zeros((1, 1, 3, 16), bool)), idx, ops.constant(True), axis=-1)
        m = ops.where(sel, mask, -math.inf)
        return ops.sdpa(q, k, v, mask=m, sinks=sinks, logit_softcap=3.0, scale=0.4)

    kv = TensorSpec((1, 2, 16, 8))
    specs = (TensorSpec((1, 4, 3, 8)), kv, kv, TensorSpec((1, 1, 3, 16)), TensorSpec((1, 1, 3, 5), "int32"),
             TensorSpec((4,)))  # fmt: skip
    graph = trace(f, *specs)
    result = PassManager([DSAGather(selection_input="idx"), DeadCodeElimination()]).run(graph)
    remark(result, "applied")
    rng = np.random.default_rng(5)
    x = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in zip(graph.inputs, graph.input_types())}
    x["idx"] = np.stack([rng.permutation(16)[:5] for _ in range(3)]).reshape(1, 1, 3, 5).astype(np.int32)
    assert relative(run(lower(result.graph, "numpy"), **x), run(lower(graph, "numpy"), **x)) < 1e-6


@pytest.mark.parametrize("value", ["0", "off"])
def test_environment_switch_turns_it_off(monkeypatch, value):
    monkeypatch.setenv("ATTNPASS_DSA_GATHER", value)
    graph = mla_graph(Geometry())
    r = remark(PassManager(pipeline(absorb=False)).run(graph), "declined")
    assert r.reason == "disabled" and f"ATTNPASS_DSA_GATHER={value}" in r.message
    assert os.environ["ATTNPASS_DSA_GATHER"] == value
    remark(PassManager(pipeline(absorb=False, enabled=True)).run(graph), "applied")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tile_bytes": -1}, r"tile_bytes must be an int >= 0 \(0 gathers all rows at once\), got -1"),
        ({"tile_bytes": 2.0}, r"tile_bytes must be an int >= 0 \(0 gathers all rows at once\), got 2.0"),
        ({"selection_input": ""}, "selection_input must be a graph input's name or None, got ''"),
        ({"rows_have_keys": "yes"}, "rows_have_keys must be True or False, got 'yes'"),
    ],
)
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=f"^DSAGather: {message}"):
        DSAGather(**options)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.short)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_gathered_agrees_with_the_selected_cells_within_the_bound(target, dtype, data):
    g = draw_geometry(data, dtype, rows=(2, 9), t=[12, 24, 40], top_k=lambda t: st.integers(1, t - 1))
    absorb = data.draw(st.booleans(), "absorb")
    tile_bytes = data.draw(st.sampled_from([0, 1, 4096]), "tile_bytes")
    graph = mla_graph(g)
    result = PassManager(pipeline(absorb=absorb, tile_bytes=tile_bytes)).run(graph)
    remark(result, "applied")
    offset = data.draw(st.sampled_from([None, 0]), "offset")  # 0: the first rows see fewer than K cells
    x = mla_inputs(g, data.draw(st.integers(0, 99), "seed"), offset=offset)
    gathered = run(lower(result.graph, target), **x)
    assert relative(gathered, selected_attention(x, g)) <= BOUND[dtype]
    assert relative(gathered, run(lower(graph, target), **x)) <= BOUND[dtype]


def test_remark_claims_hold_on_the_fuzzed_family():
    cases = fuzzed(("mla",), 60)
    counts = audit(DSAGather(**PROMISED), cases, anchor="sdpa")
    counts += audit(DSAGather(tile_bytes=1, **PROMISED), cases, before=lambda g: MLAAbsorb(**PROMISED)(g).graph,
                    anchor="sdpa")  # fmt: skip
    assert counts["checked"] > 20 and counts["applied"] and counts["declined"]
