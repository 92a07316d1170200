"""from_mlx: every spelling of a slice and a gather MLX records, the rounding, argmax and conv1d primitives,
and host reads named at the user's line.

MLX records a slice's stop as written (``x[:, :-1]`` has stop -1) and walks negative steps; its gathers
wrap negative indices. The import normalises them into the IR's canonical slice (positive steps,
bounds in range) plus reversals, and wrapped indices; the property tests compare the imported and
lowered program with MLX itself over random shapes and Python slice tuples.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import ModelImportError, from_mlx
from attnpass.lowering import lower
from tests.util import assert_mlx_import_reproduces, lazy_import, random_array, requires

mx = lazy_import("mlx.core")
nn = lazy_import("mlx.nn")
pytestmark = requires("mlx.core", "jax")

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ops(graph) -> list[str]:
    return [n.op for n in graph.nodes() if n.op != "input"]


def _exact_on_mlx_and_numpy(imported, fn, *args) -> None:
    """Bit for bit what MLX computes, lowered to MLX and to numpy (moves and a multiply by 2: exact)."""
    expected = np.array(fn(*args))
    np.testing.assert_array_equal(run(lower(imported.graph, "mlx"), *args, **imported.params), expected)
    host = [np.array(a) for a in args]
    np.testing.assert_array_equal(run(lower(imported.graph, "numpy"), *host, **imported.params), expected)


# ----------------------------------------------------------------------------- slices


def test_negative_slice_stop_is_normalised():
    """The issue's repro: MLX records x[:, :-1] with stop = -1, which the IR's slice rejects as written."""
    x = mx.random.normal((1, 4, 6))
    fn = lambda x: x[:, :-1] * 2  # noqa: E731
    imported = from_mlx(fn, x)
    (node,) = [n for n in imported.graph.nodes() if n.op == "slice"]
    assert node.attrs == {"start": (0, 0, 0), "stop": (1, 3, 6), "step": (1, 1, 1)}
    assert_mlx_import_reproduces(imported, fn, x)


def test_reversed_and_clamped_slices():
    x = mx.array(np.arange(4 * 6, dtype=np.float32).reshape(1, 4, 6))
    fn = lambda x: x[:, ::-1, 5:0:-2] + x[:, -100:100, -3:]  # noqa: E731
    imported = from_mlx(fn, x)
    assert _ops(imported.graph).count("take") == 2  # one reversal per axis walked backwards
    for node in imported.graph.nodes():
        if node.op == "slice":
            assert min(node.attrs["step"]) >= 1 and min(node.attrs["start"]) >= 0
    assert_mlx_import_reproduces(imported, fn, x)


_bound = st.none() | st.integers(-9, 9)
_step = st.none() | st.sampled_from([1, 2, 3, -1, -2, -3])
_index = st.builds(slice, _bound, _bound, _step) | st.integers(-3, 2)


@st.composite
def _shape_and_index(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    index = []
    for n in shape[: draw(st.integers(1, len(shape)))]:
        item = draw(_index if n else _index.filter(lambda i: isinstance(i, slice)))
        index.append(item % n if isinstance(item, int) and not -n <= item < n else item)  # MLX wants [-n, n)
    return shape, tuple(index)


@SETTINGS
@given(_shape_and_index())
def test_prop_any_python_slice_imports_as_mlx_computes_it(case):
    shape, index = case
    x = mx.array(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape))
    fn = lambda x: x[index] * 2  # noqa: E731
    imported = from_mlx(fn, x)
    for node in imported.graph.nodes():
        if node.op == "slice":
            assert min(node.attrs["step"]) >= 1
    _exact_on_mlx_and_numpy(imported, fn, x)


@SETTINGS
@given(_shape_and_index())
def test_prop_any_python_slice_assignment_imports_as_mlx_computes_it(case):
    shape, index = case
    x = mx.array(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape))
    update = mx.array(-1.0 - np.arange(int(np.prod(x[index].shape)), dtype=np.float32).reshape(x[index].shape))

    def fn(x, update):
        y = x * 2
        y[index] = update
        return y

    _exact_on_mlx_and_numpy(from_mlx(fn, x, update), fn, x, update)


def test_slice_assignments_with_steps_and_reversals():
    x = mx.array(np.arange(4 * 6, dtype=np.float32).reshape(1, 4, 6))

    def fn(x):
        y = mx.zeros((1, 4, 6))
        y[:, ::-1, 1::2] = x[:, :, :3]
        y[:, :-1, -1] = x[:, 1:, 0] * 3
        return y

    imported = from_mlx(fn, x)
    assert_mlx_import_reproduces(imported, fn, x)


# ----------------------------------------------------------------------------- gathers


def test_negative_gather_indices_wrap_as_in_mlx():
    x = mx.array(random_array(np.random.default_rng(0), (2, 3, 5), "float32"))
    constant = mx.array(np.array([-1, 2, -5], np.int32))
    runtime = mx.array(np.array([[-1], [0], [-3]], np.int32))

    def fn(x, i):
        return mx.take(x, constant, axis=2) + mx.take_along_axis(x[..., :3], mx.broadcast_to(i, (2, 3, 3)), axis=1)

    imported = from_mlx(fn, x, runtime)
    wrapped = [n for n in imported.graph.nodes() if n.op == "constant" and n.type.dtype.value == "int32"]
    assert any(n.attrs["value"] == (4, 2, 0) for n in wrapped)  # the constant indices, wrapped at import
    assert "where" in _ops(imported.graph)  # the runtime ones, at run time
    assert_mlx_import_reproduces(imported, fn, x, runtime)


def test_indices_non_negative_by_construction_are_not_wrapped():
    x = mx.array(random_array(np.random.default_rng(1), (3, 6), "float32"))
    fn = lambda x: mx.take_along_axis(x, mx.argmax(x, axis=-1, keepdims=True), axis=-1)  # noqa: E731
    imported = from_mlx(fn, x)
    assert "where" not in _ops(imported.graph)
    assert_mlx_import_reproduces(imported, fn, x)


# ----------------------------------------------------------------------------- Floor, Ceil, Round, ArgReduce


def test_llama4_attention_temperature_with_floor():
    """floor((pos + 1) / floor_scale): llama4's attention temperature scaling of the queries."""
    q = mx.array(random_array(np.random.default_rng(2), (1, 2, 9, 8), "float32"))
    positions = mx.array(np.arange(3, 12, dtype=np.float32))

    def scaled(q, positions):
        scales = mx.log(mx.floor((positions + 1.0) / 4.0) + 1.0) * 0.1 + 1.0
        return q * scales[:, None]

    imported = from_mlx(scaled, q, positions)
    assert "floor" in _ops(imported.graph)
    assert_mlx_import_reproduces(imported, scaled, q, positions)


