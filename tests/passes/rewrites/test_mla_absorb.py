"""The MLAAbsorb pass: the rewrite, its cost model and crossover, every decline, and the numerics bound.

The bound (docs/mla.md, "Numerics"): relative to the output's magnitude, the absorbed form lowered to MLX
or JAX is within :data:`BOUND` of the numpy reference of the expanded form, and of the expanded form on the
same target, in float32 and bfloat16.
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
from attnpass.passes import DeadCodeElimination, MLAAbsorb, PassManager, mla_crossover, mla_flops
from tests.passes.claims import audit, fuzzed
from tests.passes.rewrites.mla_graphs import Geometry, draw_geometry, mla_graph, mla_inputs
from tests.util import target_params

BOUND = {DType.float32: 1e-5, DType.bfloat16: 4e-2}  # max |diff| / max |reference|; docs/mla.md, "Numerics"
PROMISED = {"selection_input": "idx", "rows_have_keys": True}

GOLDEN_AFTER = """\
graph mla(q:f32[1,2,2,2], latent:f32[1,1,8,4]{resident}, w_uk:f32[2,4,2]{resident}, w_uv:f32[2,2,4]{resident}, mask:f32[1,2,2,8]) {
  transpose:f32[2,4,2] = transpose[perm=(0, 2, 1)] w_uv
  w_uk_t:f32[2,2,4] = transpose[perm=(0, 2, 1)] w_uk
  q_latent:f32[1,2,2,4] = matmul q w_uk_t
  sdpa_latent:f32[1,2,2,4] = sdpa[scale=0.25, causal='none'] q_latent latent latent mask=mask
  mla_out:f32[1,2,2,2] = matmul sdpa_latent transpose
  return mla_out
}"""


def absorb(graph, **options):
    return PassManager([MLAAbsorb(**options), DeadCodeElimination()]).run(graph)


def remark(result, kind: str):
    (r,) = [r for r in result.remarks if r.pass_name == "mla-absorb"]
    assert r.kind == kind, str(r)
    return r


def relative(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))


def test_golden_rewrite_attends_in_the_latent_space():
    result = absorb(mla_graph(Geometry(b=1, h=2, rows=2, t=8, r=4, dn=2, dv=2, top_k=None)))
    assert str(result.graph) == GOLDEN_AFTER and parse_graph(GOLDEN_AFTER) == result.graph
    r = remark(result, "applied")
    assert r.data["rows"] == 2 and r.data["crossover"] == pytest.approx(8 * 4 * 4 / (8 * 4 + 16))
    assert "not bit-exact" in r.message


def test_the_flop_model_and_deepseek_crossovers():
    # absorbed H·L·T_eff·2R + H·L·R·(Dn+Dv); expanded H·T·R·(Dn+Dv) + H·L·T_eff·(Dn+Dv)
    assert mla_flops(2, 3, 10, 4, 8, 2, 6) == (3 * 2 * 4 * 16 + 3 * 2 * 8 * 8, 3 * 10 * 8 * 8 + 3 * 2 * 4 * 8)
    assert mla_crossover(10**9, 10**9, 512, 128, 128) == pytest.approx(512 * 256 / 768, rel=1e-6)  # ~170.7 rows
    dsa = mla_crossover(32768, 2048, 512, 128, 128)  # T = 32K, top-k 2048: absorbed wins up to ~2520 rows
    assert 2500 < dsa < 2540
    assert mla_crossover(1000, 1000, 64, 128, 128) == math.inf  # 2R < Dn + Dv and long rows: absorbed always wins
    for rows in (1, 170, 171, 400):  # the crossover is where the two counts meet
        absorbed, expanded = mla_flops(rows, 4, 4096, 4096, 512, 128, 128)
        assert (absorbed < expanded) == (rows < mla_crossover(4096, 4096, 512, 128, 128))


SMALL = Geometry(h=2, t=64, r=16, dn=8, dv=8, top_k=None)  # crossover 64·16·16 / (64·16 + 256) = 12.8 rows


@pytest.mark.parametrize("rows, factor, applies", [(12, 1.0, True), (13, 1.0, False), (6, 0.5, True), (7, 0.5, False)])
def test_rows_below_the_device_crossover_are_absorbed(rows, factor, applies):
    graph = mla_graph(Geometry(h=2, rows=rows, t=64, r=16, dn=8, dv=8, top_k=None))
    result = absorb(graph, crossover_factor=factor)
    r = remark(result, "applied" if applies else "declined")
    assert r.data["crossover_model"] == pytest.approx(12.8) and r.data["crossover"] == pytest.approx(12.8 * factor)
    if not applies:
        assert r.reason == "little_gain" and result.graph == graph
        assert f"{rows} query rows >= crossover {12.8 * factor:.1f}" in r.message


def test_a_token_selection_counts_k_cells_only_where_dsa_gather_takes_it():
    graph = mla_graph(Geometry(h=2, rows=20, t=64, r=16, dn=8, dv=8, top_k=8))
    kept = remark(absorb(graph), "declined")  # no promises: dsa-gather keeps the masked form, T_eff = T
    assert (kept.reason, kept.data["attended"], kept.data["selection"]) == ("little_gain", 64, False)
    applied = remark(absorb(graph, **PROMISED), "applied")  # crossover 64·256 / (8·16 + 256) = 42.7
    assert (applied.data["attended"], applied.data["selection"]) == (8, True)
    assert applied.data["crossover"] == pytest.approx(64 * 256 / 384)


def _latent_pair(k_source, v_source, *, extra_output=False, spec_b=1):
    """sdpa over k = k_source(latent, w) @ w_uk and v likewise; optionally k is also a graph output."""

    def f(q, latent, other, w_uk, w_uv):
        k = ops.matmul(k_source(latent, other), w_uk)
        v = ops.matmul(v_source(latent, other), ops.transpose(w_uv, (0, 2, 1)))
        out = ops.sdpa(q, k, v, scale=0.5)
        return (out, k) if extra_output else out

    latent = TensorSpec((spec_b, 1, 16, 8))
    return trace(f, TensorSpec((2, 2, 2, 4)), latent, latent, TensorSpec((2, 8, 4)), TensorSpec((2, 4, 8)))


def _shared_rank2_latent():
    """A latent ``[T, R]`` under per-batch weights ``[B, H, R, D]``: K is right, the latent is no sdpa operand."""

    def f(q, latent, w_uk, w_uv):
        return ops.sdpa(q, ops.matmul(latent, w_uk), ops.matmul(latent, w_uv))

    w = TensorSpec((2, 2, 8, 4))
    return trace(f, TensorSpec((2, 2, 2, 4)), TensorSpec((16, 8)), w, w)


@pytest.mark.parametrize(
    "graph, reason",
    [
        (lambda: trace(lambda q, k, v: ops.sdpa(q, k, v), *[TensorSpec((1, 2, 2, 4))] * 3), "not_latent"),
        (lambda: _latent_pair(lambda c, o: c, lambda c, o: o, spec_b=2), "not_latent"),
        (lambda: _latent_pair(lambda c, o: c, lambda c, o: c, extra_output=True, spec_b=2), "other_readers"),
        (lambda: _shared_rank2_latent(), "shape_mismatch"),
        (lambda: _latent_pair(lambda c, o: c, lambda c, o: c, spec_b=2), None),  # the control
    ],
)
def test_each_precondition_declines_with_its_reason(graph, reason):
    g = graph()
    result = MLAAbsorb(crossover_factor=100.0)(g)
    if reason is None:
        remark(result, "applied")
        return
    assert remark(result, "declined").reason == reason
    assert not result.changed and result.graph == g


def test_a_latent_broadcast_to_the_heads_is_attended_as_one_head():
    def f(q, latent, w_uk, w_uv):
        c = ops.broadcast_to(latent, (1, 2, 16, 8))
        return ops.sdpa(q, ops.matmul(c, w_uk), ops.matmul(c, ops.transpose(w_uv, (0, 2, 1))))

    graph = trace(f, TensorSpec((1, 2, 2, 4)), TensorSpec((1, 1, 16, 8)), TensorSpec((2, 8, 4)), TensorSpec((2, 4, 8)))
    result = absorb(graph)
    (sdpa,) = [n for n in result.graph.nodes() if n.op == "sdpa"]
    assert sdpa.inputs[1] == sdpa.inputs[2] == "latent" and sdpa.attrs["scale"] == 0.5  # None was 1/sqrt(Dn)
    xs = {n: np.random.default_rng(1).standard_normal(t.shape).astype(np.float32)
          for n, t in zip(graph.inputs, graph.input_types())}  # fmt: skip
    np.testing.assert_allclose(run(lower(result.graph, "numpy"), **xs), run(lower(graph, "numpy"), **xs), rtol=1e-6)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_packed_projections_stay_packed_and_are_used_transposed(target):
    """mlx-lm's QuantizedMultiLinear: k = quantized_matmul(c, W_uk, transpose=False), v = ...(c, W_uv,
    transpose=True); absorbed, q meets W_uk with transpose=True and the output W_uv with transpose=True."""
    packed = {"group_size": 32, "bits": 4}

    def f(q, latent, w_uk, w_uv, mask):
        k = ops.quantized_matmul(latent, *ops.quantize(w_uk, **packed), transpose=False, **packed)
        v = ops.quantized_matmul(latent, *ops.quantize(w_uv, **packed), transpose=True, **packed)
        return ops.sdpa(q, k, v, mask=mask, scale=0.2)

    g = Geometry(b=1, h=2, rows=3, t=24, r=32, dn=32, dv=8, top_k=None)
    graph = trace(f, *g.specs)
    result = absorb(graph)
    remark(result, "applied")
    projections = [n for n in result.graph.nodes() if n.op == "quantized_matmul"]
    assert [(n.inputs[0], n.attrs["transpose"]) for n in projections] == [("q", True), ("sdpa_latent", True)]
    assert not [n for n in result.graph.nodes() if n.op in ("matmul", "dequantize")]
    x = mla_inputs(g, 2)
    assert relative(run(lower(result.graph, target), **x), run(lower(graph, "numpy"), **x)) <= BOUND[g.dtype]


VARIANTS = {
    "causal": {"causal": "bottom_right"},
    "window": {"window": (5, None, None), "causal": "bottom_right"},
    "softcap": {"logit_softcap": 2.0},
    "sinks": {"sinks": True},
    "scale_none": {"scale": None},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_read_only_scores_and_positions_so_they_are_carried(variant):
    attrs = dict(VARIANTS[variant])
    sinks = attrs.pop("sinks", False)

    def f(q, latent, w_uk, w_uv, s):
        k, v = ops.matmul(latent, w_uk), ops.matmul(latent, ops.transpose(w_uv, (0, 2, 1)))
        return ops.sdpa(q, k, v, sinks=s if sinks else None, **{"scale": 0.3, **attrs})

    specs = (TensorSpec((2, 4, 3, 8)), TensorSpec((2, 1, 12, 16)), TensorSpec((4, 16, 8)), TensorSpec((4, 8, 16)),
             TensorSpec((4,)))  # fmt: skip
    graph = trace(f, *specs)
    result = absorb(graph)
    (sdpa,) = [n for n in result.graph.nodes() if n.op == "sdpa"]
    before = graph.node("sdpa")
    assert {k: v for k, v in sdpa.attrs.items() if k != "scale"} == {
        k: v for k, v in before.attrs.items() if k != "scale"
    }
    assert sdpa.attrs["scale"] == (0.3 if "scale" not in attrs else 1 / math.sqrt(8))
    rng = np.random.default_rng(3)
    xs = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in zip(graph.inputs, graph.input_types())}
    got = run(lower(result.graph, "numpy"), **{n: xs[n] for n in result.graph.inputs})
    assert relative(got, run(lower(graph, "numpy"), **xs)) < 1e-6


@pytest.mark.parametrize("value", ["0", "off", " No "])
def test_environment_switch_turns_it_off(monkeypatch, value):
    monkeypatch.setenv("ATTNPASS_MLA_ABSORB", value)
    graph = mla_graph(Geometry(top_k=None))
    r = remark(absorb(graph), "declined")
    assert r.reason == "disabled" and f"ATTNPASS_MLA_ABSORB={value.strip()}" in r.message
    assert os.environ["ATTNPASS_MLA_ABSORB"] == value
    remark(absorb(graph, enabled=True), "applied")
    assert remark(absorb(graph, enabled=False), "declined").reason == "disabled"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"crossover_factor": 0.0}, "crossover_factor must be a finite number > 0, got 0.0"),
        ({"crossover_factor": math.inf}, "crossover_factor must be a finite number > 0, got inf"),
        ({"crossover_factor": True}, "crossover_factor must be a finite number > 0, got True"),
        ({"selection_input": "not a name"}, "selection_input must be a graph input's name or None"),
        ({"rows_have_keys": 1}, "rows_have_keys must be True or False, got 1"),
    ],
)
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=f"^MLAAbsorb: {message}"):
        MLAAbsorb(**options)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.short)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_absorbed_agrees_with_expanded_within_the_bound(target, dtype, data):
    g = draw_geometry(data, dtype, rows=(1, 9), t=[16, 33, 64], top_k=lambda t: st.sampled_from([None, 3, 12]))
    graph = mla_graph(g)
    result = absorb(graph, crossover_factor=1e6, **PROMISED)
    assert remark(result, "applied")
    xs = mla_inputs(g, data.draw(st.integers(0, 99), "seed"))
    reference = run(lower(graph, "numpy"), **xs)
    absorbed = run(lower(result.graph, target), **xs)
    assert relative(absorbed, reference) <= BOUND[dtype]
    assert relative(absorbed, run(lower(graph, target), **xs)) <= BOUND[dtype]


def test_remark_claims_hold_on_the_fuzzed_family_and_the_cases_here():
    cases = fuzzed(("mla",), 40)
    counts = audit(MLAAbsorb(**PROMISED), cases, anchor="sdpa")
    counts += audit(MLAAbsorb(crossover_factor=0.5), cases, anchor="sdpa")
    assert counts["checked"] > 40 and counts["applied"] and counts["declined"]
