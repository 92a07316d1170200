"""MLX's affine quantization (``dequantize``, ``quantized_matmul``) on every target, against MLX itself.

``dequantize`` is bit-exact on every target: MLX rounds ``scale * q`` to the scales' dtype, then the sum,
and the numpy and JAX programs round the same way. ``quantized_matmul`` lowered to MLX is
``mx.quantized_matmul`` bit for bit; numpy (float64, rounded once) and JAX (float32 accumulation)
sum in their own order, so they are compared within rounding, and the numpy program bit for bit with a
float64 product of ``mx.dequantize``'s own matrix.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import DType, Graph, ShapeError, TensorType
from attnpass.ir.core.printer import parse_type
from attnpass.ir.core.registry import get_op
from attnpass.ir.dialects.evaluate import rounded, wide
from attnpass.ir.dialects.quant import BITS, GROUP_SIZES
from attnpass.lowering import lower
from tests.util import assert_bits_equal, lazy_import, one_op_graph, random_array, requires, target_params

mx = lazy_import("mlx.core")

DTYPES = ["float32", "bfloat16", "float16"]


def _quantized(rng, shape, dtype: str, group_size: int, bits: int):
    """``mx.quantize`` of a random matrix: the MLX triple, and its numpy form (words as int32, their bits)."""
    from attnpass.lowering.targets.mlx.target import to_numpy

    w = mx.array(random_array(rng, shape, "float32", low=-3.0, high=3.0)).astype(getattr(mx, dtype))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    host = [np.array(wq).view(np.int32), to_numpy(scales), to_numpy(biases)]
    return (wq, scales, biases), host


def _types(*arrays) -> list[TensorType]:
    return [TensorType(a.shape, DType.from_numpy(a.dtype)) for a in arrays]


def _mlx_numpy(x):
    from attnpass.lowering.targets.mlx.target import to_numpy

    return to_numpy(x)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@requires("mlx.core")
def test_dequantize_is_mx_dequantize_bit_for_bit(rng, target, dtype, bits):
    """Every bit width (3, 5 and 6 bits straddle words) and group size, every float dtype: MLX's bits."""
    group_size = GROUP_SIZES[bits % len(GROUP_SIZES)]
    (wq, scales, biases), host = _quantized(rng, (2, 3, 256), dtype, group_size, bits)
    attrs = {"group_size": group_size, "bits": bits, "dtype": dtype}
    got = run(lower(one_op_graph("dequantize", _types(*host), attrs), target), *host)
    expected = _mlx_numpy(mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits))
    assert_bits_equal(np.asarray(got), expected)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@requires("mlx.core")
def test_dequantize_to_another_dtype_rounds_in_the_scales_dtype_first(rng, target):
    """bfloat16 scales, float32 result: MLX's bfloat16 values, widened (not scale * q + bias in float32)."""
    (wq, scales, biases), host = _quantized(rng, (4, 128), "bfloat16", 64, 4)
    attrs = {"group_size": 64, "bits": 4, "dtype": "float32"}
    got = np.asarray(run(lower(one_op_graph("dequantize", _types(*host), attrs), target), *host))
    expected = _mlx_numpy(mx.dequantize(wq, scales, biases, group_size=64, bits=4, dtype=mx.float32))
    assert_bits_equal(got, expected)
    scale, bias = (np.repeat(wide(a), 64, -1) for a in host[1:])
    in_float32 = rounded(scale * _unpacked(host[0], 4) + bias, "float32")
    assert not np.array_equal(got, in_float32)  # the case tells the two roundings apart


def _unpacked(words: np.ndarray, bits: int) -> np.ndarray:
    """The packed integers, bit by bit from Python ints (independent of the library's unpacking)."""
    rows = words.reshape(-1, words.shape[-1]).view(np.uint32)
    k = words.shape[-1] * 32 // bits
    out = np.empty((rows.shape[0], k))
    for r, row in enumerate(rows):
        stream = sum(int(v) << (32 * i) for i, v in enumerate(row))
        out[r] = [(stream >> (bits * j)) & ((1 << bits) - 1) for j in range(k)]
    return out.reshape(words.shape[:-1] + (k,))


@pytest.mark.parametrize("bits", BITS)
@requires("mlx.core")
def test_mx_quantize_packs_a_little_endian_bit_stream(rng, bits):
    """The layout the dialect documents: MLX's own dequantize equals scale * q + bias of the stream's fields."""
    (wq, scales, biases), host = _quantized(rng, (3, 128), "float32", 32, bits)
    q = _unpacked(host[0], bits)
    s, b = (np.repeat(a.astype(np.float32), 32, -1) for a in host[1:])
    two_roundings = (s * q.astype(np.float32)).astype(np.float32) + b
    assert_bits_equal(_mlx_numpy(mx.dequantize(wq, scales, biases, group_size=32, bits=bits)), two_roundings)