def test_rounding_primitives_are_bit_exact_on_mlx():
    x = mx.array(np.array([[-2.5, -1.5, -0.5, 0.5, 1.5, 2.5], [-0.3, 0.7, 3.49, -7.01, 0.0, -0.0]], np.float32))
    fn = lambda x: mx.stack([mx.floor(x), mx.ceil(x), mx.round(x)])  # noqa: E731
    imported = from_mlx(fn, x)
    assert {"floor", "ceil", "round"} <= set(_ops(imported.graph))
    got = run(lower(imported.graph, "mlx"), x)
    np.testing.assert_array_equal(got.view(np.uint32), np.array(fn(x)).view(np.uint32))  # -0.0 kept
    assert got[2, 0].tolist() == [-2.0, -2.0, -0.0, 0.0, 2.0, 2.0]  # halves to even
    assert_mlx_import_reproduces(imported, fn, x)


def test_rounding_an_integer_array_is_the_identity():
    i = mx.array(np.array([3, -2], np.int32))
    imported = from_mlx(lambda i: mx.floor(i) + mx.round(i), i)
    assert _ops(imported.graph) == ["add"]


def test_argmax_router():
    """A top-1 MoE router: argmax over the expert logits picks the expert, ties to the first."""
    rng = np.random.default_rng(3)
    x = mx.array(random_array(rng, (2, 5, 8), "float32"))
    gate = mx.array(random_array(rng, (8, 4), "float32"))
    experts = mx.array(random_array(rng, (4, 8, 8), "float32"))
    mx.eval(gate, experts)

    def route(x):
        logits = x @ gate
        expert = mx.argmax(logits, axis=-1)
        weight = mx.take_along_axis(mx.softmax(logits, axis=-1), expert[..., None], axis=-1)
        return weight * (x[..., None, :] @ experts[expert]).squeeze(-2)

    imported = from_mlx(route, x, inline_limit=0)
    assert "argmax" in _ops(imported.graph)
    assert_mlx_import_reproduces(imported, route, x)
    ties = mx.zeros((1, 2, 8))  # every logit equal: expert 0
    tied = from_mlx(lambda x: mx.argmax(x @ gate, axis=-1), ties)
    np.testing.assert_array_equal(run(lower(tied.graph, "mlx"), ties), 0)


