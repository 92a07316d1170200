"""The value-cutoff selection (MaxText's DSA indexer mask): recognised, equal to top_k's index set, look-alikes
declined by name, and the cellwise implication the dsa-gather route needs.

The oracle of "equal to top_k" is the put_along_axis mask of ``argtopk``'s indices, run on the same target
(numpy, MLX, JAX), and an independent numpy ranking (stable sort by descending value); scores are small integers
cast to float, so most rows have ties at the cutoff. The control: ``scores >= cutoff`` differs from top_k on such
rows, and the analysis declines it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes.analysis.cell_implication import implies_cellwise
from attnpass.passes.analysis.value_cutoff import ValueCutoff, match_value_cutoff
from attnpass.passes.infra.rewrite import Decline
from tests.util import requires, target_params

LOWEST = -0.7 * float(np.finfo(np.float32).max)  # MaxText's DEFAULT_MASK_VALUE


def cutoff_selection(s, k: int, variant: str = "exact"):
    """MaxText's ``Indexer.generate_mask`` selection over scores ``s`` ``[B, L, T]`` written with the IR's ops
    (``variant`` names a look-alike)."""
    b, rows, t = s.shape
    idx = ops.argtopk(s, k, axis=-1)
    values = ops.take_along_axis(s, idx, axis=-1)
    c = ops.slice(values, (0, 0, k - 1), (b, rows, k))
    if variant == "ge":
        return ops.greater_equal(s, c)
    above, equal = ops.less(c, s), ops.equal(s, c)
    axis = 1 if variant == "scan_axis" else 2
    a_rank = ops.scan(ops.cast(above, "int32"), "sum", axis)
    b_rank = ops.scan(ops.cast(equal, "int32"), "sum", 2)
    bound = ops.constant(np.int32(k + 1 if variant == "k_mismatch" else k))
    kept = ops.logical_and(above, ops.greater_equal(bound, a_rank))
    if variant == "no_tie":
        return kept
    count = ops.slice(a_rank, (0, 0, t - 1), (b, 1 if variant == "row_0_count" else rows, t))
    room = ops.sub(ops.constant(np.int32(k)), ops.minimum(count, ops.constant(np.int32(k))))
    if variant == "tie_bound_k":
        room = ops.constant(np.int32(k))
    return ops.logical_or(kept, ops.logical_and(equal, ops.greater_equal(room, b_rank)))


def topk_mask(s, k: int):
    """put_along_axis(False, top_k(s, k).indices, True): the mask the selection must equal."""
    idx = ops.argtopk(s, k, axis=-1)
    return ops.put_along_axis(ops.constant(np.zeros(s.shape, bool)), idx, ops.constant(True), axis=-1)


def output_node(graph):
    return graph.node(graph.outputs[0])


def numpy_topk(s: np.ndarray, k: int) -> np.ndarray:
    """The top_k index set by an independent ranking: descending value, lower index first among equals."""
    order = np.argsort(-s, axis=-1, kind="stable")[..., :k]
    out = np.zeros(s.shape, bool)
    np.put_along_axis(out, order, True, axis=-1)
    return out


@st.composite
def tied_scores(draw):
    b, rows, t = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(2, 24))
    k = draw(st.integers(1, t))
    values = draw(st.lists(st.integers(-3, 3), min_size=b * rows * t, max_size=b * rows * t))
    return np.asarray(values, np.float32).reshape(b, rows, t), k


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tied_scores())
def test_the_recognised_selection_is_top_ks_index_set_bit_for_bit(target, case):
    s, k = case
    spec = TensorSpec(s.shape)
    graph, oracle = trace(lambda x: cutoff_selection(x, k), spec), trace(lambda x: topk_mask(x, k), spec)
    found = match_value_cutoff(graph, output_node(graph))
    assert isinstance(found, ValueCutoff) and (found.top_k, found.kv_len) == (k, s.shape[-1])
    got, want = run(lower(graph, target), x=s), run(lower(oracle, target), x=s)
    assert got.dtype == want.dtype == np.bool_
    assert np.array_equal(got, want) and np.array_equal(got, numpy_topk(s, k))
    assert (got.sum(-1) == k).all()


@pytest.mark.parametrize(
    "variant, reason",
    [
        ("ge", "ties_unbounded"),  # indexer_mask_exact_topk=False: every tie at the cutoff
        ("tie_bound_k", "ties_unbounded"),  # ties kept up to K whatever the cells above took
        ("no_tie", "missing_tie_term"),
        ("scan_axis", "scan_axis"),
        ("k_mismatch", "k_mismatch"),
        ("row_0_count", "cutoff_form"),  # every row's room from row 0's count
        ("exact", None),  # the control: the form itself is recognised
    ],
)
def test_look_alikes_are_declined_by_name(variant, reason):
    graph = trace(lambda x: cutoff_selection(x, 3, variant), TensorSpec((1, 2, 10)))
    found = match_value_cutoff(graph, output_node(graph))
    if reason is None:
        assert isinstance(found, ValueCutoff) and found.top_k == 3
        return
    assert isinstance(found, Decline) and found.reason == reason, found


def test_the_declined_look_alikes_really_select_other_cells():
    """Why they are declined: on tied scores each selects other cells than top_k (the ``>=`` form more than K)."""
    s = np.array([[[2, 1, 1, 1, 0, 3, 1, 0, 0, 1]] * 2], np.float32)
    want = numpy_topk(s, 3)
    for variant in ("ge", "tie_bound_k", "no_tie"):
        graph = trace(lambda x, v=variant: cutoff_selection(x, 3, v), TensorSpec(s.shape))
        assert not np.array_equal(run(lower(graph, "numpy"), x=s), want), variant
    graph = trace(lambda x: cutoff_selection(x, 3, "ge"), TensorSpec(s.shape))
    assert (run(lower(graph, "numpy"), x=s).sum(-1) > 3).all()


def test_signed_zeros_and_nan_can_differ_from_top_k_but_never_exceed_k():
    """The docstring's item 2 needs NaN-free rows without a -0.0/+0.0 tie; item 1 (at most K cells) holds always."""
    graph = trace(lambda x: cutoff_selection(x, 1), TensorSpec((1, 2, 3)))
    s = np.array([[[-0.0, 0.0, -1.0], [np.nan, 1.0, 1.0]]], np.float32)
    got = run(lower(graph, "numpy"), x=s)
    assert not np.array_equal(got, numpy_topk(np.where(np.isnan(s), np.inf, s), 1))
    assert (got.sum(-1) <= 1).all()


