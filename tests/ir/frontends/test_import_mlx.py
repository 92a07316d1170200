"""from_mlx: MLX primitives -> IR ops with exact parameters, numerics on every target, clear errors.

Also the ops the importers added to the IR (broadcast_to, sin, cos, sigmoid,
floor_divide, argpartition, put_along_axis): shape rules and emitters.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import ModelImportError, ShapeError, TensorSpec, TensorType, from_mlx, ops, trace
from attnpass.lowering import lower
from tests.util import assert_close, assert_mlx_import_reproduces, lazy_import, random_array, requires

mx = lazy_import("mlx.core")
nn = lazy_import("mlx.nn")


def _ops(graph):
    return [n.op for n in graph.nodes() if n.op != "input"]


_check_targets = assert_mlx_import_reproduces


@requires("mlx.core", "jax")
def test_layout_primitives_keep_their_exact_parameters(rng):
    x = mx.array(rng.standard_normal((2, 6, 4)).astype(np.float32))

    def layout(x):
        y = x.reshape(2, 2, 3, 4)  # Reshape
        y = mx.transpose(y, (0, 2, 1, 3))  # Transpose [0, 2, 1, 3]
        y = mx.broadcast_to(y[:, :, :, None, :], (2, 3, 2, 5, 4))  # ExpandDims + Broadcast
        y = y[:, 1:3, :, ::2, 1:]  # Slice with a stride
        a, b = mx.split(y, [1], axis=1)  # Split
        return mx.concatenate([b, a], axis=1).flatten(0, 1)  # Concatenate + Flatten

    imported = from_mlx(layout, x)
    graph = imported.graph
    perms = [n.attrs["perm"] for n in graph.nodes() if n.op == "transpose"]
    assert perms == [(0, 2, 1, 3)]
    (bcast,) = [n for n in graph.nodes() if n.op == "broadcast_to"]
    assert bcast.attrs["shape"] == (2, 3, 2, 5, 4)
    strided = [n for n in graph.nodes() if n.op == "slice" and n.attrs["step"] != (1,) * 5]
    assert strided[0].attrs["start"] == (0, 1, 0, 0, 1) and strided[0].attrs["step"] == (1, 1, 1, 2, 1)
    assert "concat" in _ops(graph) and graph.node(graph.outputs[0]).type == TensorType((4, 2, 3, 3), "float32")
    _check_targets(imported, layout, x)


@requires("mlx.core", "jax")
def test_arithmetic_softmax_reductions_and_casts(rng):
    x = mx.array(rng.standard_normal((3, 5)).astype(np.float32))
    w = mx.array(rng.standard_normal((5, 5)).astype(np.float32))  # captured, > inline limit? no: 25 elements

    def arith(x):
        y = mx.softmax(x @ w, axis=-1, precise=True) * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + 1e-6)
        z = mx.sigmoid(x) + mx.sin(x) - mx.cos(x) / mx.exp(-x)
        i = (mx.arange(5) // 2).astype(mx.float32)
        return mx.where(x > 0, y, mx.maximum(z, i)).astype(mx.float16)

    imported = from_mlx(arith, x)
    ops_ = _ops(imported.graph)
    for op in ("softmax", "rsqrt", "sigmoid", "sin", "cos", "floor_divide", "where", "less", "cast", "sum"):
        assert op in ops_, op
    softmax = next(n for n in imported.graph.nodes() if n.op == "softmax")
    assert softmax.attrs == {"axis": -1, "precise": True}
    _check_targets(imported, arith, x)


@requires("mlx.core", "jax")
def test_captured_arrays_become_constants_or_resident_params(rng):
    small = mx.array([1.0, 2.0, 3.0])
    big = mx.array(rng.standard_normal((16, 8)).astype(np.float32))
    x = mx.array(rng.standard_normal((2, 16)).astype(np.float32))

    def project(x):
        return (x @ big) * small.sum()

    imported = from_mlx(project, x)
    graph = imported.graph
    (param,) = imported.params
    assert graph.inputs == ("x", param) and graph.input_role(param) == "resident"
    np.testing.assert_array_equal(imported.params[param], np.array(big))
    assert any(n.op == "constant" and n.attrs["value"] == (1.0, 2.0, 3.0) for n in graph.nodes())
    _check_targets(imported, project, x)


@requires("mlx.core", "jax")
def test_slice_update_pad_gather_and_scatter(rng):
    x = mx.array(rng.standard_normal((2, 6, 4)).astype(np.float32))
    idx = mx.array(np.array([3, 0, 5], dtype=np.int32))

    def indexing(x):
        y = mx.zeros((2, 8, 4))
        y[:, 1:7, :] = x  # SliceUpdate
        y = mx.pad(y, [(0, 0), (1, 2), (0, 0)], constant_values=-1.0)  # Pad
        rows = mx.take(y, idx, axis=1)  # Gather on one axis
        point = x[mx.array([1, 0]), mx.array([2, 4])]  # Gather with two index arrays
        order = mx.argpartition(x[0, :, 0], kth=3).astype(mx.int32)
        marks = mx.put_along_axis(mx.zeros((6,), dtype=mx.bool_), order[3:], mx.array(True), axis=0)  # ScatterAxis
        return rows.sum() + point.sum() + mx.where(marks, x[0, :, 0], 0.0).sum()

    imported = from_mlx(indexing, x)
    ops_ = _ops(imported.graph)
    for op in ("take", "argpartition", "put_along_axis", "concat"):
        assert op in ops_, op
    _check_targets(imported, indexing, x)


@requires("mlx.core", "jax")
def test_a_top_k_mask_of_a_shapeless_compiled_argpartition_is_the_function_as_written(rng):
    """hy_v4's sparse attention mask (mlx_vlm/models/hy_v4: its indexer's ``mx.compile(shapeless=True)``
    argpartition of masked scores, ``kth=-top_k``; the last ``top_k`` indices ``put_along_axis``'d into a zero mask,
    True broadcast, and-ed with the causal mask). The helper first traced on 5 keys, then called on 12: the graph is
    the function as written, each call at its own shapes (MLX's uncompiled run, bit for bit on MLX), keeping each
    row's top 2 of its unmasked scores. MLX's compiled run replays kth=3 of the first trace (two of the top 9): what
    the sweep reports as the module's, not the import's (tests/models/test_mlx_lm_sweep.py)."""

    def partition(scores, mask):
        return mx.argpartition(mx.where(mask, scores, -float("inf")), kth=-2, axis=-1)

    compiled_partition = mx.compile(partition, shapeless=True)

    def sparse(scores, mask):
        top = compiled_partition(scores, mask)[..., -2:]
        keep = mx.put_along_axis(mx.zeros(scores.shape, dtype=mx.bool_), top, mx.array(True), axis=-1)
        return mx.where(keep & mask, scores, 0.0)

    prompt = mx.array(rng.standard_normal((1, 3, 5)).astype(np.float32))
    compiled_partition(prompt, mx.ones(prompt.shape, dtype=mx.bool_))  # traced at 5 keys
    scores = mx.array(rng.standard_normal((1, 3, 12)).astype(np.float32))
    mask = mx.array(np.tril(np.ones((3, 12), bool), 9)[None])
    imported = from_mlx(sparse, scores, mask)
    assert {"argpartition", "put_along_axis", "logical_and", "where"} <= set(_ops(imported.graph))
    (kth,) = [n.attrs["kth"] for n in imported.graph.nodes() if n.op == "argpartition"]
    assert kth == 10  # -2 of this call's 12 keys
    masked = np.where(np.array(mask), np.array(scores), -np.inf)
    second = np.sort(masked, axis=-1)[..., -2:-1]
    top2 = np.where(masked >= second, np.array(scores), 0.0)
    mx.disable_compile()
    try:
        _check_targets(imported, sparse, scores, mask)  # against MLX's uncompiled run
    finally:
        mx.enable_compile()
    np.testing.assert_array_equal(run(lower(imported.graph, "numpy"), np.array(scores), np.array(mask)), top2)


@requires("mlx.core")
def test_compiled_helpers_import_and_compilation_is_restored(rng):
    helper = mx.compile(lambda a: mx.exp(a) * 2.0)
    x = mx.array(rng.standard_normal((4,)).astype(np.float32))
    imported = from_mlx(lambda x: helper(x) + 1.0, x)
    assert _ops(imported.graph).count("exp") == 1
    calls = []
    counted = mx.compile(lambda a: calls.append(1) or a + 1)
    counted(x), counted(x)
    assert calls == [1]  # compiled again after the import: traced once, then cached


@requires("mlx.core")
def test_a_compiled_helper_of_a_weight_beside_a_cache_write_imports_the_step_from_its_first_state(rng):
    # recurrent_gemma: nn.softplus (mx.compile'd) of a weight, and a cache the step writes; an export retried after
    # the compiled helper failed it saw the cache its first attempt had written (offset 2, keys updated in place)
    softplus = mx.compile(lambda a: mx.logaddexp(a, 0.0))
    weight = mx.array(rng.standard_normal((4,)).astype(np.float32))

    class Cache:
        def __init__(self):
            self.offset, self.keys = 0, mx.zeros((1, 6, 4))

    def step(x):
        cache.keys[:, cache.offset : cache.offset + 2, :] = x
        cache.offset += 2
        return cache.keys * softplus(weight)

    x = mx.array(rng.standard_normal((1, 2, 4)).astype(np.float32))
    cache = Cache()
    imported = from_mlx(step, x)
    assert cache.offset == 2  # traced once
    cache = Cache()
    expected = np.array(step(x))
    assert np.count_nonzero(expected[:, 2:]) == 0  # the first step writes rows 0-1 only
    got = run(lower(imported.graph, "numpy"), np.array(x), **imported.params)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@requires("mlx.core")
def test_compilation_stays_off_after_an_import_when_the_caller_turned_it_off(rng):
    x = mx.array(rng.standard_normal((4,)).astype(np.float32))
    calls = []
    counted = mx.compile(lambda a: calls.append(1) or a + 1)
    mx.disable_compile()
    try:
        from_mlx(lambda x: x * 2.0, x)
        counted(x), counted(x)
    finally:
        mx.enable_compile()
    assert calls == [1, 1]  # not compiled: traced on every call


@requires("mlx.core")
def test_a_custom_metal_kernel_is_named_as_needing_metal_before_its_packed_operands(rng):
    # bitnet's bitlinear_matmul reads uint8 packed weights (no IR dtype): the kernel is the reason, not the dtype
    kernel = mx.fast.metal_kernel(
        name="twice", input_names=["x", "packed"], output_names=["y"],
        source="uint i = thread_position_in_grid.x; y[i] = 2 * x[i] + packed[i];",
    )  # fmt: skip
    packed = mx.array(np.arange(4, dtype=np.uint8))

    def twice(x):
        (y,) = kernel(inputs=[x, packed], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
                      output_dtypes=[mx.float32])  # fmt: skip
        return y + 1.0

    with pytest.raises(ModelImportError) as err:
        from_mlx(twice, mx.array(rng.standard_normal((4,)).astype(np.float32)))
    message = str(err.value)
    assert "MLX primitive CustomKernel custom_kernel_twice" in message and "needs Metal" in message
    assert "test_import_mlx.py" in message and "in twice" in message


@requires("mlx.core")
def test_unsupported_primitive_names_itself_and_its_place(rng):
    x = mx.array(rng.random((2, 3)).astype(np.float32) + 0.5)
    with pytest.raises(ModelImportError) as err:
        from_mlx(lambda x: mx.sort(x * 2.0, axis=1), x)
    message = str(err.value)
    assert "unsupported MLX primitive Sort" in message and "float32[2, 3]" in message
    assert "test_import_mlx.py" in message


def _attend(q, k, v):
    scores = (q @ k.swapaxes(-1, -2)) * 0.125
    return mx.softmax(scores, axis=-1) @ v


def _sorted(x):
    doubled = x * 2.0
    return mx.sort(doubled, axis=1)


def _line_of(fn, offset: int = 0) -> int:
    return fn.__code__.co_firstlineno + offset


@requires("mlx.core")
@pytest.mark.parametrize("kind", ["def", "lambda"])
def test_locations_and_remarks_name_the_users_source_line(rng, kind):
    from attnpass.passes import PassManager, RaiseAttention

    lam = lambda q, k, v: mx.softmax((q @ k.swapaxes(-1, -2)) * 0.125, axis=-1) @ v  # noqa: E731
    fn, scores_line, out_line = (
        (_attend, _line_of(_attend, 1), _line_of(_attend, 2)) if kind == "def" else (lam, _line_of(lam), _line_of(lam))
    )
    q, k, v = (mx.array(random_array(rng, (1, 2, 4, 8), "float32")) for _ in range(3))
    graph = from_mlx(fn, q, k, v).graph
    locs = {n.loc for n in graph.nodes() if n.op not in ("input", "constant")}
    assert {(loc.file, loc.line) for loc in locs} == {(__file__, scores_line), (__file__, out_line)}
    assert {loc.function for loc in locs} == {fn.__name__}
    (remark,) = [r for r in PassManager([RaiseAttention()]).run(graph).applied() if "-> sdpa" in r.message]
    assert (remark.loc.file, remark.loc.line) == (__file__, out_line)
    assert str(remark).endswith(f"({__file__}:{out_line} in {fn.__name__})")


@requires("mlx.core")
def test_an_import_error_names_the_line_without_a_replay(rng, monkeypatch):
    import attnpass.ir.frontends.import_mlx as import_mlx

    monkeypatch.setattr(import_mlx, "locate", lambda *a, **k: pytest.fail("replayed"))
    with pytest.raises(ModelImportError) as err:
        from_mlx(_sorted, mx.array(random_array(rng, (2, 3), "float32")))
    assert str(err.value).endswith(f"at {__file__}:{_line_of(_sorted, 2)} in _sorted")


@requires("mlx.core")
def test_an_array_made_from_the_example_argument_itself_does_not_break_the_import(rng):
    """The export refuses such an array as an output: the import runs again without the lines."""
    x = mx.array(random_array(rng, (2, 3), "float32"))

    def step(y):
        unused = x * 2.0  # x is the example argument itself, not the export's tracer of it
        return y + 1.0, unused.shape

    imported = from_mlx(lambda y: step(y)[0], x)
    assert "mul" not in _ops(imported.graph)  # the unused product is not imported
    assert imported.graph.node(imported.graph.outputs[0]).loc.file.startswith("mlx:")
    _check_targets(imported, lambda y: step(y)[0], x)


@requires("mlx.core")
def test_uninitialised_parameters_get_a_hint():
    layer = nn.Linear(4, 4)
    with pytest.raises(ModelImportError, match=r"RandomBits.*mx.eval\(model.parameters\(\)\)"):
        from_mlx(lambda x: layer(x), mx.ones((1, 4)))


@requires("mlx.core")
def test_a_model_left_in_training_mode_gets_the_model_eval_hint():
    """MLX modules start in training mode: a dropout layer draws random bits. The import says to call
    model.eval() (not mx.eval(model.parameters()), the hint for unevaluated weights), and after it imports."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 2))
    mx.eval(model.parameters())
    x = mx.ones((1, 4))
    with pytest.raises(ModelImportError, match=r"RandomBits.*training mode.*call model\.eval\(\) first") as info:
        from_mlx(lambda x: model(x), x)
    assert "mx.eval(model.parameters())" not in str(info.value)
    model.eval()
    _check_targets(from_mlx(lambda x: model(x), x), lambda x: model(x), x)


# ----------------------------------------------------------------------------- the ops importers added


def test_new_op_shape_rules_quote_the_operands():
    with pytest.raises(ShapeError, match=r"broadcast_to: operand f32\[2,3\] does not broadcast to \[4, 3, 2\]"):
        trace(lambda x: ops.broadcast_to(x, (4, 3, 2)), TensorSpec((2, 3), "float32"))
    with pytest.raises(ShapeError, match=r"argpartition: kth=5 out of range"):
        trace(lambda x: ops.argpartition(x, 5), TensorSpec((2, 5), "float32"))
    with pytest.raises(ShapeError, match=r"put_along_axis: values .* must have the dtype of x"):
        trace(
            lambda x, i, v: ops.put_along_axis(x, i, v, 1),
            *[TensorSpec(s, d) for s, d in (((2, 5), "float32"), ((2, 2), "int32"), ((2, 2), "float16"))],
        )


@requires("mlx.core", "jax")
def test_new_ops_agree_on_every_target(rng):
    def program(x, idx, y):
        wave = ops.add(ops.sin(x), ops.mul(ops.cos(x), ops.sigmoid(x)))
        wide = ops.broadcast_to(ops.reshape(wave, (1, 4, 6)), (3, 4, 6))
        top = ops.argpartition(x, 4, axis=1)
        return wide, top, ops.floor_divide(top, 2), ops.put_along_axis(x, idx, y, axis=1)

    specs = [TensorSpec((4, 6), "float32"), TensorSpec((4, 2), "int32"), TensorSpec((4, 2), "float32")]
    graph = trace(program, *specs)
    x = rng.permutation(24).reshape(4, 6).astype(np.float32)  # distinct values: one valid partition set
    idx = np.array([[0, 5], [1, 2], [3, -1], [4, 0]], dtype=np.int32)  # -1 wraps to the last column
    y = rng.standard_normal((4, 2)).astype(np.float32)
    expected = run(lower(graph, "numpy"), x, idx, y)
    np.testing.assert_array_equal(expected[3][2], [x[2, 0], x[2, 1], x[2, 2], y[2, 0], x[2, 4], y[2, 1]])
    for target in ("mlx", "jax"):
        wide, top, half, marks = run(lower(graph, target), x, idx, y)
        assert_close(wide, expected[0])
        np.testing.assert_array_equal(marks, expected[3])
        picked = np.take_along_axis(x, top, axis=1)  # partition property; the order inside each side is free
        assert (
            top.dtype == np.int32
            and np.all(picked[:, :4].max(1) <= picked[:, 4])
            and np.all(picked[:, 5] >= picked[:, 4])
        )
        np.testing.assert_array_equal(np.sort(top, 1), np.tile(np.arange(6), (4, 1)))
        np.testing.assert_array_equal(half, top // 2)
