"""raise-attention's deferred-attention and lse-combine rules (docs/semantics.md §1.6, passes/analysis/partial_attention.py).

Deferred normalisation, ``(exp(s - m)·v) / sum(exp(s - m))``, and the log-sum-exp combine of partial attentions
over disjoint keys become one ``sdpa`` (over the parts' keys concatenated); look-alikes are declined with the
reason code and leave the graph as canonicalize alone leaves it. The graphs are the fuzzer's ``partial`` family
(:func:`tests.fuzz.families.build_partial`), written the MaxText way in JAX (``jnp.einsum``, ``moveaxis``, its
``normalize_attention``) and in MLX. Raised and unraised graphs are compared on the numpy reference, and the
raised graph on MLX and JAX against the source.
"""

from __future__ import annotations

import functools
import math
import random
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import DType, Graph, from_jax, from_mlx
from attnpass.lowering import lower
from attnpass.passes import Canonicalize, PassManager, RaiseAttention
from tests.fuzz.choices import Choices
from tests.fuzz.families import PartialSpec, _Maker, build_partial
from tests.util import lazy_import, requires, target_params

mx = lazy_import("mlx.core")
jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN rows (0/0) are compared, not reported

F32, BF16, F16 = DType.float32, DType.bfloat16, DType.float16
LOW = float(np.finfo(np.float32).min)
RULES = ("deferred-attention", "lse-combine", "attention")


def _case(spec: PartialSpec, seed: int = 0) -> tuple[Graph, dict[str, np.ndarray]]:
    m = _Maker(Choices(random.Random(seed)), "partial")
    case = m.case("partial", [build_partial(m, spec)])
    return case.graph, case.arrays


def _raise(graph: Graph):
    return PassManager([RaiseAttention()]).run(graph)


def _ops(graph: Graph, op: str) -> list:
    return [n for n in graph.nodes() if n.op == op]


def _remarks(result) -> list:
    return [r for r in result.remarks if r.rule in RULES]


def _outputs(graph: Graph, arrays: dict[str, np.ndarray], target: str = "numpy") -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = run(lower(graph, target), **{n: arrays[n] for n in graph.inputs})
    return np.asarray(out).astype(np.float64)


def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """Equal NaNs where the source is NaN, and within ``rtol`` of the largest value elsewhere."""
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    if finite.any():
        bound = rtol * max(np.abs(want[finite]).max(), 1e-30)
        assert np.abs(got[finite] - want[finite]).max() <= bound, np.abs(got[finite] - want[finite]).max()


def _raised_same_function(spec: PartialSpec, seed: int = 0, targets: tuple[str, ...] = ("numpy",)):
    graph, arrays = _case(spec, seed)
    result = _raise(graph)
    want = _outputs(graph, arrays)
    rtol = {F32: 1e-5, BF16: 2e-2, F16: 4e-3}[spec.dtype]
    for target in targets:
        _close(_outputs(result.graph, arrays, target), want, rtol)
    return graph, result


# ----------------------------------------------------------------------------- deferred normalisation

DEFERRED = [
    PartialSpec(),
    PartialSpec(with_max=False),
    PartialSpec(mask="bool", fill=LOW),
    PartialSpec(mask="bool", fill=-math.inf, with_max=False),
    PartialSpec(mask="additive", on_q=True),
    PartialSpec(grouped=False, rows_first=True, divide=True),
    PartialSpec(rows_first=True, mask="bool", fill=-1e30, flatten=True),
    PartialSpec(batch=2, hkv=1, group=3, rows=1, lens=(1,), dv=4),
]


