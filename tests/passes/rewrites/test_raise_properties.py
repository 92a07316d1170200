"""Property: raise-attention never changes the function, and raises what sdpa can express.

Hypothesis generates decomposed attentions (at least :data:`EXAMPLES` in CI, derandomized)
with scales and biases in every position (on q, k, v, the scores before and after each
mask, the mask, the probabilities; a bias on the scores is a second additive mask), bool and additive masks in either order, several
layouts per root (batched or not, heads or rows first, or stored transposed: the head dim before
the rows), GQA by repeat, tile, broadcast
or a grouped einsum, q·kᵀ and P·V written either way round, f32, bf16 or f16, softmax
as the op, decomposed, or accumulated in float32 around a half-float attention. For each one:

- the raised graph computes the original's function: in exact arithmetic (both graphs
  interpreted in float64, constants at their dtype's values) to 1e-9 of the output's magnitude,
  and in its own dtype within the rounding bound of :func:`rounding_bound` of that exact value.
  Graphs are interpreted op by op with the reference semantics
  (:func:`attnpass.ir.dialects.evaluate.evaluate`, checked bit for bit against the numpy
  target in ``test_canonicalize.py``; sdpa with the numpy target's own ``reference.sdpa``):
  generating code for thousands of graphs would double the time;
- exactly one remark decides the attention candidate;
- what the module docstring of :mod:`attnpass.passes.analysis.score_path` says sdpa can express
  is raised (a conservative model of it below); the rest is declined.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.ir.dialects import evaluate as semantics
from attnpass.ir.dialects.evaluate import EVALUATORS, constant, evaluate, wide
from attnpass.lowering.targets.numpy import reference
from attnpass.passes import PassManager, RaiseAttention
from tests.util import random_array

EXAMPLES = 2000
GENERATED: list[int] = []
FACTORS = (0.5, 2.0, 0.3, -1.0, 0.125, 3.0)
SCALE_AT = ("q", "k", "v", "scores", "after_add", "after_where", "mask", "probs")
BIAS_AT = ("q", "k", "v", "before_mask", "scores", "mask", "probs")


@dataclass
class Case:
    dtype: str
    batch: int | None  # None: unbatched roots
    hkv: int
    group: int
    s: int
    t: int
    d: int
    dv: int
    orders: tuple[str, str, str]
    gqa: str
    flips: tuple[bool, bool]
    mask: str  # none, bool, additive, add-then-where, where-then-add
    fill: float
    mask_shape: str
    softmax: str  # op, decomposed, f32-sum, f32-cast
    seed: int
    scales: dict = field(default_factory=dict)
    biases: dict = field(default_factory=dict)

    @property
    def hq(self) -> int:
        return self.hkv * self.group


ORDERS = list(itertools.product(["heads-first", "rows-first", "heads-dim-rows"], repeat=3))
SIZES = list(itertools.product([1, 2, 3], [1, 2, 4], [2, 4], [2, 3]))  # s, t, d, dv


def _placements(positions: tuple[str, ...], values: tuple[float, ...]):
    """Up to three (position, value) pairs, one draw each."""
    return st.lists(st.sampled_from(list(itertools.product(positions, values))), max_size=3).map(dict)


@st.composite
def cases(draw) -> Case:
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    group = draw(st.sampled_from([1, 2, 3]))
    s, t, d, dv = draw(st.sampled_from(SIZES))
    return Case(
        dtype=dtype,
        batch=draw(st.sampled_from([None, 1, 2])),
        hkv=draw(st.sampled_from([1, 2])),
        group=group,
        s=s,
        t=t,
        d=d,
        dv=dv,
        orders=draw(st.sampled_from(ORDERS)),
        gqa=draw(st.sampled_from(["repeat", "tile", "broadcast", "grouped"])) if group > 1 else "repeat",
        flips=draw(st.sampled_from([(False, False), (False, True), (True, False), (True, True)])),
        mask=draw(st.sampled_from(["none", "bool", "additive", "add-then-where", "where-then-add"])),
        fill=draw(st.sampled_from([-math.inf, float(DType.parse(dtype).finfo.min), -1e4])),
        mask_shape=draw(st.sampled_from(["st", "11st", "bhst"])),
        softmax=draw(st.sampled_from(["op", "decomposed"] + (["f32-sum", "f32-cast"] if dtype != "float32" else []))),
        seed=draw(st.integers(0, 2**16)),
        scales=draw(_placements(SCALE_AT, FACTORS)),
        biases=draw(_placements(BIAS_AT, (0.5, -1.25))),
    )


def _power_of_two(c: float) -> bool:
    return math.frexp(abs(c))[0] == 0.5


def expressible(case: Case) -> bool:
    """A conservative model of what sdpa expresses exactly (module docstring of score_path)."""
    if "probs" in case.scales or "probs" in case.biases:
        return False
    additive = case.mask in ("additive", "add-then-where", "where-then-add")
    where = case.mask in ("bool", "add-then-where", "where-then-add")
    if additive + ("scores" in case.biases) + ("before_mask" in case.biases) > 1:
        return False  # two additive masks
    after_add = case.scales.get("after_add", 1.0) * (
        case.scales.get("after_where", 1.0) if case.mask == "add-then-where" else 1.0
    )
    if additive and not _power_of_two(after_add):
        return False
    after_bias = case.scales.get("after_where", 1.0) if where else 1.0  # the scales after a bias before the masks
    if "before_mask" in case.biases and not _power_of_two(after_bias):
        return False
    if where:
        after = case.scales.get("after_where", 1.0) * (
            case.scales.get("after_add", 1.0) if case.mask == "where-then-add" else 1.0
        )
        dtype = DType.parse(case.dtype)
        with np.errstate(over="ignore"):
            reached = float(semantics.rounded(np.float64(case.fill) * after, dtype))  # the fill at the softmax
        limit = min(2.0**24 + 1024, 0.5 * float(dtype.finfo.max))  # docs/semantics.md §1.2 (the where's dtype
        # bounds it: a float16 softmax accumulated in float32 reads float16 scores)
        if after < 0 or reached > -limit:
            return False
        if math.isfinite(reached) and (additive or {"scores", "before_mask"} & set(case.biases)):
            return False  # a finite fill with an additive mask: a row without keys would be NaN under sdpa
    return True


def build(case: Case):
    """The traced source graph and its input arrays."""
    perms = {"heads-first": (0, 1, 2, 3), "rows-first": (0, 2, 1, 3), "heads-dim-rows": (0, 1, 3, 2)}
    b = case.batch or 1

    def root_shape(order, heads, rows, dim):
        dims = {
            "heads-first": (heads, rows, dim),
            "rows-first": (rows, heads, dim),
            "heads-dim-rows": (heads, dim, rows),
        }
        return dims[order] if case.batch is None else (b, *dims[order])

    def canonical(x, order):
        x = x if case.batch is not None else ops.reshape(x, (1, *x.type.shape))
        return ops.transpose(x, perms[order])

    def scaled(x, where):
        x = x * case.scales[where] if where in case.scales else x
        return x + case.biases[where] if where in case.biases else x

    def repeat(x, tile):
        _b, h, n, dim = x.type.shape
        shape = (b, 1, h, n, dim) if tile else (b, h, 1, n, dim)
        full = (b, case.group, h, n, dim) if tile else (b, h, case.group, n, dim)
        return ops.reshape(ops.broadcast_to(ops.reshape(x, shape), full), (b, h * case.group, n, dim))

    def matmul_t(x, y):  # x @ yᵀ, or (y @ xᵀ)ᵀ
        rank = x.type.rank
        swap = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        if case.flips[0]:
            return ops.transpose(ops.matmul(y, ops.transpose(x, swap)), swap)
        return ops.matmul(x, ops.transpose(y, swap))

    def matmul_pv(p, v):  # p @ v, or (vᵀ @ pᵀ)ᵀ
        rank = p.type.rank
        swap = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        return (
            ops.transpose(ops.matmul(ops.transpose(v, swap), ops.transpose(p, swap)), swap)
            if case.flips[1]
            else ops.matmul(p, v)
        )

    def softmax(x):
        if case.softmax == "op":
            return ops.softmax(x, -1)
        if case.softmax == "f32-cast":
            return ops.cast(ops.softmax(ops.cast(x, "float32"), -1), case.dtype)
        e = ops.exp(x - ops.max(x, -1, keepdims=True))
        total = (
            ops.sum(e, -1, keepdims=True)
            if case.softmax == "decomposed"
            else ops.cast(ops.sum(ops.cast(e, "float32"), -1, keepdims=True), case.dtype)
        )
        return e / total

    def attention(q, k, v, *masks):
        q = canonical(scaled(q, "q"), case.orders[0])
        k = canonical(scaled(k, "k"), case.orders[1])
        v = canonical(scaled(v, "v"), case.orders[2])
        grouped = case.gqa in ("broadcast", "grouped") and case.group > 1
        if grouped:
            q5 = ops.reshape(q, (b, case.hkv, case.group, case.s, case.d))
            if case.gqa == "broadcast":
                scores = matmul_t(q5, ops.reshape(k, (b, case.hkv, 1, case.t, case.d)))
            else:
                rows = matmul_t(ops.reshape(q5, (b, case.hkv, case.group * case.s, case.d)), k)
                scores = ops.reshape(rows, (b, case.hkv, case.group, case.s, case.t))
            scores = ops.reshape(scores, (b, case.hq, case.s, case.t))
        else:
            scores = matmul_t(q, repeat(k, case.gqa == "tile") if case.group > 1 else k)
        scores = scores * case.scales["scores"] if "scores" in case.scales else scores
        scores = scores + case.biases["before_mask"] if "before_mask" in case.biases else scores
        for step in {"bool": ["where"], "additive": ["add"], "add-then-where": ["add", "where"],
                     "where-then-add": ["where", "add"], "none": []}[case.mask]:  # fmt: skip
            if step == "add":
                scores = scores + scaled(masks[-1], "mask")
                scores = scores * case.scales["after_add"] if "after_add" in case.scales else scores
            else:
                scores = ops.where(masks[0], scores, ops.constant(case.fill, scores.type.dtype, like=scores))
                scores = scores * case.scales["after_where"] if "after_where" in case.scales else scores
        if "scores" in case.biases:
            scores = scores + case.biases["scores"]
        p = scaled(softmax(scores), "probs")
        if grouped:
            p5 = ops.reshape(p, (b, case.hkv, case.group, case.s, case.t))
            if case.gqa == "broadcast":
                out = matmul_pv(p5, ops.reshape(v, (b, case.hkv, 1, case.t, case.dv)))
            else:
                out = matmul_pv(ops.reshape(p5, (b, case.hkv, case.group * case.s, case.t)), v)
            return ops.reshape(out, (b, case.hq, case.s, case.dv))
        return matmul_pv(p, repeat(v, case.gqa == "tile") if case.group > 1 else v)

    rng = np.random.default_rng(case.seed)
    mask_shape = {"st": (case.s, case.t), "11st": (1, 1, case.s, case.t), "bhst": (b, case.hq, case.s, case.t)}[
        case.mask_shape
    ]
    shapes = [root_shape(case.orders[0], case.hq, case.s, case.d), root_shape(case.orders[1], case.hkv, case.t, case.d),
              root_shape(case.orders[2], case.hkv, case.t, case.dv)]  # fmt: skip
    specs = [TensorSpec(shape, case.dtype) for shape in shapes]
    arrays = [random_array(rng, shape, case.dtype) for shape in shapes]
    if case.mask in ("bool", "add-then-where", "where-then-add"):
        allowed = rng.random(mask_shape) < 0.6
        allowed[..., 0] = True  # every row attends at least one key
        specs.append(TensorSpec(mask_shape, "bool"))
        arrays.append(allowed)
    if case.mask in ("additive", "add-then-where", "where-then-add"):
        specs.append(TensorSpec(mask_shape, case.dtype))
        arrays.append(random_array(rng, mask_shape, case.dtype, low=-3.0, high=3.0))
    signatures = {3: lambda q, k, v: attention(q, k, v), 4: lambda q, k, v, m: attention(q, k, v, m),
                  5: lambda q, k, v, allowed, m: attention(q, k, v, allowed, m)}  # fmt: skip
    return trace(signatures[len(specs)], *specs, name="generated"), arrays


EXACT_RTOL = 1e-9  # float64 rounding (2**-53) over reductions of at most 12 terms, with a wide margin
LAYOUT = ("reshape", "transpose", "broadcast_to", "slice")  # move values: they move a bound alike


@contextlib.contextmanager
def _unrounded():
    """Float results kept in float64: the ops' exact values (up to float64 rounding)."""
    keep = semantics.rounded

    def rounded(x, dtype):
        return wide(x) if DType.parse(dtype).is_float else keep(x, dtype)

    with mock.patch.object(semantics, "rounded", rounded), mock.patch.object(reference, "rounded", rounded):
        yield