def _assert_within_summation_error(actual: np.ndarray, expected: np.ndarray, x: np.ndarray, w: np.ndarray, dtype: str):
    """|actual - expected| <= (K + 2) eps |x| @ |w|: two sums of K products, each within the sequential-summation
    bound in ``dtype`` (MLX's CPU kernel accumulates in the dtype itself, see below) plus a final rounding."""
    eps = float(DType.parse(dtype).finfo.eps)
    bound = (x.shape[-1] + 2) * eps * np.matmul(np.abs(wide(x)), np.abs(wide(w)))
    err = np.abs(wide(actual) - wide(expected))
    assert actual.dtype == expected.dtype
    assert np.all(err <= bound), f"{int(np.sum(err > bound))} beyond the bound; worst excess {np.max(err - bound)}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8, 3])
@pytest.mark.parametrize("transpose", [True, False])
@requires("mlx.core", "jax")
def test_quantized_matmul_is_mx_quantized_matmul(rng, dtype, bits, transpose):
    """MLX bit for bit; numpy bit for bit with float64 x @ mx.dequantize(w), rounded once; numpy and JAX
    within summation error of MLX's.

    x [2, 1, 3, D] against w [2, 4, N, K] (batch dims broadcast, as mlx-lm's GQA fold uses them)."""
    (wq, scales, biases), host = _quantized(rng, (2, 4, 64, 128), dtype, 64, bits)
    d = 128 if transpose else 64
    xm = mx.array(random_array(rng, (2, 1, 3, d), "float32")).astype(getattr(mx, dtype))
    x = _mlx_numpy(xm)
    attrs = {"transpose": transpose, "group_size": 64, "bits": bits}
    graph = one_op_graph("quantized_matmul", _types(x, *host), attrs)
    expected = _mlx_numpy(mx.quantized_matmul(xm, wq, scales, biases, transpose=transpose, group_size=64, bits=bits))
    assert graph.node(graph.outputs[0]).type.shape == expected.shape
    assert_bits_equal(np.asarray(run(lower(graph, "mlx"), x, *host)), expected)
    w = _mlx_numpy(mx.dequantize(wq, scales, biases, group_size=64, bits=bits))
    w = np.swapaxes(w, -1, -2) if transpose else w
    float64 = rounded(np.matmul(wide(x), wide(w)), dtype)
    assert_bits_equal(np.asarray(run(lower(graph, "numpy"), x, *host)), float64)
    _assert_within_summation_error(float64, expected, x, w, dtype)
    _assert_within_summation_error(np.asarray(run(lower(graph, "jax"), x, *host)), expected, x, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@requires("mlx.core")
def test_mlx_cpu_quantized_matmul_accumulates_in_the_dtype(rng, dtype):
    """What the tolerance above rests on: MLX 0.32's CPU quantized_matmul adds the products one by one in
    the dtype (each product rounded to it), so half-float results sit several ulps from the float64 sum."""
    (wq, scales, biases), _ = _quantized(rng, (16, 128), dtype, 64, 4)
    xm = mx.array(random_array(rng, (3, 128), "float32")).astype(getattr(mx, dtype))
    x, w = _mlx_numpy(xm), _mlx_numpy(mx.dequantize(wq, scales, biases, group_size=64, bits=4))
    acc = np.zeros((3, 16))
    for k in range(128):
        acc = rounded(wide(acc) + wide(rounded(wide(x[:, k : k + 1]) * wide(w[:, k])[None], dtype)), dtype)
    got = _mlx_numpy(mx.quantized_matmul(xm, wq, scales, biases, group_size=64, bits=4))
    assert_bits_equal(got, acc)


# Shape rules: the IR accepts what MLX accepts, with MLX's result shape; the rest is a named error.
_BAD = st.sampled_from([None, "bits", "group", "scales", "biases_dtype", "words"])


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    group_size=st.sampled_from(GROUP_SIZES),
    groups=st.integers(1, 3),
    rows=st.integers(1, 5),
    batch=st.lists(st.integers(1, 3), max_size=2),
    bad=_BAD,
)
@requires("mlx.core")
def test_dequantize_shape_rule_against_mlx(bits, group_size, groups, rows, batch, bad):
    words = group_size * groups * bits // 32  # group sizes are multiples of 32: whole words
    lead = tuple(batch) + (rows,)
    wq = TensorType(lead + (words,), "int32")
    sb = TensorType(lead + (groups,), "float16")
    biases = sb
    attrs = {"group_size": group_size, "bits": bits, "dtype": "float32"}
    if bad == "bits":
        attrs["bits"] = 7
    elif bad == "group":
        attrs["group_size"] = 16
    elif bad == "scales":
        sb = TensorType(lead + (groups + 1,), "float16")
    elif bad == "biases_dtype":
        biases = TensorType(lead + (groups,), "bfloat16")
    elif bad == "words":
        wq = TensorType(lead + (words + 1,), "int32")
    op = get_op("dequantize")
    if bad is None:
        got = op.result_type([wq, sb, biases], attrs)
        packed = mx.zeros(wq.shape, dtype=mx.uint32)
        scale = mx.zeros(sb.shape, dtype=mx.float16)
        out = mx.dequantize(packed, scale, scale, group_size=group_size, bits=bits, dtype=mx.float32)
        assert got == TensorType(tuple(out.shape), "float32")
        return
    with pytest.raises(ShapeError, match=r"^dequantize: ") as err:
        op.result_type([wq, sb, biases], attrs)
    message = str(err.value)
    if bad in ("scales", "words"):
        assert str(wq) in message  # names the shapes
    if bad in ("bits", "group"):
        assert "valid:" in message


