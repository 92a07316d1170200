"""Types, the op registry and every core op's shape rule: valid cases, invalid cases, and properties.

Shape rules are exercised directly through ``get_op(name).result_type(operand_types, attrs)``;
no graph and no backend are needed. Error tests assert on the message (the op, the offending
shapes or values), not only on the exception type.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.ir import (
    AttnpassError,
    DType,
    GraphFormatError,
    ShapeError,
    TensorType,
    get_op,
    register,
    registered_ops,
)
from attnpass.ir.core.types import check_identifier

F32, F16, BF16, I32, BOOL = DType.float32, DType.float16, DType.bfloat16, DType.int32, DType.bool

# Every op of the core set, each exercised below (checked by test_core_op_set_is_registered).
CORE_OPS = {
    "input", "constant", "add", "sub", "mul", "div", "maximum", "neg", "exp", "relu", "where", "cast",
    "reshape", "transpose", "slice", "concat", "take", "sum", "max", "matmul", "softmax", "sdpa",
}  # fmt: skip
BINARY = ["add", "sub", "mul", "div", "maximum"]
UNARY = ["neg", "exp", "relu"]

PROPERTY_SETTINGS = settings(max_examples=60, deadline=None)


def T(shape, dtype=F32) -> TensorType:
    return TensorType(tuple(shape), dtype)


def infer(op: str, *operands: TensorType, **attrs) -> TensorType:
    return get_op(op).result_type(list(operands), attrs)


def raises(match: str):
    """pytest.raises(ShapeError) whose message must contain ``match`` literally."""
    return pytest.raises(ShapeError, match=re.escape(match))


# ============================================================================ types


def test_tensor_type_basics():
    t = T((1, 24, 5, 256), BF16)
    assert str(t) == "bf16[1,24,5,256]"
    assert (t.rank, t.size, t.nbytes) == (4, 24 * 5 * 256, 24 * 5 * 256 * 2)
    scalar = T((), F32)
    assert (str(scalar), scalar.rank, scalar.size, scalar.nbytes) == ("f32[]", 0, 1, 4)
    assert T((0, 3), I32).nbytes == 0
    # numpy integer dims are normalized to int; short dtype names are accepted.
    t2 = TensorType((np.int64(2), 3), "bf16")
    assert t2.shape == (2, 3) and type(t2.shape[0]) is int and t2.dtype is BF16
    assert T((2, 3)) == TensorType([2, 3], "float32")
    assert hash(T((2, 3))) == hash(TensorType((2, 3), "f32"))


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (True, 2), (2.0,), ("2",)])
def test_tensor_type_rejects_bad_shapes(shape):
    with raises(repr(shape)):
        TensorType(shape, F32)


def test_dtype_parse_and_properties():
    assert {d: d.itemsize for d in DType} == {F32: 4, F16: 2, BF16: 2, I32: 4, BOOL: 1}
    assert [d.short for d in DType] == ["f32", "f16", "bf16", "i32", "bool"]
    for d in DType:
        assert DType.parse(d.value) is d and DType.parse(d.short) is d and DType.parse(d) is d
        assert DType.parse(f"  {d.value.upper()} ") is d
    assert [d.is_float for d in DType] == [True, True, True, False, False]
    assert BF16.numpy.itemsize == 2 and BF16.numpy.name == "bfloat16"
    assert DType.from_numpy(np.dtype("float16")) is F16
    assert DType.from_numpy(BF16.numpy) is BF16


@pytest.mark.parametrize("bad", ["float64", "int8", "", 3, None])
def test_dtype_parse_rejects_unknown(bad):
    with pytest.raises(ShapeError, match=r"unsupported dtype .*valid dtypes: float32, float16, bfloat16, int32, bool"):
        DType.parse(bad)


@pytest.mark.parametrize("name", ["x", "_x1", "Q_proj", "sdpa_12"])
def test_identifier_ok(name):
    assert check_identifier(name) == name


@pytest.mark.parametrize("name", ["", "1x", "x y", "x; import os", "class", "None", "lambda", "é", "a.b", 3])
def test_identifier_rejected(name):
    with pytest.raises(GraphFormatError, match=r"invalid name .*must match"):
        check_identifier(name)


# ============================================================================ registry


def test_core_op_set_is_registered():
    ops = registered_ops()
    assert CORE_OPS <= set(ops)
    families = {name: ops[name].family for name in CORE_OPS}
    assert families["sdpa"] == families["matmul"] == families["softmax"] == "attention"
    assert {families[n] for n in BINARY + UNARY + ["where"]} == {"elementwise"}
    assert families["sum"] == families["max"] == "reduction"


def test_unknown_op():
    with pytest.raises(ShapeError, match=r"unknown op 'conv2d'; registered ops: .*sdpa"):
        get_op("conv2d")


def test_register_twice_is_refused_and_leaves_registry_unchanged():
    before = registered_ops()
    with pytest.raises(ValueError, match="'add' is already registered"):
        register(get_op("add"))
    assert registered_ops() == before


def test_unknown_attribute_names_op_and_valid_set():
    with raises("softmax: unknown attribute(s) axiss; valid attributes: axis, precise"):
        infer("softmax", T((2, 3)), axiss=0)
    with raises("add: unknown attribute(s) axis; valid attributes: none"):
        infer("add", T((2,)), T((2,)), axis=0)


@pytest.mark.parametrize(
    "op, operands, attrs, message",
    [
        ("transpose", [T((2, 3))], {}, "transpose: missing required attribute perm (ints)"),
        ("cast", [T((2, 3))], {}, "cast: missing required attribute dtype (dtype)"),
        ("reshape", [T((2, 3))], {}, "reshape: missing required attribute shape (ints)"),
        ("sum", [T((2, 3))], {"keepdims": True}, "sum: missing required attribute axes (ints)"),
        ("concat", [T((2, 3))], {}, "concat: missing required attribute axis (int)"),
    ],
)
def test_missing_required_attribute(op, operands, attrs, message):
    with raises(message):
        infer(op, *operands, **attrs)


@pytest.mark.parametrize(
    "op, operands, attrs, message",
    [
        ("transpose", [T((2, 3))], {"perm": "10"}, "transpose: attribute perm: expected a tuple of ints, got '10'"),
        ("transpose", [T((2, 3))], {"perm": (1, True)}, "transpose: attribute perm: expected an int, got True"),
        ("softmax", [T((2, 3))], {"axis": 1.0}, "softmax: attribute axis: expected an int, got 1.0"),
        ("softmax", [T((2, 3))], {"precise": 1}, "softmax: attribute precise: expected a bool, got 1"),
        ("cast", [T((2, 3))], {"dtype": "float64"}, "cast: attribute dtype: unsupported dtype 'float64'"),
        ("constant", [], {"value": 1.0, "shape": (), "dtype": F32}, "constant: attribute value: expected a flat tuple"),
        (
            "constant",
            [],
            {"value": ("a",), "shape": (), "dtype": F32},
            "constant: attribute value: expected numbers, got 'a'",
        ),
    ],
)
def test_wrongly_typed_attribute(op, operands, attrs, message):
    with raises(message):
        infer(op, *operands, **attrs)


def test_attributes_are_normalized_in_spec_order_with_defaults():
    opdef = get_op("sdpa")
    variants = {"logit_softcap": None, "window": None}
    assert opdef.normalize_attrs({"causal": "top_left", "scale": 1}) == {"scale": 1.0, "causal": "top_left", **variants}
    assert list(opdef.normalize_attrs({"causal": "top_left", "scale": 1})) == ["scale", "causal", *variants]
    assert opdef.normalize_attrs({}) == {"scale": None, "causal": "none", **variants}
    assert get_op("transpose").normalize_attrs({"perm": [1, 0]}) == {"perm": (1, 0)}
    assert get_op("cast").normalize_attrs({"dtype": "bf16"}) == {"dtype": BF16}


@pytest.mark.parametrize(
    "op, n, message",
    [
        ("add", 1, "add: expected 2 operand(s) (x, y), got 1"),
        ("exp", 2, "exp: expected 1 operand(s) (x), got 2"),
        ("where", 2, "where: expected 3 operand(s) (cond, x, y), got 2"),
        ("sdpa", 2, "sdpa: expected 3 operand(s) (q, k, v), got 2"),
        (
            "sdpa",
            4,
            "sdpa: expected 3 operand(s) (q, k, v), got 4; optional operands (mask?, sinks?) are given by name",
        ),
        ("concat", 0, "concat: expected at least 1 operand(s) (*xs), got 0"),
        ("input", 1, "input: expected 0 operand(s) (), got 1"),
    ],
)
def test_arity(op, n, message):
    with raises(message):
        get_op(op).check_operands(n)


# ============================================================================ sources


def test_input_rule():
    assert infer("input", shape=(2, 3), dtype="bf16") == T((2, 3), BF16)
    assert get_op("input").normalize_attrs({"shape": (2,), "dtype": F32})["role"] == "streamed"
    assert infer("input", shape=(), dtype=BOOL, role="resident") == T((), BOOL)


def test_input_rule_errors():
    with raises("input: attribute role: expected one of 'streamed', 'resident', got 'pinned'"):
        infer("input", shape=(2,), dtype=F32, role="pinned")
    with raises("input: shape [2, -1] has negative dims"):
        infer("input", shape=(2, -1), dtype=F32)
    with raises("input: attribute dtype: unsupported dtype 'float64'"):
        infer("input", shape=(2,), dtype="float64")


def test_constant_rule():
    assert infer("constant", value=(1.0,), shape=(2, 3), dtype=F32) == T((2, 3))  # splat
    assert infer("constant", value=(1, 2, 3, 4, 5, 6), shape=(2, 3), dtype=I32) == T((2, 3), I32)
    assert infer("constant", value=(True, False), shape=(2,), dtype=BOOL) == T((2,), BOOL)
    assert infer("constant", value=(), shape=(0, 3), dtype=F32) == T((0, 3))
    assert infer("constant", value=(-math.inf, math.nan), shape=(2,), dtype=BF16) == T((2,), BF16)
    assert infer("constant", value=(2.0,), shape=(), dtype=I32) == T((), I32)  # integral float is fine


@pytest.mark.parametrize(
    "attrs, message",
    [
        (
            {"value": (1.0, 2.0, 3.0), "shape": (2, 2), "dtype": F32},
            "constant: 3 values for shape [2, 2] (need 1 or 4)",
        ),
        ({"value": (), "shape": (2,), "dtype": F32}, "constant: 0 values for shape [2] (need 1 or 2)"),
        ({"value": (1.0,), "shape": (-1,), "dtype": F32}, "constant: shape [-1] has negative dims"),
        ({"value": (1.5,), "shape": (), "dtype": I32}, "constant: value 1.5 is not an integer, but dtype is int32"),
        ({"value": (math.nan,), "shape": (), "dtype": I32}, "constant: value nan is not an integer"),
        ({"value": (2,), "shape": (), "dtype": BOOL}, "constant: value 2 is not a bool, but dtype is bool"),
    ],
)
def test_constant_rule_errors(attrs, message):
    with raises(message):
        infer("constant", **attrs)


# ============================================================================ elementwise


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize(
    "a, b, out",
    [
        ((2, 3), (2, 3), (2, 3)),
        ((2, 3), (3,), (2, 3)),
        ((2, 1), (1, 3), (2, 3)),
        ((), (4, 5), (4, 5)),
        ((1, 24, 5, 64), (5, 64), (1, 24, 5, 64)),
        ((0, 3), (1, 3), (0, 3)),
    ],
)
def test_binary_broadcasting(op, a, b, out):
    assert infer(op, T(a), T(b)) == T(out)
    assert infer(op, T(b), T(a)) == T(out)


@pytest.mark.parametrize("op", BINARY)
def test_binary_errors(op):
    with raises(f"{op}: shapes [2,3], [4] do not broadcast"):
        infer(op, T((2, 3)), T((4,)))
    with raises(f"{op}: operands must share one dtype, got f32[2], bf16[2]; insert a cast"):
        infer(op, T((2,)), T((2,), BF16))
    with raises(f"{op}: operand has dtype bool (bool[2])"):
        infer(op, T((2,), BOOL), T((2,), BOOL))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "maximum"])
def test_binary_int32_allowed(op):
    assert infer(op, T((2, 1), I32), T((3,), I32)) == T((2, 3), I32)


def test_div_requires_float():
    with raises("div: operand has dtype int32 (i32[2]); valid: float32, float16, bfloat16"):
        infer("div", T((2,), I32), T((2,), I32))
    assert infer("div", T((2,), F16), T((), F16)) == T((2,), F16)


@pytest.mark.parametrize("op", UNARY)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_unary_keeps_type(op, dtype):
    assert infer(op, T((3, 0, 2), dtype)) == T((3, 0, 2), dtype)


def test_unary_dtype_rules():
    assert infer("neg", T((2,), I32)) == T((2,), I32)
    assert infer("relu", T((2,), I32)) == T((2,), I32)
    with raises("exp: operand has dtype int32 (i32[2]); valid: float32, float16, bfloat16"):
        infer("exp", T((2,), I32))
    with raises("neg: operand has dtype bool (bool[2])"):
        infer("neg", T((2,), BOOL))
    with raises("relu: operand has dtype bool"):
        infer("relu", T((2,), BOOL))


def test_where_rule():
    assert infer("where", T((5, 1), BOOL), T((3,), BF16), T((), BF16)) == T((5, 3), BF16)
    assert infer("where", T((), BOOL), T((2, 3), I32), T((2, 3), I32)) == T((2, 3), I32)
    with raises("where: condition has dtype float32 (f32[2]); valid: bool"):
        infer("where", T((2,)), T((2,)), T((2,)))
    with raises("where: operands must share one dtype, got f32[2], f16[2]"):
        infer("where", T((2,), BOOL), T((2,)), T((2,), F16))
    with raises("where: shapes [2], [3], [2] do not broadcast"):
        infer("where", T((2,), BOOL), T((3,)), T((2,)))


# ============================================================================ layout


@pytest.mark.parametrize("src", list(DType))
@pytest.mark.parametrize("dst", list(DType))
def test_cast_any_to_any(src, dst):
    assert infer("cast", T((2, 3), src), dtype=dst) == T((2, 3), dst)


def test_reshape_rule():
    assert infer("reshape", T((2, 3, 4), BF16), shape=(6, 4)) == T((6, 4), BF16)
    assert infer("reshape", T((2, 3)), shape=(1, 6, 1)) == T((1, 6, 1))
    assert infer("reshape", T(()), shape=(1, 1)) == T((1, 1))
    assert infer("reshape", T((0, 3)), shape=(3, 0)) == T((3, 0))
    with raises("reshape: cannot reshape f32[2,3] (6 elements) to [4] (4 elements)"):
        infer("reshape", T((2, 3)), shape=(4,))
    with raises("reshape: target shape [-1, 3] has negative dims"):
        infer("reshape", T((2, 3)), shape=(-1, 3))


def test_transpose_rule():
    assert infer("transpose", T((1, 24, 5, 256)), perm=(0, 2, 1, 3)) == T((1, 5, 24, 256))
    assert infer("transpose", T(()), perm=()) == T(())
    with raises("transpose: perm [0, 0] is not a permutation of 0..1 for operand f32[2,3]"):
        infer("transpose", T((2, 3)), perm=(0, 0))
    with raises("transpose: perm [1, 0, 2] is not a permutation of 0..1"):
        infer("transpose", T((2, 3)), perm=(1, 0, 2))
    with raises("transpose: perm [-1, 0] is not a permutation"):
        infer("transpose", T((2, 3)), perm=(-1, 0))


def test_slice_rule():
    x = T((4, 10, 3), BF16)
    assert infer("slice", x, start=(0, 1, 0), stop=(4, 10, 3), step=(1, 3, 1)) == T((4, 3, 3), BF16)
    assert infer("slice", x, start=(2, 5, 3), stop=(2, 5, 3), step=(1, 1, 1)) == T((0, 0, 0), BF16)
    assert infer("slice", x, start=(0, 0, 0), stop=(4, 10, 3), step=(4, 7, 5)) == T((1, 2, 1), BF16)


@pytest.mark.parametrize(
    "start, stop, step, message",
    [
        (
            (0,),
            (2,),
            (1,),
            "slice: start/stop/step need one entry per axis of f32[2,3], got start=[0] stop=[2] step=[1]",
        ),
        (
            (0, 0),
            (2, 4),
            (1, 1),
            "slice: axis 1 of f32[2,3]: start=0 stop=4 step=1 invalid (need 0 <= start <= stop <= 3",
        ),
        ((0, 2), (2, 1), (1, 1), "slice: axis 1 of f32[2,3]: start=2 stop=1 step=1 invalid"),
        ((-1, 0), (2, 3), (1, 1), "slice: axis 0 of f32[2,3]: start=-1 stop=2 step=1 invalid"),
        (
            (0, 0),
            (2, 3),
            (1, 0),
            "slice: axis 1 of f32[2,3]: start=0 stop=3 step=0 invalid (need 0 <= start <= stop <= 3 and step >= 1)",
        ),
        ((0, 0), (2, 3), (-1, 1), "slice: axis 0 of f32[2,3]: start=0 stop=2 step=-1 invalid"),
    ],
)
def test_slice_errors(start, stop, step, message):
    with raises(message):
        infer("slice", T((2, 3)), start=start, stop=stop, step=step)


def test_concat_rule():
    assert infer("concat", T((1, 10, 5, 8)), T((1, 2, 5, 8)), axis=1) == T((1, 12, 5, 8))
    assert infer("concat", T((2, 3)), T((2, 4)), T((2, 0)), axis=-1) == T((2, 7))
    assert infer("concat", T((2, 3), I32), axis=0) == T((2, 3), I32)
    with raises("concat: operands f32[2,3], f32[3,4] differ outside axis 1"):
        infer("concat", T((2, 3)), T((3, 4)), axis=1)
    with raises("concat: operands f32[2,3], f32[2,3,1] differ outside axis 0"):
        infer("concat", T((2, 3)), T((2, 3, 1)), axis=0)
    with raises("concat: operands must share one dtype, got f32[2,3], bf16[2,3]"):
        infer("concat", T((2, 3)), T((2, 3), BF16), axis=0)
    with raises("concat: axis 2 out of range for rank 2 (valid: -2..1)"):
        infer("concat", T((2, 3)), T((2, 3)), axis=2)
    with raises("concat: axis 0 out of range for rank 0"):
        infer("concat", T(()), T(()), axis=0)


def test_take_rule():
    assert infer("take", T((1, 2, 64, 256), BF16), T((5, 8), I32), axis=2) == T((1, 2, 5, 8, 256), BF16)
    assert infer("take", T((7, 3)), T((), I32), axis=0) == T((3,))
    assert infer("take", T((7, 3)), T((4,), I32), axis=-1) == T((7, 4))
    with raises("take: indices has dtype float32 (f32[4]); valid: int32"):
        infer("take", T((7, 3)), T((4,)), axis=0)
    with raises("take: operand f32[] is a scalar; need rank >= 1"):
        infer("take", T(()), T((4,), I32), axis=0)
    with raises("take: axis -3 out of range for rank 2"):
        infer("take", T((7, 3)), T((4,), I32), axis=-3)


# ============================================================================ reductions


@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduction_rule(op):
    x = T((2, 3, 4), BF16)
    assert infer(op, x, axes=(1,)) == T((2, 4), BF16)
    assert infer(op, x, axes=(-1, 0), keepdims=True) == T((1, 3, 1), BF16)
    assert infer(op, x, axes=()) == x
    assert infer(op, x, axes=(0, 1, 2)) == T((), BF16)
    assert infer(op, T((5,), I32), axes=(0,)) == T((), I32)
    assert get_op(op).normalize_attrs({"axes": (0,)})["keepdims"] is False


@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduction_errors(op):
    with raises(f"{op}: repeated axes [0, -2] for operand f32[2,3]"):
        infer(op, T((2, 3)), axes=(0, -2))
    with raises(f"{op}: axis 2 out of range for rank 2 (valid: -2..1)"):
        infer(op, T((2, 3)), axes=(2,))
    with raises(f"{op}: operand has dtype bool (bool[2,3])"):
        infer(op, T((2, 3), BOOL), axes=(0,))


# ============================================================================ attention


def test_matmul_rule():
    assert infer("matmul", T((2, 3)), T((3, 4))) == T((2, 4))
    assert infer("matmul", T((1, 24, 5, 256), BF16), T((1, 1, 256, 64), BF16)) == T((1, 24, 5, 64), BF16)
    assert infer("matmul", T((7, 2, 3)), T((3, 4))) == T((7, 2, 4))
    assert infer("matmul", T((2, 3), I32), T((3, 1), I32)) == T((2, 1), I32)


def test_matmul_errors():
    with raises("matmul: operands need rank >= 2, got f32[3] and f32[3,4]"):
        infer("matmul", T((3,)), T((3, 4)))
    with raises("matmul: contraction dims differ: f32[2,3] @ f32[4,5] (3 != 4)"):
        infer("matmul", T((2, 3)), T((4, 5)))
    with raises("matmul: shapes [2], [3] do not broadcast"):
        infer("matmul", T((2, 4, 3)), T((3, 3, 5)))
    with raises("matmul: operands must share one dtype, got f32[2,3], bf16[3,4]"):
        infer("matmul", T((2, 3)), T((3, 4), BF16))
    with raises("matmul: operand has dtype bool"):
        infer("matmul", T((2, 3), BOOL), T((3, 4), BOOL))


def test_softmax_rule():
    assert infer("softmax", T((1, 24, 5, 64), BF16)) == T((1, 24, 5, 64), BF16)
    assert infer("softmax", T((2, 3), F16), axis=0, precise=True) == T((2, 3), F16)
    assert get_op("softmax").normalize_attrs({}) == {"axis": -1, "precise": False}
    with raises("softmax: axis 2 out of range for rank 2 (valid: -2..1)"):
        infer("softmax", T((2, 3)), axis=2)
    with raises("softmax: axis -1 out of range for rank 0"):
        infer("softmax", T(()))
    with raises("softmax: operand has dtype int32 (i32[2,3]); valid: float32, float16, bfloat16"):
        infer("softmax", T((2, 3), I32))


# ---------------------------------------------------------------------------- sdpa

Q = (1, 24, 5, 256)
KV = (1, 2, 64, 256)


def sdpa(q, k, v, mask=None, dtype=BF16, **attrs) -> TensorType:
    operands = [T(q, dtype), T(k, dtype), T(v, dtype)] + ([mask] if mask is not None else [])
    return get_op("sdpa").result_type(operands, attrs, optionals=("mask",) if mask is not None else ())


def test_sdpa_gqa_24q_2kv():
    assert sdpa(Q, KV, KV) == T(Q, BF16)
    assert sdpa(Q, KV, KV, scale=1 / 16) == T(Q, BF16)


def test_sdpa_mqa_mha_and_value_dim():
    assert sdpa((2, 8, 3, 64), (2, 1, 17, 64), (2, 1, 17, 64)) == T((2, 8, 3, 64), BF16)  # MQA
    assert sdpa((2, 8, 3, 64), (2, 8, 17, 64), (2, 8, 17, 64)) == T((2, 8, 3, 64), BF16)  # MHA
    assert sdpa((1, 4, 3, 64), (1, 2, 9, 64), (1, 2, 9, 32)) == T((1, 4, 3, 32), BF16)  # Dv != D
    assert sdpa((1, 4, 0, 64), (1, 2, 0, 64), (1, 2, 0, 64)) == T((1, 4, 0, 64), BF16)  # empty


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_sdpa_float_dtypes(dtype):
    assert sdpa(Q, KV, KV, dtype=dtype) == T(Q, dtype)


@pytest.mark.parametrize(
    "q, k, v, message",
    [
        ((24, 5, 256), KV, KV, "sdpa: q must be rank 4 [B, H, S, D], got q=bf16[24,5,256]"),
        (Q, (2, 64, 256), KV, "sdpa: k must be rank 4 [B, H, S, D], got k=bf16[2,64,256]"),
        (Q, KV, (1, 1, 2, 64, 256), "sdpa: v must be rank 4 [B, H, S, D], got v=bf16[1,1,2,64,256]"),
        (
            Q,
            (1, 5, 64, 256),
            (1, 5, 64, 256),
            "sdpa: query heads 24 not divisible by kv heads 5 (q=bf16[1,24,5,256], k=bf16[1,5,64,256])",
        ),
        (Q, (1, 0, 64, 256), (1, 0, 64, 256), "sdpa: query heads 24 not divisible by kv heads 0"),
        (
            Q,
            (1, 2, 64, 128),
            (1, 2, 64, 256),
            "sdpa: head dims differ: q=bf16[1,24,5,256] k=bf16[1,2,64,128] (256 != 128)",
        ),
        (Q, KV, (1, 2, 63, 256), "sdpa: k and v must agree on heads and length: k=bf16[1,2,64,256] v=bf16[1,2,63,256]"),
        (Q, KV, (1, 1, 64, 256), "sdpa: k and v must agree on heads and length: k=bf16[1,2,64,256] v=bf16[1,1,64,256]"),
        (Q, (2, 2, 64, 256), (2, 2, 64, 256), "sdpa: batch sizes differ: q=bf16[1,24,5,256] k=bf16[2,2,64,256]"),
    ],
)
def test_sdpa_shape_errors(q, k, v, message):
    with raises(message):
        sdpa(q, k, v)


@pytest.mark.parametrize(
    "dtypes, message",
    [
        ((I32, I32, I32), "sdpa: q has dtype int32 (i32[1,24,5,256]); valid: float32, float16, bfloat16"),
        ((BF16, BOOL, BF16), "sdpa: k has dtype bool (bool[1,2,64,256])"),
        ((BF16, BF16, I32), "sdpa: v has dtype int32 (i32[1,2,64,256])"),
        (
            (BF16, F16, BF16),
            "sdpa: operands must share one dtype, got bf16[1,24,5,256], f16[1,2,64,256], bf16[1,2,64,256]",
        ),
    ],
)
def test_sdpa_dtype_errors(dtypes, message):
    with raises(message):
        infer("sdpa", T(Q, dtypes[0]), T(KV, dtypes[1]), T(KV, dtypes[2]))


@pytest.mark.parametrize(
    "mask",
    [
        T((1, 24, 5, 64), BOOL),  # full bool
        T((1, 1, 5, 64), BOOL),  # head axis 1
        T((5, 64), BOOL),  # 2-D [S, T]
        T((64,), BF16),  # additive, broadcast over rows
        T((1, 24, 1, 64), BF16),  # additive, per head
        T((), BF16),  # additive scalar
    ],
)
def test_sdpa_masks_accepted(mask):
    assert sdpa(Q, KV, KV, mask) == T(Q, BF16)


@pytest.mark.parametrize(
    "mask, message",
    [
        (T((5, 63), BOOL), "sdpa mask: shapes [5,63], [1,24,5,64] do not broadcast"),
        (T((1, 12, 5, 64), BOOL), "sdpa mask: shapes [1,12,5,64], [1,24,5,64] do not broadcast"),
        (T((2, 24, 5, 64), BOOL), "sdpa: mask bool[2,24,5,64] does not broadcast to [B, Hq, S, T] = [1, 24, 5, 64]"),
        (T((1, 1, 1, 5, 64), BOOL), "sdpa: mask rank 5 > 4: bool[1,1,1,5,64]"),
        (T((5, 64), I32), "sdpa: mask i32[5,64] must be bool (True = attend) or additive"),
        (T((5, 64), F32), "sdpa: mask f32[5,64] must be bool (True = attend) or additive with q's dtype bfloat16"),
    ],
)
def test_sdpa_mask_errors(mask, message):
    with raises(message):
        sdpa(Q, KV, KV, mask)


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_sdpa_causal_kinds(causal):
    assert sdpa(Q, KV, KV, causal=causal) == T(Q, BF16)
    assert get_op("sdpa").normalize_attrs({"causal": causal})["causal"] == causal


@pytest.mark.parametrize(
    "attrs, message",
    [
        (
            {"causal": "upper"},
            "sdpa: attribute causal: expected one of 'none', 'top_left', 'bottom_right', got 'upper'",
        ),
        ({"causal": True}, "sdpa: attribute causal: expected one of"),
        ({"scale": math.inf}, "sdpa: attribute scale: expected a finite number or None, got inf"),
        ({"scale": math.nan}, "sdpa: attribute scale: expected a finite number or None, got nan"),
        ({"scale": True}, "sdpa: attribute scale: expected a number, got True"),
        ({"scale": "0.0625"}, "sdpa: attribute scale: expected a number, got '0.0625'"),
        ({"dropout": 0.1}, "sdpa: unknown attribute(s) dropout; valid attributes: scale, causal"),
    ],
)
def test_sdpa_attribute_errors(attrs, message):
    with raises(message):
        sdpa(Q, KV, KV, **attrs)


def test_shape_errors_are_library_errors():
    with pytest.raises(AttnpassError):
        sdpa(Q, (1, 5, 64, 256), (1, 5, 64, 256))


# ============================================================================ properties (numpy agrees)

dims = st.integers(0, 4)
small_shapes = st.lists(dims, min_size=0, max_size=4).map(tuple)
broadcastable_dim = st.sampled_from([1, 1, 2, 3])


@PROPERTY_SETTINGS
@given(a=st.lists(broadcastable_dim, max_size=4).map(tuple), b=st.lists(broadcastable_dim, max_size=4).map(tuple))
def test_prop_broadcast_matches_numpy(a, b):
    try:
        expected = np.broadcast_shapes(a, b)
    except ValueError:
        with pytest.raises(ShapeError, match="do not broadcast"):
            infer("mul", T(a), T(b))
        return
    assert infer("mul", T(a), T(b)).shape == expected
    assert infer("where", T(a, BOOL), T(b), T(())).shape == expected


@st.composite
def shape_and_slices(draw):
    shape = draw(small_shapes)
    start, stop, step = [], [], []
    for n in shape:
        lo = draw(st.integers(0, n))
        hi = draw(st.integers(lo, n))
        start.append(lo), stop.append(hi), step.append(draw(st.integers(1, 4)))
    return shape, tuple(start), tuple(stop), tuple(step)


@PROPERTY_SETTINGS
@given(shape_and_slices())
def test_prop_slice_matches_numpy(case):
    shape, start, stop, step = case
    expected = np.empty(shape)[tuple(slice(*s) for s in zip(start, stop, step))].shape
    assert infer("slice", T(shape), start=start, stop=stop, step=step).shape == expected


@st.composite
def shape_and_reshape(draw):
    shape = draw(st.lists(st.integers(1, 4), max_size=4).map(tuple))
    # Factor the element count into a random target: split/merge via a shuffled list of prime factors.
    factors = []
    for d in shape:
        f, n = 2, d
        while n > 1:
            while n % f == 0:
                factors.append(f)
                n //= f
            f += 1
    factors = draw(st.permutations(factors))
    target, i = [], 0
    while i < len(factors):
        k = draw(st.integers(1, len(factors) - i))
        target.append(int(np.prod(factors[i : i + k])))
        i += k
    ones = draw(st.integers(0, 2))
    target = target + [1] * ones
    target = draw(st.permutations(target))
    return shape, tuple(target)


@PROPERTY_SETTINGS
@given(shape_and_reshape(), st.lists(st.integers(1, 4), max_size=3).map(tuple))
def test_prop_reshape_matches_numpy(case, other):
    shape, target = case
    assert infer("reshape", T(shape), shape=target).shape == np.empty(shape).reshape(target).shape
    # A random other target reshapes exactly when numpy agrees.
    try:
        expected = np.empty(shape).reshape(other).shape
    except ValueError:
        with pytest.raises(ShapeError, match="cannot reshape"):
            infer("reshape", T(shape), shape=other)
    else:
        assert infer("reshape", T(shape), shape=other).shape == expected


@PROPERTY_SETTINGS
@given(st.data())
def test_prop_transpose_matches_numpy(data):
    shape = data.draw(small_shapes)
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    assert infer("transpose", T(shape), perm=perm).shape == np.transpose(np.empty(shape), perm).shape


@PROPERTY_SETTINGS
@given(st.data())
def test_prop_take_matches_numpy(data):
    shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple))
    idx_shape = data.draw(st.lists(st.integers(0, 3), max_size=2).map(tuple))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    expected = np.take(np.empty(shape), np.zeros(idx_shape, dtype=np.int32), axis=axis).shape
    assert infer("take", T(shape), T(idx_shape, I32), axis=axis).shape == expected


@PROPERTY_SETTINGS
@given(st.data())
def test_prop_concat_matches_numpy(data):
    base = data.draw(st.lists(dims, min_size=1, max_size=4))
    axis = data.draw(st.integers(-len(base), len(base) - 1))
    n = data.draw(st.integers(1, 4))
    shapes = []
    for _ in range(n):
        s = list(base)
        s[axis] = data.draw(dims)
        shapes.append(tuple(s))
    expected = np.concatenate([np.empty(s) for s in shapes], axis=axis).shape
    assert infer("concat", *[T(s) for s in shapes], axis=axis).shape == expected


@PROPERTY_SETTINGS
@given(st.data())
def test_prop_reductions_match_numpy(data):
    shape = data.draw(small_shapes)
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(0, rank - 1), unique=True, max_size=rank)) if rank else []
    axes = tuple(a - rank if data.draw(st.booleans()) else a for a in axes)  # mix negative spellings
    keepdims = data.draw(st.booleans())
    expected = np.sum(np.zeros(shape), axis=axes, keepdims=keepdims).shape
    for op in ("sum", "max"):
        assert infer(op, T(shape), axes=axes, keepdims=keepdims).shape == expected


@PROPERTY_SETTINGS
@given(st.data())
def test_prop_matmul_matches_numpy(data):
    m, k, n = (data.draw(st.integers(1, 4)) for _ in range(3))
    ba = data.draw(st.lists(broadcastable_dim, max_size=2).map(tuple))
    bb = data.draw(st.lists(broadcastable_dim, max_size=2).map(tuple))
    a, b = ba + (m, k), bb + (k, n)
    try:
        expected = np.matmul(np.zeros(a), np.zeros(b)).shape
    except ValueError:
        with pytest.raises(ShapeError, match="do not broadcast"):
            infer("matmul", T(a), T(b))
        return
    assert infer("matmul", T(a), T(b)).shape == expected


@PROPERTY_SETTINGS
@given(
    hkv=st.integers(1, 4),
    group=st.integers(1, 6),
    s=st.integers(1, 9),
    t=st.integers(1, 9),
    extra=st.integers(0, 3),
)
def test_prop_sdpa_gqa_heads(hkv, group, s, t, extra):
    """Any Hq that is a multiple of Hkv is accepted; any other Hq is rejected naming both counts."""
    hq = hkv * group
    assert sdpa((1, hq, s, 8), (1, hkv, t, 8), (1, hkv, t, 4)) == T((1, hq, s, 4), BF16)
    bad = hq + extra
    if extra and bad % hkv:
        with raises(f"query heads {bad} not divisible by kv heads {hkv}"):
            sdpa((1, bad, s, 8), (1, hkv, t, 8), (1, hkv, t, 8))


# ============================================================================ rounding, argmax/argmin, conv1d


@pytest.mark.parametrize("op", ["floor", "ceil", "round"])
def test_rounding_ops_keep_the_float_type_and_refuse_integers(op):
    assert get_op(op).family == "elementwise"
    for dtype in (F32, F16, BF16):
        assert infer(op, T((3, 0, 2), dtype)) == T((3, 0, 2), dtype)
    with raises(f"{op}: operand has dtype int32 (i32[2]); valid: float32, float16, bfloat16"):
        infer(op, T((2,), I32))


@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_arg_reduction_rule(op):
    x = T((2, 3, 4), BF16)
    assert get_op(op).family == "reduction"
    assert infer(op, x, axis=1) == T((2, 4), I32)
    assert infer(op, x, axis=-1, keepdims=True) == T((2, 3, 1), I32)
    assert infer(op, T((5,), I32), axis=0) == T((), I32)
    with raises(f"{op}: axis 3 out of range for rank 3 (valid: -3..2)"):
        infer(op, x, axis=3)
    with raises(f"{op}: operand f32[] is a scalar; need rank >= 1"):
        infer(op, T(()), axis=0)
    with raises(f"{op}: axis 1 of f32[2,0] is empty"):
        infer(op, T((2, 0)), axis=1)
    with raises(f"{op}: operand has dtype bool (bool[2])"):
        infer(op, T((2,), BOOL), axis=0)
    with raises(f"{op}: missing required attribute axis (int)"):
        infer(op, x)


@pytest.mark.parametrize(
    "x, w, attrs, out",
    [
        ((1, 10, 6), (6, 3, 1), {"groups": 6}, (1, 8, 6)),  # depthwise, no padding
        ((2, 10, 6), (4, 3, 6), {"stride": 2, "padding": (1, 1), "dilation": 2}, (2, 4, 4)),
        ((1, 5, 4), (6, 2, 2), {"groups": 2, "padding": (1, 0)}, (1, 5, 6)),
        ((1, 3, 2), (2, 3, 2), {}, (1, 1, 2)),
    ],
)
def test_conv1d_rule(x, w, attrs, out):
    """The output length is (L + low + high - dilation * (K - 1) - 1) // stride + 1, as mx.conv1d's."""
    assert infer("conv1d", T(x, BF16), T(w, BF16), **attrs) == T(out, BF16)