@pytest.mark.parametrize("target", target_params("numpy", "jax", "mlx"))
@pytest.mark.parametrize("spec", DEFERRED, ids=[f"deferred-{i}" for i in range(len(DEFERRED))])
def test_deferred_normalisation_is_raised_to_one_sdpa(spec, target):
    _graph, result = _raised_same_function(spec, targets=(target,))
    (call,) = _ops(result.graph, "sdpa")
    assert not [n for n in result.graph.nodes() if n.op in ("matmul", "exp", "sum", "max")]
    assert call.attrs["scale"] == spec.scale and call.inputs[1:3] == ("k0", "v0")  # K/V not repeated: GQA in sdpa
    (remark,) = [r for r in _remarks(result) if r.kind == "applied"]
    assert remark.rule == "deferred-attention" and remark.data["max_subtracted"] == spec.with_max
    assert ("without its row max" in remark.message) == (not spec.with_max)
    assert _raise(result.graph).changed is False  # the fixed point: nothing left to raise


def test_a_product_with_the_reciprocal_of_the_sum_is_raised():
    """u · (1 / l) instead of u / l: the same deferred normalisation, raised at the product."""
    from attnpass.ir import TensorSpec, ops, trace

    def attention(q, k, v):
        s = ops.mul(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))), 0.25)
        e = ops.exp(ops.sub(s, ops.max(s, -1, keepdims=True)))
        return ops.mul(ops.matmul(e, v), ops.div(1.0, ops.sum(e, -1, keepdims=True)))

    graph = trace(attention, *(TensorSpec(sh) for sh in [(1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)]))
    result = _raise(graph)
    assert len(_ops(result.graph, "sdpa")) == 1 and [r.rule for r in _remarks(result)] == ["deferred-attention"]
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in zip(graph.inputs, graph.input_types())}
    _close(_outputs(result.graph, arrays), _outputs(graph, arrays), 1e-6)


def test_without_the_max_a_row_without_keys_stays_nan():
    """exp(s) of a row every key of which is masked is 0/0 in the source: the raised sdpa keeps that row NaN."""
    graph, arrays = _case(PartialSpec(mask="bool", fill=LOW, with_max=False, rows=2, lens=(4,)))
    mask = next(n for n in arrays if n.startswith("mask"))
    arrays[mask] = np.ones_like(arrays[mask])
    arrays[mask].reshape(-1, arrays[mask].shape[-1])[0] = False  # row 0 (or every row, for a [1, T] mask)
    result = _raise(graph)
    assert _ops(result.graph, "sdpa")
    got, want = _outputs(result.graph, arrays), _outputs(graph, arrays)
    assert np.isnan(want).any()
    _close(got, want, 1e-5)


def test_float16_without_the_max_is_declined():
    graph, _arrays = _case(PartialSpec(dtype=F16, with_max=False))
    result = _raise(graph)
    assert not _ops(result.graph, "sdpa")
    (remark,) = _remarks(result)
    assert (remark.rule, remark.reason) == ("deferred-attention", "inexact") and "float16 overflows" in remark.message


# ----------------------------------------------------------------------------- log-sum-exp combines

COMBINES = [
    PartialSpec(lens=(7, 3)),
    PartialSpec(lens=(7, 3), mask="bool", fill=-2.381976426469702e38, rows_first=True),
    PartialSpec(lens=(5, 2, 4), form="maxtext", mask="bool", fill=LOW, grouped=False),
    PartialSpec(lens=(4, 4), form="lse"),
    PartialSpec(lens=(6, 1), form="split", on_q=True, flatten=True),
    PartialSpec(lens=(3, 5, 2), form="lse", grouped=False, rows_first=True),
]


@pytest.mark.parametrize("target", target_params("numpy", "jax", "mlx"))
@pytest.mark.parametrize("spec", COMBINES, ids=[f"{s.form}-{len(s.lens)}-{s.mask}" for s in COMBINES])
def test_combines_are_raised_to_one_sdpa_over_the_concatenated_keys(spec, target):
    _graph, result = _raised_same_function(spec, targets=(target,))
    (call,) = _ops(result.graph, "sdpa")
    k = result.graph.node(call.inputs[1])
    assert k.op == "concat" and k.type.shape[2] == sum(spec.lens)
    assert not [n for n in result.graph.nodes() if n.op in ("exp", "log", "maximum", "matmul")]
    (remark,) = [r for r in _remarks(result) if r.kind == "applied"]
    assert remark.rule == "lse-combine" and remark.data["kv_lens"] == spec.lens
    assert remark.data["k"] == tuple(f"k{i}" for i in range(len(spec.lens)))
    assert len(_remarks(result)) == 1  # the parts say nothing of their own
    assert _raise(result.graph).changed is False