@pytest.mark.parametrize(
    ("types", "attrs", "match"),
    [
        (["f32[2,3,32]", "i32[5,8]", "f32[5,1]", "f32[5,1]"], {}, r"dims differ: x f32\[2,3,32\] @ w \[..., 5, 64\]"),
        (["f32[3,64]", "i32[5,8]", "f32[5,1]", "f32[5,1]"], {"transpose": False}, r"dims differ: .*64 != 5"),
        (["bf16[3,64]", "i32[5,8]", "f32[5,1]", "f32[5,1]"], {}, r"x and scales must share one float dtype"),
        (["f32[3]", "i32[5,8]", "f32[5,1]", "f32[5,1]"], {}, r"x must have rank >= 2"),
        (["f32[3,64]", "f32[5,8]", "f32[5,1]", "f32[5,1]"], {}, r"wq \(packed uint32 words, held as int32\)"),
        (["f32[3,64]", "i32[5,8]", "f32[5,1]", "f32[5,1]"], {"bits": 7}, r"bits=7 .* valid: 1, 2, 3, 4, 5, 6, 8"),
        (["f32[3,64]", "i32[5,8]", "f32[5,2]", "f32[5,2]"], {}, r"scales f32\[5,2\] must be \[5,1\]"),
        (["f32[2,3,64]", "i32[3,5,8]", "f32[3,5,1]", "f32[3,5,1]"], {}, r"do not broadcast"),
    ],
)
def test_quantized_matmul_shape_errors_name_the_op_and_shapes(types, attrs, match):
    with pytest.raises(ShapeError, match=r"^quantized_matmul.*" + match):
        get_op("quantized_matmul").result_type([parse_type(t) for t in types], attrs)


def test_quantized_matmul_shape_rule():
    """x [..., M, D] @ w^T [K=D, N] -> [..., M, N]; transpose=False: x @ w [N=D, K] -> [..., M, K]."""
    rule = get_op("quantized_matmul").result_type
    packed = [parse_type(t) for t in ("i32[2,1,96,16]", "bf16[2,1,96,2]", "bf16[2,1,96,2]")]  # w [2,1,96,128], 4 bits
    assert rule([parse_type("bf16[4,3,128]"), *packed], {"group_size": 64}) == parse_type("bf16[2,4,3,96]")
    plain = rule([parse_type("bf16[3,96]"), *packed], {"group_size": 64, "transpose": False})
    assert plain == parse_type("bf16[2,1,3,128]")


def test_quant_graphs_round_trip_through_text_and_json():
    from attnpass.ir.core.printer import format_graph, parse_graph
    from attnpass.ir.core.serialize import graph_from_json, graph_to_json

    types = [parse_type(t) for t in ("bf16[3,128]", "i32[5,16]", "bf16[5,2]", "bf16[5,2]")]
    graphs = [
        one_op_graph("quantized_matmul", types, {"group_size": 64, "bits": 4}),
        one_op_graph("dequantize", types[1:], {"group_size": 32, "bits": 8, "dtype": "float32"}),
    ]
    for graph in graphs:
        assert graph_from_json(graph_to_json(graph)) == graph
        assert parse_graph(format_graph(graph)) == graph