def test_argmin_keepdims():
    x = mx.array(np.array([[3, 1, 1], [0, 2, 0]], np.int32))
    fn = lambda x: mx.argmin(x, axis=1, keepdims=True).astype(mx.int32)  # noqa: E731
    imported = from_mlx(fn, x)
    assert _ops(imported.graph) == ["argmin"]
    assert_mlx_import_reproduces(imported, fn, x)


# ----------------------------------------------------------------------------- Convolution


def test_depthwise_conv1d():
    """The issue's repro: mx.conv1d(x, w, groups=6) with w of shape (6, 3, 1)."""
    rng = np.random.default_rng(4)
    x = mx.array(random_array(rng, (1, 10, 6), "float32"))
    w = mx.array(random_array(rng, (6, 3, 1), "float32"))
    fn = lambda x: mx.conv1d(x, w, groups=6)  # noqa: E731
    imported = from_mlx(fn, x)
    (node,) = [n for n in imported.graph.nodes() if n.op == "conv1d"]
    assert node.attrs == {"stride": 1, "padding": (0, 0), "dilation": 1, "groups": 6}
    assert_mlx_import_reproduces(imported, fn, x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_conv1d_with_stride_padding_dilation_groups_and_a_module(dtype):
    rng = np.random.default_rng(5)
    x = mx.array(random_array(rng, (2, 11, 6), "float32")).astype(getattr(mx, dtype))
    w = mx.array(random_array(rng, (4, 3, 3), "float32")).astype(getattr(mx, dtype))
    conv = nn.Conv1d(6, 6, kernel_size=4, padding=3, groups=6, bias=True)  # a Mamba-style short convolution
    conv.set_dtype(getattr(mx, dtype))
    mx.eval(w, conv.parameters())

    def fn(x):
        short = conv(x)[:, : x.shape[1]]  # causal: drop the right padding's outputs
        return mx.conv1d(x, w, stride=2, padding=2, dilation=2, groups=2).sum() + short.sum(axis=1)

    imported = from_mlx(fn, x)
    assert _ops(imported.graph).count("conv1d") == 2
    expected = np.array(fn(x).astype(mx.float32))
    got = run(lower(imported.graph, "mlx"), x, **imported.params)
    np.testing.assert_array_equal(got.astype(np.float32), expected)


def test_unsupported_convolutions_are_named():
    x2 = mx.zeros((1, 5, 5, 2))
    with pytest.raises(ModelImportError, match=r"Convolution .*only 1-D convolutions \(conv1d\) are supported, not 2"):
        from_mlx(lambda x: mx.conv2d(x, mx.ones((2, 3, 3, 2))), x2)
    with pytest.raises(ModelImportError, match=r"flipped kernels .* not supported"):
        from_mlx(lambda x: mx.conv_general(x, mx.ones((2, 3, 2)), flip=True), mx.zeros((1, 5, 2)))


# ----------------------------------------------------------------------------- host reads


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _router_item(x):
    k = x.sum().item()
    return x * k


def _router_numpy(x):
    top = np.array(mx.argmax(x, axis=-1))
    return x[:, int(top[0])]


def _router_int(x):
    n = int(x[0, 0])
    return x * n


def _router_if(x):
    if (x > 0).any():
        return x
    return -x


@pytest.mark.parametrize(
    "fn, text",
    [(_router_item, ".item()"), (_router_numpy, "np.array("), (_router_int, "n = int("), (_router_if, "if (x > 0)")],
)
def test_host_reads_are_named_at_the_users_line(fn, text):
    x = mx.random.normal((2, 4))
    with pytest.raises(ModelImportError) as info:
        from_mlx(fn, x)
    message = str(info.value)
    assert f"{fn.__name__} reads an array's value on the host at {__file__}:{_line_of(fn, text)}" in message
    assert "Keep the value an array" in message and "static argument" in message
    assert "[eval]" not in message


# ----------------------------------------------------------------------------- Scan (cumsum and kin), Remainder


SCANS = [
    lambda x: mx.cumsum(x, axis=-1),  # the repro
    lambda x: mx.cumsum(x, axis=1, reverse=True),
    lambda x: mx.cumsum(x, axis=-1, inclusive=False),
    lambda x: mx.cumsum(x, axis=0, reverse=True, inclusive=False),
    lambda x: mx.cumprod(x, axis=2),
    lambda x: mx.cummax(x, axis=-1, reverse=True, inclusive=False),
    lambda x: mx.cummin(x, axis=1, inclusive=False),
]


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("fn", SCANS, ids=range(len(SCANS)))
def test_scans_import_with_their_kind_axis_direction_and_inclusiveness(fn, dtype):
    """MLX's Scan state is (kind, axis, reverse, inclusive); MLX lowers it back to the same mx.cum* call."""
    rng = np.random.default_rng(6)
    x = mx.array(rng.integers(-3, 4, (2, 3, 5)).astype(dtype))
    imported = from_mlx(fn, x)
    assert _ops(imported.graph) == ["scan"]
    assert_mlx_import_reproduces(imported, fn, x)


def test_a_mamba_style_segment_sum_imports():
    """Mamba2's segsum: an exclusive-free cumsum of the decay, differenced and masked, then exponentiated."""
    rng = np.random.default_rng(7)
    a = mx.array(random_array(rng, (1, 2, 6), "float32"))

    def segsum(a):
        cs = mx.cumsum(a, axis=-1)
        diff = cs[..., :, None] - cs[..., None, :]
        keep = mx.tril(mx.ones((6, 6), dtype=mx.bool_))
        return mx.exp(mx.where(keep, diff, -mx.inf))

    imported = from_mlx(segsum, a)
    assert "scan" in _ops(imported.graph)
    assert_mlx_import_reproduces(imported, segsum, a)


def test_cumsum_of_bools_counts_in_int32():
    x = mx.array(np.array([[True, False, True, True]]))
    fn = lambda x: mx.cumsum(x, axis=1)  # noqa: E731
    imported = from_mlx(fn, x)
    assert _ops(imported.graph) == ["cast", "scan"]
    _exact_on_mlx_and_numpy(imported, fn, x)
    assert np.array(fn(x)).tolist() == [[1, 1, 2, 3]]


def test_a_primitive_mlx_cannot_export_is_named():
    """mx.logcumsumexp's CumLogAddExp has no export state: a ModelImportError naming it and what to do."""
    with pytest.raises(ModelImportError, match=r"MLX primitive CumLogAddExp, which mx.export_function cannot export"):
        from_mlx(lambda x: mx.logcumsumexp(x, axis=-1), mx.zeros((2, 3)))


def test_contiguous_imports_as_its_operand_and_mx_contiguous_is_restored():
    """qwen3_next's conv-state update: mx.contiguous copies values; MLX cannot export its primitive."""
    original = mx.contiguous
    state = mx.zeros((1, 3, 4))

    def step(x):
        window = mx.concatenate([state, x], axis=1)
        return window.sum(axis=1), mx.contiguous(window[:, -3:, :].swapaxes(1, 2))

    x = mx.array(random_array(np.random.default_rng(8), (1, 5, 4), "float32"))
    imported = from_mlx(step, x)
    assert mx.contiguous is original
    expected = [np.array(a) for a in step(x)]
    for got, want in zip(run(lower(imported.graph, "mlx"), x, **imported.params), expected):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ModelImportError):
        from_mlx(lambda x: mx.contiguous(mx.logcumsumexp(x, axis=-1)), x)
    assert mx.contiguous is original