def test_a_row_every_part_leaves_without_keys_is_the_mean_of_all_values():
    """MaxText's form with a finite fill: M = fill, every weight 1, S = Σ T_i: the mean of all V, as one sdpa."""
    spec = PartialSpec(lens=(3, 5), mask="bool", fill=LOW, rows=2)
    graph, arrays = _case(spec)
    for name in [n for n in arrays if n.startswith("mask")]:
        arrays[name] = np.zeros_like(arrays[name])
    result = _raise(graph)
    assert _ops(result.graph, "sdpa")
    got, want = _outputs(result.graph, arrays), _outputs(graph, arrays)
    v = np.concatenate([arrays["v0"], arrays["v1"]], axis=2).mean(axis=2)  # [B, Hkv, Dv]
    assert np.allclose(want.reshape(-1, spec.dv), np.repeat(v.reshape(-1, spec.dv), spec.group * spec.rows, axis=0))
    _close(got, want, 1e-5)


# ----------------------------------------------------------------------------- look-alikes and declines

DECLINED = [
    (PartialSpec(near="other-sum"), "deferred-attention", "normalizer_mismatch", "other than the sum"),
    (PartialSpec(near="other-exp"), "deferred-attention", "normalizer_mismatch", "other than the sum"),
    (PartialSpec(near="plus-one"), "deferred-attention", "normalizer_mismatch", "not the sums of disjoint"),
    (PartialSpec(lens=(4, 3), near="plus-one"), "lse-combine", "normalizer_mismatch", "exp(0)"),
    (PartialSpec(lens=(4, 3), form="lse", near="weights"), "lse-combine", "normalizer_mismatch", "do not sum to one"),
    (PartialSpec(lens=(4, 3), near="other-exp"), "lse-combine", "normalizer_mismatch", "not a combine"),
    (PartialSpec(lens=(4, 3), near="overlap"), "lse-combine", "keys_overlap", "share cells of k0"),
    (PartialSpec(lens=(4, 3), near="other-q"), "lse-combine", "combine_mismatch", "different queries"),
    (PartialSpec(lens=(4, 3), near="other-scale"), "lse-combine", "combine_mismatch", "have scales 0.5 and 0.25"),
    (PartialSpec(lens=(4, 3), mask="additive"), "lse-combine", "rows_without_keys", "additive mask"),
    (PartialSpec(lens=(4, 3), mask="bool"), "lse-combine", "rows_without_keys", "filled with -inf"),
    (PartialSpec(lens=(4, 3), mask="bool", fill=LOW, form="lse"), "lse-combine", "rows_without_keys", "absorbs"),
    (PartialSpec(lens=(4, 3), with_max=False, form="split"), "lse-combine", "combine_mismatch", "row max"),
]


@pytest.mark.parametrize(
    "spec, rule, reason, words", DECLINED, ids=[f"{r[0].near or r[0].mask or r[0].form}-{r[2]}" for r in DECLINED]
)
def test_look_alikes_are_declined_with_the_reason_and_left_as_they_were(spec, rule, reason, words):
    graph, result = _raised_same_function(spec)
    assert not _ops(result.graph, "sdpa") and not _ops(result.graph, "softmax")
    assert result.graph.fingerprint() == PassManager([Canonicalize()]).run(graph).graph.fingerprint()
    (remark,) = _remarks(result)  # one remark for the attention (a combine's parts say nothing of their own)
    assert (remark.rule, remark.kind, remark.reason) == (rule, "declined", reason), str(remark)
    assert words in remark.message, remark.message