def _masked(s, k: int, valid, form: str):
    """MaxText's attention mask from the selection: where(sel, 0, -0.7 max) + where(valid, 0, -0.7 max), kept
    where >= half the lowest float, split at T - 2 and concatenated (its two cache halves)."""
    sel = cutoff_selection(s, k)
    low = ops.constant(np.float32(LOWEST))
    zero = ops.constant(np.float32(0))
    add = ops.add(ops.where(sel, zero, low), ops.where(valid, zero, low))
    b, rows, t = s.shape
    if form == "or_valid":  # a look-alike: valid cells are kept even when unselected
        return ops.logical_or(sel, valid)
    if form == "truncated":  # unselected: 2.7 truncated to 2, which is < 2.5: kept
        low = ops.cast(ops.cast(ops.where(sel, zero, ops.constant(np.float32(2.7))), "int32"), "float32")
        return ops.reshape(ops.less(low, ops.constant(np.float32(2.5))), (b, 1, rows, t))
    if form == "shifted":  # the halves swapped: cell t reads the selection at another cell
        halves = [ops.slice(add, (0, 0, 2), (b, rows, t)), ops.slice(add, (0, 0, 0), (b, rows, 2))]
    else:
        halves = [ops.slice(add, (0, 0, 0), (b, rows, t - 2)), ops.slice(add, (0, 0, t - 2), (b, rows, t))]
    keep = [ops.greater_equal(h, ops.constant(np.float32(LOWEST / 2))) for h in halves]
    return ops.reshape(ops.concat(keep, axis=2), (b, rows, 1, t) if form == "rows_as_heads" else (b, 1, rows, t))


@pytest.mark.parametrize(
    "form, proven", [("halves", True), ("or_valid", False), ("shifted", False), ("truncated", False)]
)
def test_the_mask_is_proven_false_wherever_the_selection_is(form, proven):
    """MaxText's two-halves mask implies the selection cell by cell; a mask that keeps unselected valid cells, or
    reads the selection at shifted cells, is not proven. Checked on values: where the proof holds, no cell is
    true outside the selection; the unproven forms have one."""
    shape = (1, 2, 12)
    graph = trace(lambda x, v: _masked(x, 4, v, form), TensorSpec(shape), TensorSpec(shape, "bool"))
    sel = next(n.name for n in graph.nodes() if n.op == "logical_or" and n.type.shape == shape)
    found = implies_cellwise(graph, graph.outputs[0], sel)
    assert (found is None) == proven, found
    if not proven:
        assert found.reason == "mask_not_implied"
    rng = np.random.default_rng(0)
    s, valid = rng.integers(-2, 3, shape).astype(np.float32), rng.random(shape) < 0.7
    got = run(lower(graph, "numpy"), x=s, v=valid).reshape(shape)
    outside = got & ~numpy_topk(s, 4)
    assert not outside.any() if proven else outside.any()


@requires("jax")
@pytest.mark.parametrize("exact, reason", [(True, None), (False, "ties_unbounded")])
def test_maxtexts_generate_mask_as_jax_code_imports_to_the_recognised_form(exact, reason):
    """MaxText 0.2.5's ``Indexer.generate_mask`` written as it is (jnp), imported with ``from_jax``."""
    import jax
    import jax.numpy as jnp

    from attnpass.ir import from_jax

    def generate_mask(score):
        topk_values, _ = jax.lax.top_k(score, k=4)
        cutoff = topk_values[..., -1][..., None]
        if not exact:
            return jnp.where(score >= cutoff, 0.0, LOWEST)
        k = topk_values.shape[-1]
        greater, equal = score > cutoff, score == cutoff
        sg_rank = jnp.cumsum(greater.astype(jnp.int32), axis=-1)
        eq_rank = jnp.cumsum(equal.astype(jnp.int32), axis=-1)
        kept = greater & (sg_rank <= k)
        room = k - jnp.minimum(sg_rank[..., -1:], k)
        return jnp.where(kept | (equal & (eq_rank <= room)), 0.0, LOWEST)

    graph = from_jax(generate_mask, jnp.zeros((1, 3, 16), jnp.float32)).graph
    where = output_node(graph)
    found = match_value_cutoff(graph, graph.node(where.inputs[0]))
    if reason:
        assert isinstance(found, Decline) and found.reason == reason
        return
    assert isinstance(found, ValueCutoff) and found.top_k == 4
    s = np.random.default_rng(1).integers(-2, 3, (1, 3, 16)).astype(np.float32)
    assert np.array_equal(np.asarray(generate_mask(s)) == 0.0, numpy_topk(s, 4))