def test_a_helper_compiled_with_mx_compile_imports():
    @mx.compile
    def gate(a, b):
        return mx.tanh(a) * b

    x = mx.array(random_array(np.random.default_rng(9), (2, 3), "float32"))
    fn = lambda x: gate(x, x + 1) + 2  # noqa: E731
    imported = from_mlx(fn, x)
    assert "tanh" in _ops(imported.graph)
    assert_mlx_import_reproduces(imported, fn, x)


@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_remainder_takes_the_divisors_sign(dtype):
    """x % y as in Python and mx.remainder, on every sign pairing: bit for bit on every target."""
    x = mx.array(np.array([-7, 7, -7, 7, 0, -6, 5], dtype))
    y = mx.array(np.array([3, -3, -3, 3, 5, 3, 2], dtype))
    imported = from_mlx(lambda x, y: x % y, x, y)
    assert _ops(imported.graph) == ["remainder"]
    _exact_on_mlx_and_numpy(imported, lambda x, y: x % y, x, y)
    got = run(lower(imported.graph, "jax"), np.array(x), np.array(y))
    np.testing.assert_array_equal(got, [2, -2, -1, 1, 0, 0, 1])


# ----------------------------------------------------------------------------- Partition (mx.partition, mx.topk)


def _sides(a: np.ndarray, kth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a partition defines along the last axis: the sorted values before kth, the kth value, those after."""
    return np.sort(a[..., :kth], axis=-1), a[..., kth], np.sort(a[..., kth + 1 :], axis=-1)


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_partition_values_import_as_a_gather_of_argpartition(dtype):
    """Each side's values (as a set) and the kth value are MLX's on every target; the order inside a side is
    the target's (argpartition)."""
    rng = np.random.default_rng(10)
    x = mx.array(rng.integers(-4, 5, (3, 2, 7)).astype(dtype))  # ties everywhere
    fn = lambda x: mx.partition(x, 3, axis=-1)  # noqa: E731
    imported = from_mlx(fn, x)
    assert _ops(imported.graph) == ["argpartition", "take_along_axis"]
    expected = _sides(np.array(fn(x)), 3)
    for target in ("numpy", "mlx", "jax"):
        got = run(lower(imported.graph, target), np.array(x))
        for side, want in zip(_sides(got, 3), expected):
            np.testing.assert_array_equal(side, want)


def test_bailing_moe_v3_group_scores_topk_sum():
    """bailing_moe_v3's router: mx.topk(scores, 2).sum(-1) (recorded as Partition then a slice): the sum of
    each row's two largest values, the same set on every target (summed in the target's order)."""
    rng = np.random.default_rng(11)
    scores = mx.array(random_array(rng, (1, 7, 2, 8), "float32"))
    fn = lambda s: mx.topk(s, 2, axis=-1).sum(axis=-1, keepdims=True)  # noqa: E731
    imported = from_mlx(fn, scores)
    assert "argpartition" in _ops(imported.graph)
    assert_mlx_import_reproduces(imported, fn, scores)
    top2 = np.sort(np.array(scores).astype(np.float64), axis=-1)[..., -2:].sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(run(lower(imported.graph, "numpy"), np.array(scores)), top2, rtol=1e-6)


def test_a_scatter_of_elements_imports_as_one_put_along_axis_at_flat_offsets(rng):
    """phi3small's logits mask: ``out[..., ids] = -inf`` (MLX's Scatter, one broadcast index array per axis), with a
    negative id; and ``x[i, 2] = v`` with a runtime index array and a constant one."""
    ids = mx.array([1, 5, -1, 3])

    def mask_ids(x):
        out = x * 2.0
        out[..., ids] = -float("inf")
        return out

    x = mx.array(random_array(rng, (2, 3, 8), "float32"))
    imported = from_mlx(mask_ids, x)
    assert [n.op for n in imported.graph.nodes()].count("put_along_axis") == 1
    assert_mlx_import_reproduces(imported, mask_ids, x)
    assert np.isneginf(np.array(mask_ids(x))[..., [1, 5, 7, 3]]).all()

    def write_column(x, i, v):
        out = x + 0.0
        out[i, 2] = v
        return out

    args = (x[0], mx.array([2, 0], mx.int32), mx.array([5.0, 7.0]))
    assert_mlx_import_reproduces(from_mlx(write_column, *args), write_column, *args)


def test_a_scatter_that_adds_or_writes_windows_is_declined_by_name(rng):
    x = mx.array(random_array(rng, (3, 4), "float32"))
    i = mx.array([0, 2])
    with pytest.raises(ModelImportError, match=r"Scatter.*only plain assignment \(Scatter None\)"):
        from_mlx(lambda x: x.at[i].add(1.0), x)
    with pytest.raises(ModelImportError, match=r"only a scatter of single elements"):

        def rows(x):
            out = x + 0.0
            out[i] = mx.ones((2, 4))
            return out

        from_mlx(rows, x)