@pytest.mark.parametrize(
    "x, w, attrs, message",
    [
        ((1, 10, 6), (6, 3, 2), {"groups": 6}, "conv1d: groups=6 does not fit x f32[1,10,6] and w f32[6,3,2]"),
        ((1, 10, 6), (4, 3, 1), {"groups": 6}, "conv1d: groups=6 does not fit"),
        ((1, 10, 6), (6, 3, 6), {"stride": 0}, "conv1d: stride=0 padding=[0, 0] dilation=1 groups=1 invalid"),
        ((1, 10, 6), (6, 3, 6), {"padding": (1,)}, "conv1d: stride=1 padding=[1] dilation=1 groups=1 invalid"),
        ((1, 10, 6), (6, 3, 6), {"padding": (-1, 0)}, "padding=[-1, 0]"),
        ((1, 4, 6), (6, 3, 6), {"dilation": 2}, "conv1d: the kernel spans 5 positions, more than the padded length 4"),
        ((10, 6), (6, 3, 6), {}, "conv1d: need x [N, L, C_in] and w [C_out, K, C_in / groups], got f32[10,6]"),
    ],
)
def test_conv1d_rule_errors(x, w, attrs, message):
    with raises(message):
        infer("conv1d", T(x), T(w), **attrs)
    with raises("conv1d: operand has dtype int32"):
        infer("conv1d", T((1, 10, 6), I32), T((6, 3, 6), I32))
    with raises("conv1d: operands must share one dtype"):
        infer("conv1d", T((1, 10, 6)), T((6, 3, 6), BF16))