def test_a_sum_over_the_query_rows_is_declined():
    """u / sum(e, rows): a look-alike whose sum broadcasts (T == Dv) but adds the wrong axis."""
    from attnpass.ir import TensorSpec, ops, trace

    def attention(q, k, v):
        s = ops.mul(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))), 0.25)
        e = ops.exp(ops.sub(s, ops.max(s, -1, keepdims=True)))
        return ops.div(ops.matmul(e, v), ops.sum(e, -2, keepdims=True))

    graph = trace(attention, *(TensorSpec(sh) for sh in [(1, 2, 3, 8), (1, 2, 8, 8), (1, 2, 8, 8)]))
    result = _raise(graph)
    assert not _ops(result.graph, "sdpa")
    (remark,) = _remarks(result)
    assert (remark.rule, remark.reason) == ("deferred-attention", "normalizer_mismatch"), str(remark)
    assert "not the keys' axis" in remark.message, remark.message


def test_an_unnormalised_product_is_declined_by_the_attention_rule():
    """exp(s - m)·v that nothing divides by its sum (nor combines): the attention rule says so, on the product."""
    graph, _arrays = _case(PartialSpec())
    (div,) = [n for n in graph.nodes() if n.op == "div"]
    graph.set_outputs([div.inputs[0]])
    graph.remove_dead()
    result = _raise(graph)
    (remark,) = _remarks(result)
    assert (remark.rule, remark.reason) == ("attention", "normalizer_mismatch") and "no softmax" in remark.message


# ----------------------------------------------------------------------------- properties


def _expected(spec: PartialSpec) -> bool:
    """What the rules raise: a conservative model of docs/semantics.md §1.6."""
    if spec.near is not None:
        return False
    if len(spec.lens) == 1:
        return spec.with_max or spec.dtype is not F16
    if spec.mask == "additive" or (spec.mask == "bool" and (spec.fill == -math.inf or spec.form != "maxtext")):
        return False
    return spec.with_max


@st.composite
def specs(draw) -> PartialSpec:
    dtype = draw(st.sampled_from([F32, F32, BF16, F16]))
    parts = draw(st.sampled_from([1, 1, 2, 2, 3]))
    d = draw(st.sampled_from([4, 8]))
    low = float(ml_dtypes.finfo(dtype.numpy).min)
    return PartialSpec(
        dtype=dtype, batch=draw(st.integers(1, 2)), hkv=draw(st.integers(1, 2)), group=draw(st.integers(1, 3)),
        rows=draw(st.integers(1, 4)), d=d, dv=draw(st.sampled_from([4, 8])),
        lens=tuple(draw(st.integers(1, 6)) for _ in range(parts)), scale=draw(st.sampled_from([1 / math.sqrt(d), 0.5])),
        on_q=draw(st.booleans()), divide=draw(st.booleans()), grouped=draw(st.booleans()),
        rows_first=draw(st.booleans()), with_max=draw(st.booleans()) or parts > 1,
        mask=draw(st.sampled_from([None, "bool", "additive"])), fill=draw(st.sampled_from([low, -math.inf])),
        form=draw(st.sampled_from(["maxtext", "lse", "split"])), flatten=draw(st.booleans()),
    )  # fmt: skip


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), seed=st.integers(0, 2**16))
def test_raised_partial_attention_computes_the_same_function(spec, seed):
    """Over shapes, GQA layouts, masks and scales: raised exactly when the model says, one remark for the
    attention, and the raised graph computes the source's function (NaN rows included) on the reference."""
    _graph, result = _raised_same_function(spec, seed)
    raised = bool(_ops(result.graph, "sdpa"))
    assert raised == _expected(spec), [str(r) for r in _remarks(result)]
    assert len(_remarks(result)) == 1, [str(r) for r in _remarks(result)]


# ----------------------------------------------------------------------------- MaxText in JAX, MLX

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # MaxText's


