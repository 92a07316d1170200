"""Primitive counts as the backends themselves report them (MLX ``export_function``, JAX jaxprs).

Expected counters are written from the backend facts in docs/semantics.md §4: on CPU MLX decomposes
``mx.fast.scaled_dot_product_attention`` (Matmul, Softmax, Matmul, K/V broadcast to the
query heads); JAX attention is two ``dot_general`` and one ``exp``; nested jaxprs are
counted recursively.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from attnpass.backends import assert_primitive_counts, count_primitives
from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.lowering.targets.jax import target as jax_backend
from attnpass.lowering.targets.mlx import target as mlx_backend
from tests.util import available, lazy_import, random_array, requires

pytestmark = requires("mlx.core", "jax")
mx = lazy_import("mlx.core")
jax = lazy_import("jax")
lax = lazy_import("jax.lax")

F32, BF16, F16 = DType.float32, DType.bfloat16, DType.float16
# On Metal, MLX may route sdpa to a fused kernel (docs/semantics.md §2.6); the decomposition counts hold on CPU.
mlx_cpu_only = pytest.mark.skipif(
    available("mlx.core") and mx.default_device().type != mx.DeviceType.cpu, reason="MLX CPU routing"
)


def _inputs(graph, seed=0):
    rng = np.random.default_rng(seed)
    return [random_array(rng, t.shape, t.dtype) for t in graph.input_types()]


def softmax_matmul(a, b):
    return ops.softmax(ops.matmul(a, b))


def _softmax_matmul():
    graph = trace(softmax_matmul, TensorSpec((2, 4, 8)), TensorSpec((2, 8, 6)))
    return graph, _inputs(graph)


def _attention(hq=24, hkv=2, s=5, t=16, d=64, dv=64, dtype=BF16, **attrs):
    def attention(q, k, v):
        return ops.sdpa(q, k, v, **attrs)

    graph = trace(
        attention,
        TensorSpec((1, hq, s, d), dtype),
        TensorSpec((1, hkv, t, d), dtype),
        TensorSpec((1, hkv, t, dv), dtype),
    )
    return graph, _inputs(graph)


# ============================================================================ MLX


def test_mlx_softmax_matmul_is_exactly_one_matmul_and_one_softmax():
    graph, xs = _softmax_matmul()
    counts = assert_primitive_counts(lower(graph, "mlx"), {"Matmul": 1, "Softmax": 1}, *xs, exact=True)
    assert counts == Counter({"Matmul": 1, "Softmax": 1})


def test_mlx_counts_accept_inputs_by_name():
    graph, (a, b) = _softmax_matmul()
    assert count_primitives(lower(graph, "mlx"), b=b, a=a) == Counter({"Matmul": 1, "Softmax": 1})


@mlx_cpu_only
@pytest.mark.parametrize("dtype", [BF16, F32], ids=lambda d: d.short)
def test_mlx_cpu_sdpa_is_the_unfused_fallback(dtype):
    """24 q / 2 kv on CPU: Matmul, Softmax, Matmul over a [B, Hkv, G, S, T] score plane, K/V broadcast per head."""
    graph, xs = _attention(dtype=dtype, scale=1 / 16)
    program = lower(graph, "mlx")
    counts = assert_primitive_counts(program, {"Matmul": 2, "Softmax": 1, "ScaledDotProductAttention": 0}, *xs)
    assert sum(counts.values()) > 3  # the decomposition carries layout primitives around the three above
    prims = mlx_backend.primitives(program, *xs)
    (softmax,) = [p for p in prims if p.name == "Softmax"]
    assert softmax.outputs == (((1, 2, 12, 5, 16), dtype.value),)  # the [heads, S, T] plane, grouped by kv head
    assert softmax.arguments == (True,)  # MLX's fallback softmax is precise
    first, second = [p for p in prims if p.name == "Matmul"]
    assert first.inputs[1][0] == (1, 2, 12, 64, 16)  # K^T broadcast to all 12 query heads of each group
    assert second.inputs[1][0] == (1, 2, 12, 16, 64)  # V likewise
    broadcasts = [p for p in prims if p.name == "Broadcast"]
    assert {p.outputs[0][0] for p in broadcasts} >= {(1, 2, 12, 64, 16), (1, 2, 12, 16, 64)}


@mlx_cpu_only
def test_mlx_causal_sdpa_keeps_the_decomposition():
    graph, xs = _attention(hq=8, s=3, t=10, dtype=F32, causal="bottom_right")
    assert_primitive_counts(lower(graph, "mlx"), {"Matmul": 2, "Softmax": 1, "Select": 1}, *xs)


def test_mlx_primitive_records_describe_inputs_and_outputs():
    graph, xs = _softmax_matmul()
    matmul, softmax = mlx_backend.primitives(lower(graph, "mlx"), *xs)
    assert (matmul.name, matmul.inputs, matmul.outputs) == (
        "Matmul",
        (((2, 4, 8), "float32"), ((2, 8, 6), "float32")),
        (((2, 4, 6), "float32"),),
    )
    assert softmax.name == "Softmax" and softmax.inputs == matmul.outputs


# ============================================================================ JAX


def test_jax_softmax_matmul():
    graph, xs = _softmax_matmul()
    assert_primitive_counts(
        lower(graph, "jax"), {"dot_general": 1, "exp": 1, "reduce_max": 1, "reduce_sum": 1, "div": 1}, *xs
    )


@pytest.mark.parametrize(
    "dtype, attrs",
    [
        (BF16, {}),
        (F32, {"causal": "top_left"}),  # is_causal
        (F32, {"causal": "bottom_right"}),  # explicit causal mask
        (F16, {}),  # the explicit form (XLA:CPU cannot jit jax.nn.dot_product_attention in float16)
        (F32, {"dv": 32}),  # the explicit form (value head dim != key head dim)
    ],
    ids=["bf16", "top_left", "bottom_right", "f16", "dv32"],
)
def test_jax_sdpa_is_two_dot_generals_and_one_exp(dtype, attrs):
    dv = attrs.pop("dv", 64)
    graph, xs = _attention(dtype=dtype, dv=dv, **attrs)
    counts = assert_primitive_counts(lower(graph, "jax"), {"dot_general": 2, "exp": 1}, *xs)
    assert counts["reduce_max"] == 1 and counts["reduce_sum"] == 1  # one softmax


def test_jax_gqa_is_never_expanded_to_query_heads():
    """No dot_general operand carries 24 heads of K or V: GQA stays grouped (B, T, Hkv, G, D layouts)."""
    graph, xs = _attention(dtype=F32)
    closed = jax_backend.jaxpr(lower(graph, "jax"), *xs)
    dots = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append([v.aval.shape for v in eqn.invars])
            for param in eqn.params.values():
                for sub in jax_backend._subjaxprs(param):
                    walk(sub)

    walk(closed.jaxpr)
    assert len(dots) == 2
    kv_operands = [shape for shapes in dots for shape in shapes if 16 in shape and 5 not in shape]
    assert kv_operands and all(np.prod(shape) == 2 * 16 * 64 for shape in kv_operands), dots


# ---------------------------------------------------------------------------- nested jaxprs


def _nested():
    """``_outer``: jits inside a jit, a switch, a scan, checkpoint and custom_jvp (built on use: jax is optional)."""

    @jax.jit
    def _inner(x):
        return lax.sin(x)

    @jax.jit
    def _middle(x):
        return lax.add(_inner(x), _inner(lax.cos(x)))

    def _outer(x, index):
        y = _middle(x)
        z = lax.switch(index, [lax.exp, lax.neg], y)
        w, _ = lax.scan(lambda c, _: (lax.tanh(c), None), z, None, length=3)
        return jax.checkpoint(lax.log)(w) + jax.nn.relu(w)  # checkpoint and custom_jvp bodies

    return _outer


def test_walker_counts_nested_jit_cond_scan_checkpoint_and_custom_jvp():
    closed = jax.make_jaxpr(_nested())(np.ones(4, np.float32), np.int32(0))
    top = Counter(eqn.primitive.name for eqn in closed.jaxpr.eqns)
    assert top["sin"] == top["tanh"] == top["log"] == 0  # they only exist inside sub-jaxprs
    counts: Counter = Counter()
    jax_backend._walk(closed.jaxpr, counts)
    expected = {
        "jit": 4,  # _middle, _inner twice inside it (one shared sub-jaxpr, two call sites), relu's body
        "custom_jvp_call": 1,
        "max": 1,  # relu: custom_jvp_call -> jit -> max, two levels down
        "sin": 2,
        "cos": 1,
        "cond": 1,
        "exp": 1,  # both switch branches are counted once
        "neg": 1,
        "scan": 1,
        "tanh": 1,  # a scan body is counted once, not per iteration
        "log": 1,
    }
    assert {name: counts[name] for name in expected} == expected


def test_program_wrapped_in_jit_counts_inner_primitives():
    graph, xs = _softmax_matmul()
    program = lower(graph, "jax")
    plain = count_primitives(program, *xs)
    raw = program.fn
    program.fn = jax.jit(raw)
    assert count_primitives(program, *xs) == plain + Counter({"jit": 1})
    program.fn = lambda a, b: jax.jit(lambda a, b: jax.jit(raw)(a, b))(a, b)
    assert count_primitives(program, *xs) == plain + Counter({"jit": 2})


# ============================================================================ assert_primitive_counts


@mlx_cpu_only
def test_assert_primitive_counts_returns_the_full_counter():
    graph, xs = _attention(hq=8, s=3, t=10, dtype=F32)
    program = lower(graph, "mlx")
    counts = assert_primitive_counts(program, {"Matmul": 2}, *xs)
    assert counts == count_primitives(program, *xs) and counts["Softmax"] == 1


def test_assert_primitive_counts_failure_shows_a_diff_table():
    graph, xs = _softmax_matmul()
    with pytest.raises(AssertionError) as info:
        assert_primitive_counts(lower(graph, "mlx"), {"Matmul": 2, "Softmax": 1, "Gather": 1}, *xs)
    message = str(info.value)
    lines = message.splitlines()
    assert lines[0] == "primitive counts of softmax_matmul on mlx differ:"
    assert re.fullmatch(r"\s+primitive\s+expected\s+actual", lines[1])
    row = re.compile(r"^\s+(\w+)\s+(\d+)\s+(\d+)$", re.M)
    rows = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in row.finditer(message)}
    assert rows == {"Matmul": (2, 1), "Gather": (1, 0)}  # rows only for the primitives that differ
    assert "all counts: {'Matmul': 1, 'Softmax': 1}" in message
    assert len({len(line) for line in lines[1:4]}) == 1  # header and rows are right-aligned in one table


def test_exact_flags_unexpected_primitives():
    graph, xs = _softmax_matmul()
    program = lower(graph, "jax")
    assert_primitive_counts(program, {"dot_general": 1, "exp": 1}, *xs)  # unlisted primitives are ignored ...
    with pytest.raises(AssertionError) as info:
        assert_primitive_counts(program, {"dot_general": 1, "exp": 1}, *xs, exact=True)  # ... unless exact
    message = str(info.value)
    for unexpected in ("reduce_max", "reduce_sum", "div", "sub"):
        assert re.search(rf"^\s+{unexpected}\s+0\s+[1-9]\d*$", message, re.M), unexpected
    assert not re.search(r"^\s+(dot_general|exp)\s", message, re.M)  # matching rows are not listed


def test_zero_expected_catches_a_present_primitive():
    graph, xs = _softmax_matmul()
    with pytest.raises(AssertionError, match=r"Softmax\s+0\s+1"):
        assert_primitive_counts(lower(graph, "mlx"), {"Softmax": 0}, *xs)


def test_counting_needs_a_backend_target():
    graph, xs = _softmax_matmul()
    numpy_program = lower(graph, "numpy")
    with pytest.raises(ValueError, match="no primitive view for target 'numpy'; targets with one: mlx, jax"):
        count_primitives(numpy_program, *xs)
    with pytest.raises(ValueError, match="primitives\\(\\) needs a program lowered to 'mlx', got target 'jax'"):
        mlx_backend.primitives(lower(graph, "jax"), *xs)
    with pytest.raises(ValueError, match="jaxpr\\(\\) needs a program lowered to 'jax', got target 'mlx'"):
        jax_backend.jaxpr(lower(graph, "mlx"), *xs)