def interpret(graph, arrays, *, exact: bool = False) -> dict[str, np.ndarray]:
    """Every value of ``graph`` on ``arrays`` under the reference semantics (each op rounded to its dtype),
    or with ``exact`` in float64 throughout: constants keep their dtype's values, casts between floats are
    identities, nothing else is rounded."""
    values = dict(zip(graph.inputs, (wide(a) for a in arrays) if exact else arrays))
    for node in graph.nodes():
        xs = [values[i] for i in node.inputs]
        if node.op == "constant":
            value = constant(node.attrs["value"], node.type.shape, node.type.dtype)
            values[node.name] = wide(value) if exact else value
            continue
        with _unrounded() if exact else contextlib.nullcontext():
            if node.op == "sdpa":
                values[node.name] = reference.sdpa(
                    *xs, scale=node.attrs["scale"], causal=node.attrs["causal"], dtype=node.type.dtype.value
                )
            elif node.op != "input":
                values[node.name] = (
                    EVALUATORS[node.op](node.attrs, xs, node.type)
                    if exact
                    else evaluate(node.op, node.attrs, xs, node.type)
                )
    return values


def rounding_bound(graph, rounded: dict, exact: dict) -> np.ndarray:
    """A bound on |rounded - exact| at ``graph``'s output: a raised graph, whose arithmetic is sdpa
    (computed exactly, rounded once) on operands made by ops in the source's dtype, then layout ops.

    With ŝ, s* the logits from the rounded and the exact operands and Δ = max |ŝ - s*| over the keys
    a row attends, softmax(ŝ) = softmax(s*) · e^δ / Σ softmax(s*) e^δ with |δ| <= Δ, so each weight
    moves by at most a factor e^(±2Δ) and the weights together by at most e^(2Δ) - 1. Hence
    |ô - o*| <= (e^(2Δ) - 1)·max|v̂| + max|v̂ - v*| before the output is rounded to its dtype, which
    adds at most u·|ô| (u = 2^-(mantissa bits + 1), plus half the smallest subnormal). The bound is
    measured on the operands, not assumed: a rewrite that rounds more than the source is caught by the
    exact comparison or exceeds it, one that divides the logits wrongly exceeds it at once.
    """
    (sdpa,) = [n for n in graph.nodes() if n.op == "sdpa"]
    q, k, v = ([rounded[i], exact[i]] for i in sdpa.inputs[:3])
    mask = [rounded[sdpa.inputs[3]], exact[sdpa.inputs[3]]] if len(sdpa.inputs) > 3 else [None, None]
    (s_hat, allowed), (s_star, _) = (
        reference._scores(q[i], k[i], mask[i], sdpa.attrs["scale"], sdpa.attrs["causal"]) for i in (0, 1)
    )
    with np.errstate(invalid="ignore"):  # a -inf logit (a masked key) in both: no gap
        gap = np.where(s_hat == s_star, 0.0, np.abs(s_hat - s_star))
    gap = np.where(True if allowed is None else allowed, gap, 0.0)
    delta = np.max(gap, axis=-1, keepdims=True)  # per row [B, Hq, S, 1]
    finfo = sdpa.type.dtype.finfo
    u = 2.0 ** -(finfo.nmant + 1)
    out = wide(rounded[sdpa.name])
    bound = np.expm1(2 * delta) * np.max(np.abs(wide(v[0]))) + np.max(np.abs(wide(v[0]) - v[1]))
    values = {sdpa.name: bound + u * np.abs(out) + float(finfo.smallest_subnormal)}
    for node in graph.nodes():  # after the sdpa: the same layout ops carry its bound to the output
        if sdpa.name in node.inputs or any(i in values for i in node.inputs):
            assert node.op in LAYOUT, f"{node.op} {node.name} after the sdpa: no rounding bound for it"
            values[node.name] = EVALUATORS[node.op](node.attrs, [values[node.inputs[0]]], node.type)
    return values[graph.outputs[0]]