def _maxtext():
    """MaxText's dot-product attention (attentions.py: qk_product, apply_mask_to_logits, compute_local_attention,
    wv_product, normalize_attention), as it writes it."""

    def qk_product(query, key):
        b, t, n, d = query.shape
        n_kv = key.shape[-2]
        query = jnp.reshape(query, (b, t, n_kv, n // n_kv, d))
        return jnp.einsum("btkgd,bskd->bkgts", query, key)

    def wv_product(attn_weights, value):
        out = jnp.einsum("bkgts,bskd->btkgd", attn_weights, value)
        b, t, n_kv, g, d = out.shape
        return jnp.reshape(out, (b, t, n_kv * g, d))

    def local_attention(query, key, value, mask):
        attn_weights = qk_product(query, key)
        if mask is not None:
            attn_weights = jnp.where(mask >= DEFAULT_MASK_VALUE * 0.5, attn_weights, DEFAULT_MASK_VALUE)
        local_max = jnp.max(attn_weights, axis=-1, keepdims=True)
        local_exps = jnp.exp(attn_weights - jax.lax.stop_gradient(local_max))
        local_sum = jnp.sum(local_exps, axis=-1, keepdims=True)
        local_sum = jnp.moveaxis(local_sum, -2, 1)
        local_max = jnp.moveaxis(local_max, -2, 1)
        local_max = jnp.reshape(local_max, (*local_max.shape[:2], local_max.shape[2] * local_max.shape[3], 1))
        local_sum = jnp.reshape(local_sum, (*local_sum.shape[:2], local_sum.shape[2] * local_sum.shape[3], 1))
        return wv_product(local_exps, value), local_max, local_sum

    def normalize_attention(local_outs, local_maxes, local_sums):
        global_max = functools.reduce(jnp.maximum, local_maxes)
        global_sum = sum(
            [jnp.exp(local_max - global_max) * local_sum for (local_sum, local_max) in zip(local_sums, local_maxes)]
        )
        attn_out = 0
        for local_sum, local_max, local_out in zip(local_sums, local_maxes, local_outs):
            local_normalizer = jnp.exp(local_max - global_max) / global_sum
            attn_out += local_normalizer * local_out
        return attn_out

    def prefill(query, key, value, mask):
        out, _max, total = local_attention(query / np.sqrt(query.shape[-1]), key, value, mask)
        return out / total

    def prefill_and_decode(query, key, value, mask, ar_key, ar_value, ar_mask):
        query = query / np.sqrt(query.shape[-1])
        parts = [local_attention(query, key, value, mask), local_attention(query, ar_key, ar_value, ar_mask)]
        return normalize_attention(*zip(*parts))

    def lse_combine(query, key, value, mask, ar_key, ar_value):
        """Each part normalised, with its log-sum-exp; combined as split-kv's combine read backwards (the decode
        part unmasked: with every part masked, docs/semantics.md §1.6 declines this form)."""
        query = query / np.sqrt(query.shape[-1])
        outs, lses = [], []
        for k, v, m in ((key, value, mask), (ar_key, ar_value, None)):
            out, local_max, total = local_attention(query, k, v, m)
            outs.append(out / total)
            lses.append(local_max + jnp.log(total))
        peak = jnp.maximum(*lses)
        lse = peak + jnp.log(sum(jnp.exp(x - peak) for x in lses))
        return sum(jnp.exp(x - lse) * o for x, o in zip(lses, outs))

    return {"local": local_attention, "normalize": normalize_attention, "prefill": prefill,
            "prefill_and_decode": prefill_and_decode, "lse_combine": lse_combine}  # fmt: skip


def _maxtext_inputs(rng, dtype=np.float32, *, rows=5, heads=4, kv_heads=2, d=16, prefill=9, decode=3):
    def cache(t):
        return tuple(rng.standard_normal((1, t, kv_heads, d)).astype(dtype) for _ in range(2))

    q = rng.standard_normal((1, rows, heads, d)).astype(dtype)
    causal = np.tril(np.ones((rows, prefill), bool), prefill - rows)
    mask = np.where(causal, 0.0, DEFAULT_MASK_VALUE).astype(np.float32)[None, None, None]
    ar_mask = np.zeros((1, 1, 1, rows, decode), np.float32)
    return q, *cache(prefill), mask, *cache(decode), ar_mask


@requires("jax", "mlx.core")
@pytest.mark.parametrize("which", ["prefill", "prefill_and_decode", "lse_combine"])
def test_maxtext_attention_imported_from_jax_is_raised(rng, which):
    fn = _maxtext()[which]
    args = _maxtext_inputs(rng)
    args = {"prefill": args[:4], "prefill_and_decode": args, "lse_combine": args[:6]}[which]
    graph = from_jax(fn, *args).graph
    result = _raise(graph)
    (call,) = _ops(result.graph, "sdpa")
    assert result.graph.node(call.inputs[1]).type.shape[2] == (9 if which == "prefill" else 12)
    assert not [n for n in result.graph.nodes() if n.op in ("exp", "matmul", "max")]
    (remark,) = [r for r in _remarks(result) if r.kind == "applied"]
    assert remark.rule == ("deferred-attention" if which == "prefill" else "lse-combine")
    expected = np.asarray(jax.jit(fn)(*args))
    for target in ("jax", "mlx", "numpy"):
        np.testing.assert_allclose(run(lower(result.graph, target), *args), expected, rtol=1e-5, atol=2e-6)


@requires("jax")
def test_maxtext_parts_with_different_queries_are_left_with_the_combines_remark(rng):
    """The decode part reads another query: two attentions combined, not one; left dense with one remark."""
    maxtext = _maxtext()
    q, *rest = _maxtext_inputs(rng)
    other = rng.standard_normal(q.shape).astype(q.dtype)

    def fn(query, other, key, value, mask, ar_key, ar_value, ar_mask):
        parts = [maxtext["local"](query, key, value, mask), maxtext["local"](other, ar_key, ar_value, ar_mask)]
        return maxtext["normalize"](*zip(*parts))

    graph = from_jax(fn, q, other, *rest).graph
    result = _raise(graph)
    assert not _ops(result.graph, "sdpa")
    (remark,) = _remarks(result)
    assert (remark.rule, remark.reason) == ("lse-combine", "combine_mismatch") and "queries" in remark.message
    expected = np.asarray(jax.jit(fn)(q, other, *rest))
    np.testing.assert_allclose(run(lower(result.graph, "jax"), q, other, *rest), expected, rtol=1e-6, atol=1e-7)


@requires("jax")
def test_a_combine_through_jnp_logaddexp_is_raised(rng):
    """lse = jnp.logaddexp(lse_0, lse_1), as JAX traces it (where(isnan(d), x + y, max + log1p(exp(-|d|))))."""
    maxtext = _maxtext()

    def fn(query, key, value, mask, ar_key, ar_value):
        query = query / np.sqrt(query.shape[-1])
        outs, lses = [], []
        for k, v, m in ((key, value, mask), (ar_key, ar_value, None)):
            out, local_max, total = maxtext["local"](query, k, v, m)
            outs.append(out / total)
            lses.append(local_max + jnp.log(total))
        lse = jnp.logaddexp(*lses)
        return sum(jnp.exp(x - lse) * o for x, o in zip(lses, outs))

    args = _maxtext_inputs(rng)[:6]
    result = _raise(from_jax(fn, *args).graph)
    assert len(_ops(result.graph, "sdpa")) == 1
    assert [r.rule for r in _remarks(result)] == ["lse-combine"]
    expected = np.asarray(jax.jit(fn)(*args))
    np.testing.assert_allclose(run(lower(result.graph, "jax"), *args), expected, rtol=1e-5, atol=2e-6)


def test_two_attentions_subtracted_are_each_raised():
    """o_0 - 0.5·o_1 (differential attention) is no combine: each softmax attention is raised by itself."""
    from attnpass.ir import TensorSpec, ops, trace

    def attend(q, k, v):
        return ops.matmul(ops.softmax(ops.mul(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))), 0.25), -1), v)

    def differential(q, k0, v0, k1, v1):
        return ops.sub(attend(q, k0, v0), ops.mul(attend(q, k1, v1), 0.5))

    specs = [TensorSpec(s) for s in [(1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 4, 8), (1, 2, 4, 8)]]
    result = _raise(trace(differential, *specs))
    assert len(_ops(result.graph, "sdpa")) == 2
    assert [(r.rule, r.kind) for r in _remarks(result)] == [("attention", "applied")] * 2


