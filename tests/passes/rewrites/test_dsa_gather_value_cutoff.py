"""dsa-gather over a value-cutoff selection (MaxText's DSA mask): each row attends exactly the cells its mask keeps,
gathered at ``argtopk(selection)``; a row left without a key is the masked call's mean of V; bounds as docs/mla.md.

Differential: the rewritten graph vs the masked graph on the same target (numpy, MLX, JAX) and vs float64
attention over exactly the cells the mask keeps. Scores are small integers (ties at the cutoff on most rows).
Controls: without the no-key fallback a keyless row would be the mean of its K gathered values, not of all T
(measured below to differ); a mask that keeps unselected cells is declined.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes import DeadCodeElimination, DSAGather, PassManager
from tests.fuzz.families import Case
from tests.passes.analysis.test_value_cutoff import _masked, numpy_topk
from tests.passes.claims import audit
from tests.passes.rewrites.test_mla_absorb import BOUND, relative
from tests.util import target_params

F32 = BOUND[DType.float32]


def dsa_graph(b: int, h: int, rows: int, sel_rows: int, t: int, k: int, d: int = 8, form: str = "halves"):
    """sdpa(q [b, h, rows, d], k/v [b, 1, t, d]) masked by MaxText's mask of a value-cutoff selection over scores
    [b, sel_rows, t] (sel_rows = rows: one selection per row; 1: shared by all rows, MaxText's heads as rows)."""

    def f(q, kk, v, scores, valid):
        return ops.sdpa(q, kk, v, mask=_masked(scores, k, valid, form), scale=0.3)

    kv = TensorSpec((b, 1, t, d))
    sel = (b, sel_rows, t)
    return trace(f, TensorSpec((b, h, rows, d)), kv, kv, TensorSpec(sel), TensorSpec(sel, "bool"))


def inputs(rng, graph) -> dict:
    x = {}
    for name in graph.inputs:
        ty = graph.node(name).type
        if name == "scores":
            x[name] = rng.integers(-2, 3, ty.shape).astype(np.float32)
        elif name == "valid":
            x[name] = rng.random(ty.shape) < 0.8
        else:
            x[name] = rng.standard_normal(ty.shape).astype(np.float32)
    return x


def kept_cells(x: dict, k: int) -> np.ndarray:
    """[b, sel_rows, t]: the cells the mask keeps (selected and valid)."""
    return numpy_topk(x["scores"], k) & x["valid"]


def reference(x: dict, k: int) -> np.ndarray:
    """float64 attention of each row over exactly its kept cells; a row with none: the mean of V over all T."""
    q, kk, v = (np.asarray(x[n], np.float64) for n in ("q", "kk", "v"))
    keep = kept_cells(x, k)
    b, h, rows, _d = q.shape
    out = np.empty((b, h, rows, v.shape[-1]))
    for i, r in np.ndindex(b, rows):
        cells = np.flatnonzero(keep[i, r if keep.shape[1] > 1 else 0])
        if cells.size == 0:
            out[i, :, r] = v[i, 0].mean(0)
            continue
        s = np.einsum("hd,td->ht", q[i, :, r], kk[i, 0, cells]) * 0.3
        p = np.exp(s - s.max(-1, keepdims=True))
        out[i, :, r] = (p / p.sum(-1, keepdims=True)) @ v[i, 0, cells]
    return out


def gathered(graph):
    result = PassManager([DSAGather(), DeadCodeElimination()]).run(graph)
    (r,) = [r for r in result.remarks if r.pass_name == "dsa-gather"]
    return result, r


@st.composite
def layouts(draw):
    t = draw(st.integers(6, 40))
    rows = draw(st.integers(1, 4))
    shared = draw(st.booleans()) and rows > 1
    return draw(st.integers(1, 2)), draw(st.integers(1, 3)), rows, 1 if shared else rows, t, draw(st.integers(1, t - 1))


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts(), seed=st.integers(0, 2**16))
def test_each_row_attends_exactly_the_cells_its_mask_keeps(target, layout, seed):
    b, h, rows, sel_rows, t, k = layout
    graph = dsa_graph(b, h, rows, sel_rows, t, k)
    result, r = gathered(graph)
    assert r.kind == "applied", str(r)
    assert (r.data["distinct"], r.data["keys"], r.data["top_k"]) == ("argtopk", "fallback", k)
    shared = sel_rows == 1 and rows > 1
    assert r.data["shared_cells"] == shared
    assert r.data["row_bytes"] == b * k * 2 * 8 * 4  # K and V: one KV head of 8 float32 per cell
    gathers = [n for n in result.graph.nodes() if n.op == "qsa_gather"]
    if shared:  # one set of cells per stream: gathered once, whatever the rows
        assert (r.data["tiles"], r.data["gathered_bytes"], len(gathers)) == (1, r.data["row_bytes"], 2)
        assert all(g.type.shape[0] == b for g in gathers)
    x = inputs(np.random.default_rng(seed), graph)
    if target == "numpy":  # the remark's claims recomputed from the graphs and these inputs (tests/passes/claims.py)
        assert audit(DSAGather(), [Case("value_cutoff", graph, x)], anchor="sdpa")["applied"] == 1
    want = reference(x, k)
    masked, got = run(lower(graph, target), **x), run(lower(result.graph, target), **x)
    assert relative(masked, want) < F32
    assert relative(got, want) < F32 and relative(got, masked) < F32