def check_raised(source, raised, arrays) -> None:
    """``raised`` computes ``source``'s function: exactly in float64, and within its rounding in its dtype."""
    exact = interpret(source, arrays, exact=True)[source.outputs[0]]
    raised_exact = interpret(raised, arrays, exact=True)
    scale = np.max(np.abs(exact)) if exact.size else 0.0
    err = np.abs(raised_exact[raised.outputs[0]] - exact)
    assert np.all(err <= EXACT_RTOL * (np.abs(exact) + scale)), f"exact results differ by up to {np.max(err)!r}"
    raised_rounded = interpret(raised, arrays)
    got = raised_rounded[raised.outputs[0]]
    assert got.dtype == source.node(source.outputs[0]).type.dtype.numpy
    bound = rounding_bound(raised, raised_rounded, raised_exact)
    assert np.all(np.isfinite(bound)), "no finite rounding bound: a logit is infinite in one semantics only"
    err = np.abs(wide(got) - exact)
    assert np.all(err <= bound * (1 + 1e-6) + EXACT_RTOL * scale), (
        f"{int(np.sum(err > bound))} of {err.size} elements beyond the rounding bound; worst: "
        f"{np.max(err - bound)!r} over it"
    )


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(cases())
def test_raising_never_changes_the_function(case):
    GENERATED.append(1)
    graph, arrays = build(case)
    result = PassManager([RaiseAttention()]).run(graph)
    decisions = [r for r in result.remarks if r.rule == "attention"]
    assert len(decisions) == 1, [str(r) for r in result.remarks]
    raised = decisions[0].kind == "applied"
    assert raised or not expressible(case), str(decisions[0])
    if raised:
        check_raised(graph, result.graph, arrays)


