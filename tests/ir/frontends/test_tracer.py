"""Tracing Python functions into graphs: naming, scalars, basic indexing, diagnostics with source lines."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.ir import (
    AttnpassError,
    DType,
    Graph,
    PrintSettings,
    ShapeError,
    SourceLoc,
    TensorSpec,
    TensorType,
    format_graph,
    ops,
    trace,
)

THIS_FILE = str(Path(__file__).resolve())
SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    """1-based line number of the only source line of this file that contains ``marker``."""
    quoted = (f'"{marker}"', f"'{marker}'")
    hits = [i + 1 for i, text in enumerate(SOURCE) if marker in text and not any(q in text for q in quoted)]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def f32(*shape) -> TensorSpec:
    return TensorSpec(shape, "float32")


def op_nodes(g: Graph) -> list:
    return [n for n in g if n.op != "input"]


# ============================================================================ trace()


def test_inputs_are_named_after_parameters():
    def attention(query, key, value):
        return ops.sdpa(query, key, value, scale=0.0625)

    g = trace(
        attention,
        TensorSpec((1, 24, 5, 256), "bfloat16"),
        TensorSpec((1, 2, 64, 256), "bfloat16", "resident"),
        TensorType((1, 2, 64, 256), DType.bfloat16),  # a bare TensorType is a streamed input
    )
    assert g.name == "attention"
    assert g.inputs == ("query", "key", "value")
    assert [g.input_role(n) for n in g.inputs] == ["streamed", "resident", "streamed"]
    assert g.node("key").type == TensorType((1, 2, 64, 256), "bfloat16")
    (out,) = g.outputs
    assert g.node(out).op == "sdpa" and g.node(out).inputs == ("query", "key", "value")
    assert g.node(out).attrs == {
        "scale": 0.0625,
        "causal": "none",
        "logit_softcap": None,
        "window": None,
    }


def test_defaulted_and_keyword_parameters_are_not_inputs():
    def f(x, y, scale=2.0, *, axis=-1):
        return ops.softmax(x * y * scale, axis=axis)

    g = trace(f, f32(2, 3), f32(2, 3))
    assert g.inputs == ("x", "y")


def test_graph_name_and_explicit_name():
    g = trace(lambda x: ops.exp(x), f32(2))  # '<lambda>' must still give a valid graph name
    assert g.name == "g_lambda"
    assert trace(lambda x: x, f32(2), name="ident").name == "ident"


def test_multiple_outputs_and_input_as_output():
    def f(x, y):
        return x, ops.exp(y), x + y

    g = trace(f, f32(3), f32(3))
    assert len(g.outputs) == 3 and g.outputs[0] == "x"
    assert [g.node(o).op for o in g.outputs] == ["input", "exp", "add"]
    assert trace(lambda x: [x, x], f32(1)).outputs == ("x", "x")


def test_wrong_number_of_specs():
    def f(x, y):
        return x + y

    with pytest.raises(
        AttnpassError, match=r"trace: f takes 2 tensor parameter\(s\) \(x, y\) but 1 spec\(s\) were given"
    ):
        trace(f, f32(2))
    with pytest.raises(AttnpassError, match=r"takes 2 tensor parameter\(s\) \(x, y\) but 3 spec\(s\)"):
        trace(f, f32(2), f32(2), f32(2))


def test_bad_spec_kind():
    with pytest.raises(
        AttnpassError, match="trace: the spec of parameter x must be a TensorSpec or a TensorType, got tuple"
    ):
        trace(lambda x: x, (2, 3))
    with pytest.raises(AttnpassError, match="TensorSpec: role must be one of streamed, resident, got 'pinned'"):
        TensorSpec((2,), "float32", "pinned")


@pytest.mark.parametrize(
    "result, kind",
    [
        (lambda x: 3, "int"),
        (lambda x: None, "NoneType"),
        (lambda x: (x, 1.0), "float"),
        (lambda x: np.ones(2), "ndarray"),
    ],
)
def test_non_tensor_return(result, kind):
    with pytest.raises(AttnpassError, match=f"trace: g_lambda must return traced tensors, got {kind}"):
        trace(result, f32(2))


def test_returning_nothing():
    with pytest.raises(AttnpassError, match="has no outputs"):
        trace(lambda x: (), f32(2))


def test_traced_graph_is_verified_and_round_trips():
    def block(q, k, v, mask):
        scores = (q @ k.transpose(0, 1, 3, 2)) * 0.125
        scores = ops.where(mask, scores, -math.inf)
        p = ops.softmax(scores, precise=True)
        return ops.matmul(p, v), ops.sum(p, axis=-1, keepdims=True), ops.max(scores)

    g = trace(block, f32(1, 2, 4, 8), f32(1, 2, 6, 8), f32(1, 2, 6, 8), TensorSpec((4, 6), "bool"))
    g.verify()
    assert [g.node(o).type.shape for o in g.outputs] == [(1, 2, 4, 8), (1, 2, 4, 1), ()]
    assert Graph.from_json(g.to_json()) == g
    from attnpass.ir import parse_graph

    assert parse_graph(str(g)) == g


# ============================================================================ Python scalars


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32"])
def test_python_scalars_take_the_tensor_dtype(dtype):
    g = trace(lambda x: (x * 2, 3 + x, x - 1, 1 - x, ops.maximum(x, 0)), TensorSpec((2, 3), dtype))
    consts = [n for n in g if n.op == "constant"]
    assert len(consts) == 5
    for c in consts:
        assert c.type == TensorType((), dtype) and c.attrs["dtype"] is DType.parse(dtype)
    expected = int if dtype == "int32" else float
    assert {type(c.attrs["value"][0]) for c in consts} == {expected}
    assert sorted(c.attrs["value"][0] for c in consts) == [0, 1, 1, 2, 3]
    for o in g.outputs:
        assert g.node(o).type == TensorType((2, 3), dtype)


def test_scalar_operand_order_is_kept():
    g = trace(lambda x: (1 - x, x - 1, 2 / x), f32(3))
    rsub, sub, rdiv = (g.node(o) for o in g.outputs)
    assert g.node(rsub.inputs[0]).op == "constant" and rsub.inputs[1] == "x"
    assert sub.inputs[0] == "x" and g.node(sub.inputs[1]).op == "constant"
    assert rdiv.op == "div" and g.node(rdiv.inputs[0]).attrs["value"] == (2.0,)


def test_numpy_scalars_and_non_finite_scalars():
    g = trace(lambda x: (np.float32(0.5) * x, x + np.int64(1), x * -math.inf), TensorSpec((2,), "bfloat16"))
    values = sorted(n.attrs["value"][0] for n in g if n.op == "constant")
    assert values == [-math.inf, 0.5, 1.0]
    assert {n.type.dtype for n in g if n.op == "constant"} == {DType.bfloat16}


def test_scalar_errors():
    message = r"cannot combine the float 2.5 with the int32 tensor Tensor\(x: i32\[3\]\); cast first"
    with pytest.raises(ShapeError, match=message):
        trace(lambda x: x + 2.5, TensorSpec((3,), "int32"))
    with pytest.raises(ShapeError, match="expected a traced tensor or a Python scalar, got list"):
        trace(lambda x: x + [1, 2, 3], f32(3))
    with pytest.raises(ShapeError, match=r"where: x or y must be a traced tensor \(both are Python scalars\)"):
        trace(lambda m: ops.where(m, 1.0, 0.0), TensorSpec((3,), "bool"))
    with pytest.raises(ShapeError, match="div: operand has dtype int32"):
        trace(lambda x: x / 2, TensorSpec((3,), "int32"))


def test_where_with_scalar_branch():
    g = trace(lambda m, x: ops.where(m, x, -math.inf), TensorSpec((4, 6), "bool"), TensorSpec((2, 4, 6), "float16"))
    out = g.node(g.outputs[0])
    assert out.type == TensorType((2, 4, 6), "float16")
    c = g.node(out.inputs[2])
    assert c.op == "constant" and c.attrs["value"] == (-math.inf,) and c.type.dtype is DType.float16


# ============================================================================ tensor methods and ops helpers


def test_tensor_properties_and_methods():
    seen = {}

    def f(x):
        seen.update(shape=x.shape, dtype=x.dtype, ndim=x.ndim, type=x.type, repr=repr(x))
        return (
            x.reshape(6, -1), x.reshape((4, 6)), x.transpose(), x.transpose(2, 0, 1), x.transpose((1, 0, 2)),
            x.astype("bf16"),
        )  # fmt: skip

    g = trace(f, f32(2, 3, 4))
    assert seen == {
        "shape": (2, 3, 4), "dtype": DType.float32, "ndim": 3, "type": TensorType((2, 3, 4), "float32"),
        "repr": "Tensor(x: f32[2,3,4])",
    }  # fmt: skip
    shapes = [g.node(o).type for o in g.outputs]
    x = np.empty((2, 3, 4))
    assert [s.shape for s in shapes] == [
        x.reshape(6, -1).shape, (4, 6), x.transpose().shape, x.transpose(2, 0, 1).shape,
        x.transpose((1, 0, 2)).shape, (2, 3, 4),
    ]  # fmt: skip
    assert shapes[-1].dtype is DType.bfloat16


def test_ops_helpers():
    def f(x, idx):
        return (
            ops.sum(x),  # all axes
            ops.max(x, axis=1, keepdims=True),
            ops.take(x, idx, axis=1),
            ops.concat([x, x, x], axis=-1),
            ops.slice(x, (0, 1, 0), (2, 3, 4), (1, 1, 2)),
            ops.relu(ops.neg(ops.exp(x))),
            ops.cast(x, DType.int32),
            ops.div(x, 3.0),
            ops.mul(2, x),
            ops.constant(np.arange(6, dtype=np.int32).reshape(2, 3), like=x),
            ops.constant([1.0, 1.0, 1.0], like=x),  # splatted to one value
        )

    g = trace(f, f32(2, 3, 4), TensorSpec((5,), "int32"))
    x = np.empty((2, 3, 4))
    got = [g.node(o).type for o in g.outputs]
    assert [t.shape for t in got] == [
        (), (2, 1, 4), np.take(x, np.zeros(5, np.int64), axis=1).shape, (2, 3, 12), x[0:2, 1:3, 0:4:2].shape,
        (2, 3, 4), (2, 3, 4), (2, 3, 4), (2, 3, 4), (2, 3), (3,),
    ]  # fmt: skip
    assert got[6].dtype is DType.int32 and got[9].dtype is DType.int32
    arange = g.node(g.outputs[9])
    assert arange.attrs["value"] == (0, 1, 2, 3, 4, 5)
    assert g.node(g.outputs[10]).attrs["value"] == (1.0,)


def test_reshape_minus_one_errors():
    with pytest.raises(ShapeError, match=r"reshape: at most one -1 in \[-1, -1\]"):
        trace(lambda x: x.reshape(-1, -1), f32(2, 3))
    with pytest.raises(ShapeError, match=r"reshape: cannot infer -1 in \[-1, 4\] for f32\[2,3\]"):
        trace(lambda x: x.reshape(-1, 4), f32(2, 3))


def test_bool_of_tensor_errors():
    def f(x):
        if x:  # data-dependent control flow
            return x
        return -x

    with pytest.raises(AttnpassError, match=r"Tensor\(x: f32\[2\]\): a traced tensor has no value; data-dependent"):
        trace(f, f32(2))
    with pytest.raises(AttnpassError, match="data-dependent"):
        trace(lambda x: x if bool(x) else -x, f32(2))


def test_ops_outside_trace_error():
    with pytest.raises(AttnpassError, match=r"call them inside attnpass.ir.trace\(fn, ...\)"):
        ops.constant(1.0)
    with pytest.raises(ShapeError, match="add: at least one operand must be a traced tensor"):
        ops.add(1.0, 2.0)
    with pytest.raises(ShapeError, match="exp: expected traced tensors as operands, got ndarray"):
        ops.exp(np.ones(3))


def test_tensor_used_after_its_trace_finished():
    leaked = []

    def f(x):
        leaked.append(x)
        return ops.exp(x)

    g = trace(f, f32(2))
    before = str(g)
    for use in (lambda t: t + 1, lambda t: ops.exp(t), lambda t: t[0], lambda t: t.reshape(2, 1)):
        with pytest.raises(AttnpassError, match="from the finished trace of f was used after trace"):
            use(leaked[0])
    assert str(g) == before  # the returned graph was not changed


def test_tensors_from_different_traces_do_not_mix():
    outer = []

    def inner(y):
        return outer[0] + y

    def f(x):
        outer.append(x)
        trace(inner, f32(2))
        return x

    with pytest.raises(AttnpassError, match="operands come from different traces"):
        trace(f, f32(2))


# ============================================================================ basic indexing


BASIC_KEYS = [
    0, -1, 2, slice(None), slice(1, None), slice(None, -1), slice(None, None, 2), slice(1, 100, 3), slice(-100, 2),
    slice(5, 2), None, Ellipsis, (0, 1), (-1, -3), (slice(None), 0), (Ellipsis, 0), (0, Ellipsis), (None, 0, None),
    (Ellipsis, None), (None, Ellipsis, None), (slice(None, None, 2), Ellipsis, slice(1, 3)), (1, slice(None), 2, None),
    (Ellipsis, slice(3, 0)), (np.int64(1), np.int32(-2)), (),
]  # fmt: skip


@pytest.mark.parametrize("key", BASIC_KEYS, ids=repr)
def test_basic_indexing_matches_numpy(key):
    shape = (3, 4, 5)
    expected = np.empty(shape)[key].shape
    g = trace(lambda x: x[key], f32(*shape))
    assert g.node(g.outputs[0]).type == TensorType(expected, "float32")
    assert {n.op for n in op_nodes(g)} <= {"slice", "reshape"}


def test_indexing_emits_one_slice_then_reshape_only_when_needed():
    g = trace(lambda x: (x[:, 1:3], x[1], x[...], x[None]), f32(3, 4))
    sl, row, same, expanded = (g.node(o) for o in g.outputs)
    assert sl.op == "slice" and sl.attrs == {"start": (0, 1), "stop": (3, 3), "step": (1, 1)}
    assert row.op == "reshape" and g.node(row.inputs[0]).attrs == {"start": (1, 0), "stop": (2, 4), "step": (1, 1)}
    assert same.name == "x"  # a full index is the identity: no node
    assert expanded.op == "reshape" and expanded.inputs == ("x",) and expanded.type.shape == (1, 3, 4)


@pytest.mark.parametrize(
    "key, message",
    [
        (slice(None, None, -1), "axis 0: negative or zero step -1 is not supported"),
        ((slice(None), slice(3, 0, -2)), "axis 1: negative or zero step -2 is not supported"),
        (slice(None, None, 0), "axis 0: slice step 0 is not allowed"),
        ([0, 1], "with arrays is not basic indexing; use ops.take(x, indices, axis)"),
        (np.array([0, 1]), "with arrays is not basic indexing; use ops.take"),
        ((0, [1]), "with arrays is not basic indexing"),
        (3, "index 3 out of range for axis 0 of size 3"),
        ((0, -5), "index -5 out of range for axis 1 of size 4"),
        ((0, 0, 0), "3 indices for rank 2"),
        ((Ellipsis, Ellipsis), "at most one Ellipsis"),
        (1.0, "unsupported index 1.0"),
        (True, "unsupported index True"),
        ("a", "unsupported index 'a'"),
    ],
    ids=repr,
)
def test_indexing_errors(key, message):
    with pytest.raises(ShapeError, match=r"indexing Tensor\(x: f32\[3,4\]\)") as exc:
        trace(lambda x: x[key], f32(3, 4))
    assert message in str(exc.value)


def test_indexing_with_a_traced_tensor_errors():
    with pytest.raises(ShapeError, match=r"use ops.take\(x, indices, axis\)"):
        trace(lambda x, i: x[i], f32(3, 4), TensorSpec((2,), "int32"))


@st.composite
def shape_and_key(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    parts = []
    axis = 0
    while axis < len(shape) and draw(st.booleans()):
        n = shape[axis]
        kind = draw(st.sampled_from(["int", "slice", "none"] if n else ["slice", "none"]))
        if kind == "int":
            parts.append(draw(st.integers(-n, n - 1)))
        elif kind == "slice":
            bound = st.one_of(st.none(), st.integers(-7, 7))
            parts.append(slice(draw(bound), draw(bound), draw(st.one_of(st.none(), st.integers(1, 3)))))
        else:
            parts.append(None)
            continue
        axis += 1
    if draw(st.booleans()):
        parts.insert(draw(st.integers(0, len(parts))), Ellipsis)
    if draw(st.booleans()):
        parts.append(None)
    key = tuple(parts) if len(parts) != 1 or draw(st.booleans()) else parts[0]
    return shape, key


@settings(max_examples=80, deadline=None)
@given(shape_and_key())
def test_prop_basic_indexing_matches_numpy(case):
    """Same result shape as numpy; where numpy raises IndexError (an Ellipsis moved an int onto an
    empty axis), tracing raises a ShapeError naming the index."""
    shape, key = case
    try:
        expected = np.empty(shape)[key].shape
    except IndexError:
        with pytest.raises(ShapeError, match="out of range for axis"):
            trace(lambda x: x[key], f32(*shape))
        return
    g = trace(lambda x: x[key], f32(*shape))
    assert g.node(g.outputs[0]).type.shape == expected


# ============================================================================ diagnostics and source locations


def test_shape_error_names_op_shapes_and_user_line():
    def model(x, y):
        h = ops.exp(x)
        return h + y  # <-- broadcast mismatch here

    with pytest.raises(ShapeError) as exc:
        trace(model, f32(2, 3), f32(4))
    text = str(exc.value)
    lines = text.splitlines()
    assert lines[0] == "add: shapes [2,3], [4] do not broadcast (numpy broadcasting rules)"
    assert lines[1] == f"  at {THIS_FILE}:{line_of('# <-- broadcast mismatch here')} in model"
    assert lines[2] == "    " + SOURCE[line_of("# <-- broadcast mismatch here") - 1].strip()
    assert lines[2].startswith("    return h + y  #")
    assert "test_tracer.py" in text


@pytest.mark.parametrize(
    "build, marker, first_line",
    [
        (
            lambda q, k: ops.sdpa(q, k, k),  # <-- sdpa site
            "# <-- sdpa site",
            "sdpa: query heads 3 not divisible by kv heads 2 (q=f32[1,3,4,8], k=f32[1,2,6,8]); GQA needs Hq % Hkv == 0",
        ),
        (
            lambda q, k: q @ k,  # <-- matmul site
            "# <-- matmul site",
            "matmul: contraction dims differ: f32[1,3,4,8] @ f32[1,2,6,8] (8 != 6)",
        ),
        (
            lambda q, k: ops.softmax(q, axis=4),  # <-- softmax site
            "# <-- softmax site",
            "softmax: axis 4 out of range for rank 4 (valid: -4..3)",
        ),
        (
            lambda q, k: ops.concat([q, k], axis=1),  # <-- concat site
            "# <-- concat site",
            "concat: operands f32[1,3,4,8], f32[1,2,6,8] differ outside axis 1",
        ),
        (
            lambda q, k: q.reshape(-1, 7),  # <-- reshape site
            "# <-- reshape site",
            "reshape: cannot infer -1 in [-1, 7] for f32[1,3,4,8]",
        ),
    ],
    ids=["sdpa", "matmul", "softmax", "concat", "reshape"],
)
def test_shape_errors_point_at_the_user_line(build, marker, first_line):
    with pytest.raises(ShapeError) as exc:
        trace(build, f32(1, 3, 4, 8), f32(1, 2, 6, 8))
    lines = str(exc.value).splitlines()
    assert lines[0] == first_line
    assert lines[1].startswith(f"  at {THIS_FILE}:{line_of(marker)} in ")
    assert marker in lines[2]


def helper_in_user_code(x):
    return ops.exp(x)  # <-- helper line


def test_nodes_carry_source_locations():
    def model(x):
        a = x * 2.0  # <-- scale line
        b = helper_in_user_code(a)
        return b[0]  # <-- index line

    g = trace(model, f32(3, 4))
    by_op = {n.op: n for n in g}
    scale_line, index_line = line_of("# <-- scale line"), line_of("# <-- index line")
    assert by_op["mul"].loc == SourceLoc(THIS_FILE, scale_line, "model")
    assert by_op["constant"].loc == SourceLoc(THIS_FILE, scale_line, "model")  # the promoted scalar too
    assert by_op["exp"].loc == SourceLoc(THIS_FILE, line_of("# <-- helper line"), "helper_in_user_code")
    assert by_op["slice"].loc == by_op["reshape"].loc == SourceLoc(THIS_FILE, index_line, "model")
    assert g.node("x").loc is None
    for n in op_nodes(g):  # never a frame inside the library
        assert n.loc is not None and n.loc.file == THIS_FILE
    shown = format_graph(g, PrintSettings(show_locs=True))
    assert f"# {THIS_FILE}:{scale_line} in model" in shown
    # locations survive JSON
    back = Graph.from_json(g.to_json())
    assert [n.loc for n in back] == [n.loc for n in g]