@pytest.mark.parametrize("sel_rows", [3, 1], ids=["per-row", "shared"])
def test_a_row_without_a_key_is_the_mean_of_all_values_as_masked(sel_rows):
    """Every cell invalid: no row has a key. Masked, each row weighs all T cells alike (the mean of V); gathered,
    the fallback gives the same. The control: the mean of only the K gathered values is measurably different."""
    graph = dsa_graph(1, 2, 3, sel_rows, 24, 5)
    result, r = gathered(graph)
    assert r.kind == "applied"
    x = inputs(np.random.default_rng(7), graph)
    x["valid"][:] = False
    masked, got = run(lower(graph, "numpy"), **x), run(lower(result.graph, "numpy"), **x)
    assert relative(got, masked) < 1e-6 and relative(masked, reference(x, 5)) < 1e-6
    cells = np.argsort(-x["scores"][0, 0], kind="stable")[:5]
    assert relative(x["v"][0, 0, cells].mean(0), masked[0, 0, 0]) > 1e-2


@pytest.mark.parametrize("target", target_params("numpy", "jax"))
def test_concatenated_caches_are_gathered_part_by_part_with_the_same_values(target):
    """K is a prefill cache and a decode cache concatenated along the keys (as raise-attention's log-sum-exp
    combine writes MaxText's two attentions), each a latent beside its rope key (concatenated along the features);
    V the latent halves. The rewrite gathers each part at its own cells: no [T, D] concat is left, and each row
    still attends exactly its kept cells (masked graph and float64 attention over those cells agree)."""
    t, n, k, d, r = 30, 26, 6, 8, 3

    def f(q, lat_a, lat_b, pe_a, pe_b, scores, valid):
        kk = ops.concat([ops.concat([lat_a, pe_a], axis=3), ops.concat([lat_b, pe_b], axis=3)], axis=2)
        v = ops.concat([lat_a, lat_b], axis=2)
        return ops.sdpa(q, kk, v, mask=_masked(scores, k, valid, "halves"), scale=0.3)

    specs = [TensorSpec((1, 2, 3, d + r)), TensorSpec((1, 1, n, d)), TensorSpec((1, 1, t - n, d)),
             TensorSpec((1, 1, n, r)), TensorSpec((1, 1, t - n, r)), TensorSpec((1, 1, t)), TensorSpec((1, 1, t), "bool")]  # fmt: skip
    graph = trace(f, *specs)
    result, r_ = gathered(graph)
    assert r_.kind == "applied"
    big = [x.name for x in result.graph.nodes() if x.op == "concat" and x.type.rank == 4 and x.type.shape[2] == t]
    assert not big, big
    x = inputs(np.random.default_rng(5), graph)
    joined = {"q": x["q"], "kk": np.concatenate([np.concatenate([x["lat_a"], x["pe_a"]], 3),
              np.concatenate([x["lat_b"], x["pe_b"]], 3)], 2), "scores": x["scores"], "valid": x["valid"]}  # fmt: skip
    joined["v"] = np.concatenate([x["lat_a"], x["lat_b"]], 2)
    assert relative(run(lower(result.graph, target), **x), run(lower(graph, target), **x)) < F32
    assert relative(run(lower(result.graph, target), **x), reference(joined, k)) < F32


@pytest.mark.parametrize(
    "form, reason",
    [("or_valid", "mask_not_implied"), ("shifted", "mask_not_implied"), ("rows_as_heads", "mask_layout")],
)
def test_a_mask_not_implied_by_the_selection_or_laid_out_per_head_is_declined(form, reason):
    """rows_as_heads: the rows' masks on sdpa's head axis (3 heads, 3 rows): head h would read row h's cells."""
    graph = dsa_graph(1, 3, 3, 3, 16, 4, form=form)
    result = DSAGather()(graph)
    (r,) = [r for r in result.remarks if r.pass_name == "dsa-gather"]
    assert (r.kind, r.reason) == ("declined", reason) and not result.changed