def test_the_property_ran_on_enough_attentions():
    if not GENERATED:
        pytest.skip("the property test did not run in this session")
    assert len(GENERATED) >= EXAMPLES


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_check_catches_a_scale_off_by_one_bf16_ulp(dtype):
    """A raise whose sdpa scale is off by 2^-7 (one bf16 ulp at 1) fails both parts of check_raised;
    the tolerance this test used before (0.1 of the output's maximum) let it pass."""
    case = Case(
        dtype=dtype, batch=1, hkv=2, group=2, s=3, t=4, d=4, dv=3, orders=("heads-first",) * 3, gqa="repeat",
        flips=(False, False), mask="bool", fill=-math.inf, mask_shape="st", softmax="decomposed", seed=7,
    )  # fmt: skip
    graph, arrays = build(case)
    raised = PassManager([RaiseAttention()]).run(graph).graph
    check_raised(graph, raised, arrays)
    (sdpa,) = [n for n in raised.nodes() if n.op == "sdpa"]
    wrong = raised.copy()
    wrong.replace_node(sdpa.name, sdpa.replace(attrs={**sdpa.attrs, "scale": sdpa.attrs["scale"] * (1 + 2**-7)}))
    with pytest.raises(AssertionError, match="exact results differ"):
        check_raised(graph, wrong, arrays)
    rounded, exact = interpret(wrong, arrays), interpret(wrong, arrays, exact=True)
    source = interpret(graph, arrays, exact=True)[graph.outputs[0]]
    assert np.any(np.abs(wide(rounded[wrong.outputs[0]]) - source) > rounding_bound(wrong, rounded, exact))
    if dtype == "bfloat16":  # what the bf16 tolerance before this check accepted
        old = interpret(graph, arrays)[graph.outputs[0]].astype(np.float64)
        assert np.all(np.abs(wide(rounded[wrong.outputs[0]]) - old) <= 0.1 * (np.abs(old) + np.max(np.abs(old))))