@requires("mlx.core")
def test_mlx_program_is_one_quantized_matmul_on_the_packed_words():
    """The MLX lowering never dequantizes the matrix: a View of the int32 words as uint32, then QuantizedMatmul."""
    from attnpass.lowering.targets.mlx.target import count_primitives

    types = [parse_type(t) for t in ("f32[3,128]", "i32[5,16]", "f32[5,2]", "f32[5,2]")]
    program = lower(one_op_graph("quantized_matmul", types, {"group_size": 64, "bits": 4}), "mlx")
    args = [np.zeros(t.shape, t.dtype.numpy) for t in types]
    assert count_primitives(program, *args) == {"View": 1, "QuantizedMatmul": 1}


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", DTYPES)
@requires("mlx.core")
def test_dequantize_special_scales_and_biases_are_mx_dequantize(rng, target, dtype):
    """inf, NaN (a float32 NaN with only low payload bits too), subnormals, the largest finite values and signed
    zeros as scales and biases, under random words: MLX's values (NaN payloads aside).

    XLA on CPU flushes float32 subnormals (docs/guide.md), so JAX with float32 or bfloat16 (computed in float32)
    gets the smallest normal instead of a subnormal operand, and MLX's subnormal results flushed to signed zero."""
    info = DType.parse(dtype).finfo
    tiny, big = float(info.tiny), float(info.max)
    flushes = target == "jax" and dtype != "float16"
    small = tiny if flushes else tiny / 4
    special = np.array([np.inf, -np.inf, np.nan, small, big, -big, 0.0, -0.0, tiny, 1e-3, 3.0, -7.5, 1.0, 2.0, 0.5, -1])
    scales, biases = (rounded(v, dtype).reshape(8, 2) for v in (special, special[::-1]))
    if dtype == "float32":
        scales[0, 0] = np.array([0x7F800001], np.uint32).view(np.float32)[0]
    words = rng.integers(0, 2**32, (8, 16), dtype=np.uint64).astype(np.uint32)
    expected = _mlx_numpy(mx.dequantize(mx.array(words), _to_mlx(scales), _to_mlx(biases), group_size=64, bits=4))
    host = [words.view(np.int32), scales, biases]
    attrs = {"group_size": 64, "bits": 4, "dtype": dtype}
    got = np.asarray(run(lower(one_op_graph("dequantize", _types(*host), attrs), target), *host))
    if flushes:
        expected = np.where(np.abs(wide(expected)) < tiny, np.copysign(0.0, wide(expected)), expected).astype(got.dtype)
    nan = np.isnan(wide(expected))
    assert nan.any() and np.isinf(wide(expected)).any()
    np.testing.assert_array_equal(np.isnan(wide(got)), nan)
    assert_bits_equal(np.where(nan, 0, got).astype(got.dtype), np.where(nan, 0, expected).astype(expected.dtype))


def _to_mlx(a: np.ndarray):
    from attnpass.lowering.targets.mlx.target import from_numpy

    return from_numpy(a)


def _groups_to_quantize(rng, dtype: str, group_size: int) -> np.ndarray:
    """w [6, 4 * group_size] in ``dtype``: random groups of several magnitudes, and groups that take each branch
    of MLX's rule: all zeros (q0 = 0: bias 0), one constant (the 1e-7 scale floor), only positive, only negative,
    the min of larger magnitude (a negative scale's edge) and a single spike."""
    w = rng.standard_normal((6, 4 * group_size)) * rng.choice([1e-3, 1.0, 300.0], (6, 1))
    special = [0.0, 1.5, None, None, None, None]
    for row, value in enumerate(special):
        if value is not None:
            w[row, :group_size] = value
    w[2, :group_size] = np.abs(w[2, :group_size]) + 1.0
    w[3, :group_size] = -np.abs(w[3, :group_size]) - 2.0
    w[4, :group_size] = np.linspace(-5.0, 1.0, group_size)
    w[5, :group_size] = 0.0
    w[5, 7] = 9.0
    return rounded(w, dtype)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", [1, 4, 8])