# ============================================================================ scan, remainder (MLX imports)


def test_scan_rule():
    x = T((2, 3, 4), BF16)
    assert get_op("scan").family == "reduction"
    for kind in ("sum", "prod", "max", "min"):
        assert infer("scan", x, kind=kind, axis=-1) == x
    assert infer("scan", T((5,), I32), kind="sum", axis=0, reverse=True, inclusive=False) == T((5,), I32)
    assert infer("scan", T((2, 0)), kind="max", axis=1) == T((2, 0))
    with raises("scan: axis 3 out of range for rank 3 (valid: -3..2)"):
        infer("scan", x, kind="sum", axis=3)
    with raises("scan: operand f32[] is a scalar; need rank >= 1"):
        infer("scan", T(()), kind="sum", axis=0)
    with raises("scan: operand has dtype bool (bool[2])"):
        infer("scan", T((2,), BOOL), kind="sum", axis=0)
    with raises("kind"):
        infer("scan", x, kind="mean", axis=0)
    with raises("scan: missing required attribute axis (int)"):
        infer("scan", x, kind="sum")


def test_remainder_rule():
    assert get_op("remainder").family == "elementwise"
    assert infer("remainder", T((2, 1), I32), T((3,), I32)) == T((2, 3), I32)
    assert infer("remainder", T((4,), BF16), T((), BF16)) == T((4,), BF16)
    with raises("remainder: operand has dtype bool"):
        infer("remainder", T((2,), BOOL), T((2,), BOOL))
    with raises("remainder: operands must share one dtype"):
        infer("remainder", T((2,)), T((2,), I32))