@requires("mlx.core")
@pytest.mark.parametrize("combine", [False, True])
def test_mlx_deferred_attention_and_combine_are_raised(rng, combine):
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    ks = [rng.standard_normal((1, 2, t, 8)).astype(np.float32) for t in (6, 2)]
    vs = [rng.standard_normal((1, 2, t, 8)).astype(np.float32) for t in (6, 2)]

    def part(q, k, v):
        s = (q * 0.5).reshape(1, 2, 6, 8) @ k.transpose(0, 1, 3, 2)
        m = mx.max(s, axis=-1, keepdims=True)
        e = mx.exp(s - m)
        return e @ v, m, mx.sum(e, axis=-1, keepdims=True)

    def attention(q, k0, v0, k1, v1):
        (u0, m0, l0), (u1, m1, l1) = part(q, k0, v0), part(q, k1, v1)
        if not combine:
            return (u0 / l0).reshape(1, 4, 3, 8)
        top = mx.maximum(m0, m1)
        w0, w1 = mx.exp(m0 - top), mx.exp(m1 - top)
        return ((w0 * u0 + w1 * u1) / (w0 * l0 + w1 * l1)).reshape(1, 4, 3, 8)

    args = [mx.array(a) for a in (q, ks[0], vs[0], ks[1], vs[1])]
    result = _raise(from_mlx(attention, *args).graph)
    (call,) = _ops(result.graph, "sdpa")
    assert call.attrs["scale"] == 0.5
    (remark,) = [r for r in _remarks(result) if r.kind == "applied"]
    assert remark.rule == ("lse-combine" if combine else "deferred-attention")
    np.testing.assert_allclose(run(lower(result.graph, "mlx"), *args), np.array(attention(*args)), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- numerics (docs/numerics.md)

STEPS = {np.float32: (2.0**-23, 16), "bfloat16": (2.0**-7, 2)}  # dtype -> (step of 1, the stated bound in steps)


@requires("jax", "mlx.core")
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_the_raised_forms_stay_within_the_stated_steps_of_the_source(dtype):
    """MaxText's deferred normalisation and two-part combine (50 keys, head dim 64, 8/2 heads), raised, on
    numpy, JAX and MLX: within 16 steps (float32) and 2 steps (bfloat16) of the largest value of the source
    run by jax.jit and by the numpy reference. Measured: at most 6 and 1.6."""
    maxtext = _maxtext()
    rng = np.random.default_rng(7)
    step, bound = STEPS[dtype]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    worst = 0.0
    for _trial in range(3):
        args = _maxtext_inputs(rng, np_dtype, rows=9, heads=8, d=64, prefill=33, decode=17)
        for fn, used in ((maxtext["prefill"], args[:4]), (maxtext["prefill_and_decode"], args)):
            graph = from_jax(fn, *used).graph
            raised = _raise(graph).graph
            assert len(_ops(raised, "sdpa")) == 1
            sources = [
                np.asarray(jax.jit(fn)(*used)).astype(np.float64),
                _outputs(graph, dict(zip(graph.inputs, used))),
            ]
            largest = np.abs(sources[0]).max()
            for target in ("numpy", "jax", "mlx"):
                got = np.asarray(run(lower(raised, target), *used)).astype(np.float64)
                worst = max(worst, *(np.abs(got - s).max() / (step * largest) for s in sources))
    assert worst <= bound, worst