@requires("mlx.core")
def test_quantize_is_mx_quantize_bit_for_bit(rng, target, dtype, group_size, bits):
    """Words, scales and biases: MLX's raw bits on every target (a graph of the three outputs); 1 bit has a rule
    of its own. (Here bfloat16 with 8 bits failed on JAX while XLA divided by the broadcast scale through its
    reciprocal: a quotient of exactly 115.5 came out 115.49999.)"""
    w = _groups_to_quantize(rng, dtype, group_size)
    graph = Graph("quantize")
    x = graph.add_input("w", TensorType(w.shape, dtype))
    attrs = {"group_size": group_size, "bits": bits}
    graph.set_outputs([graph.add_node("quantize", [x], {**attrs, "output": p}) for p in ("wq", "scales", "biases")])
    got = run(lower(graph, target), w)
    expected = mx.quantize(_to_mlx(w), group_size=group_size, bits=bits)
    assert_bits_equal(np.asarray(got[0]), np.array(expected[0]).view(np.int32))
    for part, want in zip(got[1:], expected[1:]):
        assert_bits_equal(np.asarray(part), _mlx_numpy(want))


@pytest.mark.parametrize("bits", BITS)
@requires("mlx.core")
def test_quantize_every_width_is_mx_quantize(rng, bits):
    """Widths whose elements straddle words (3, 5, 6) and 1 and 2 bits: the numpy reference and the MLX program."""
    w = _groups_to_quantize(rng, "float32", 32)
    expected = [np.array(a) for a in mx.quantize(_to_mlx(w), group_size=32, bits=bits)]
    for target in ("numpy", "mlx"):
        for part, want in zip(("wq", "scales", "biases"), expected):
            attrs = {"group_size": 32, "bits": bits, "output": part}
            got = np.asarray(run(lower(one_op_graph("quantize", _types(w), attrs), target), w))
            assert_bits_equal(got, want.view(np.int32) if part == "wq" else want)


@requires("mlx.core")
def test_quantize_then_dequantize_is_within_a_step(rng):
    """What quantization promises: each element comes back within one quantization step (|scale|) of itself,
    within half a step unless the far end of its group was clipped (the scale is snapped to ``edge / q0`` so
    that the edge comes back exactly, which may shrink it: the far end then lies up to one step out), and
    the edge of each group exactly."""
    from attnpass.ir.dialects.evaluate import dequantize, quantize

    w = _groups_to_quantize(rng, "float32", 64)[1:]  # the all-zero group has no step
    parts = [quantize(w, group_size=64, bits=4, output=p) for p in ("wq", "scales", "biases")]
    back = dequantize(*parts, group_size=64, bits=4, dtype="float32")
    step = np.repeat(np.abs(wide(parts[1])), 64, axis=-1)
    err = np.abs(wide(back) - wide(w))
    assert np.all(err <= step * (1 + 1e-5) + 1e-6 * np.abs(wide(w)))
    inside = np.abs(wide(w) - np.repeat(wide(parts[2]), 64, -1)) <= 15 * step * (1 - 1e-5)  # not clipped
    assert np.all(err[inside] <= step[inside] / 2 * (1 + 1e-5) + 1e-6 * np.abs(wide(w))[inside])
    edges = np.abs(w.reshape(5, 4, 64)).argmax(-1)
    edge_values = np.take_along_axis(w.reshape(5, 4, 64), edges[..., None], -1)
    assert_bits_equal(np.take_along_axis(back.reshape(5, 4, 64), edges[..., None], -1), edge_values)


@pytest.mark.parametrize(
    ("w", "attrs", "match"),
    [
        ("f32[4,64]", {"bits": 7}, r"bits=7 is not an affine quantization width; valid: 1, 2, 3, 4, 5, 6, 8"),
        ("f32[4,64]", {"group_size": 16}, r"group_size=16 .* valid: 32, 64, 128"),
        ("f32[64]", {}, r"w f32\[64\] must have rank >= 2"),
        ("f32[4,96]", {}, r"w f32\[4,96\] .*divisible by 64"),
        ("i32[4,64]", {}, r"w has dtype int32"),
    ],
)
def test_quantize_shape_errors_name_the_op_and_values(w, attrs, match):
    with pytest.raises(ShapeError, match=r"^quantize: " + match):
        get_op("quantize").result_type([parse_type(w)], {"group_size": 64, "bits": 4, "output": "wq", **attrs})


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    group_size=st.sampled_from(GROUP_SIZES),
    groups=st.integers(1, 3),
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=3),
)
@requires("mlx.core")
def test_quantize_shape_rule_against_mlx(bits, group_size, groups, lead):
    shape = tuple(lead) + (group_size * groups,)
    outs = mx.quantize(mx.zeros(shape, dtype=mx.bfloat16), group_size=group_size, bits=bits)
    for part, out in zip(("wq", "scales", "biases"), outs):
        got = get_op("quantize").result_type(
            [TensorType(shape, "bfloat16")], {"group_size": group_size, "bits": bits, "output": part}
        )
        assert got == TensorType(tuple(out.shape), "int32" if part == "wq" else "bfloat16")
