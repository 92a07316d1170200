"""Issue 32 item 3: every public entry point answers a wrong type or value with an ArgumentError (an
AttnpassError) naming the parameter, what it got and what is valid; a caller's own mistake under the
drop-in wrappers is the caller's error, with no FallbackWarning blaming the import."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from attnpass.backends.dispatch import run
from attnpass.ir import AttnpassError, ImportedGraph, TensorSpec, trace
from attnpass.ir.core.arguments import ArgumentError
from attnpass.lowering import lower
from attnpass.passes import DeadCodeElimination, HeadChunkSDPA, PassManager, parse_pipeline
from tests.util import requires


def test_lower_and_run_take_an_imported_graph_and_its_weights():
    mx = pytest.importorskip("mlx.core")
    from attnpass.ir import from_mlx

    w = mx.array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096)
    imported = from_mlx(lambda x: x @ w, mx.ones((2, 64)))
    assert list(imported.params) == ["w"]
    x = np.ones((2, 64), np.float32)
    expected = x @ np.array(w)
    for target in ("numpy", "mlx"):
        np.testing.assert_allclose(run(lower(imported, target), x), expected, rtol=1e-5)
    with pytest.raises(
        ArgumentError,
        match=r"lower: graph must be a Graph or an ImportedGraph .*got 'g.json'; .*ImportedGraph.load\(path\)",
    ):
        lower("g.json", "mlx")
    with pytest.raises(ArgumentError, match=r"run: program must be a Program .*got an ImportedGraph; lower it first"):
        run(imported, x)


def test_pipelines_as_sequences_and_text():
    assert parse_pipeline(["head-chunk", "dce"]) == [HeadChunkSDPA(), DeadCodeElimination()]
    assert PassManager("head-chunk,dce").passes == (HeadChunkSDPA(), DeadCodeElimination())
    with pytest.raises(ArgumentError, match="PassManager: pipeline item 0 must be a pass name .*got 3"):
        PassManager([3])
    with pytest.raises(ArgumentError, match="parse_pipeline: the pipeline must be pipeline text .*got 3"):
        parse_pipeline(3)


def test_imported_graph_load_names_a_missing_path(tmp_path):
    with pytest.raises(
        ArgumentError, match="ImportedGraph.load: path must be a graph JSON file .*missing.json'; it does not exist"
    ):
        ImportedGraph.load(tmp_path / "missing.json")


def test_tensor_spec_checks_its_dtype_at_once():
    with pytest.raises(
        ArgumentError, match=r"TensorSpec: dtype must be a DType or one of .*bfloat16 \(bf16\).*got 'bf16x'"
    ):
        TensorSpec((1, 2), "bf16x")
    with pytest.raises(ArgumentError, match="TensorSpec: shape must be a tuple of non-negative ints"):
        TensorSpec((1, -2))
    with pytest.raises(ArgumentError, match="trace: the spec of parameter x must be a TensorSpec"):
        trace(lambda x: x, "q")
    assert issubclass(ArgumentError, AttnpassError)


@requires("mlx")
def test_mlx_compile_refuses_numpy_arrays_by_name_without_printing_them():
    import attnpass.backends.mlx as amx

    q = np.ones((1, 8, 16, 64), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ArgumentError) as caught:
            amx.compile(lambda q, k: q @ k)(q, q)
    message = str(caught.value)
    assert "argument q must be an mx.array" in message and "numpy.ndarray f32[1,8,16,64]" in message
    assert len(message) < 300


@requires("mlx")
@pytest.mark.parametrize("case", ["gqa", "mask", "keyword"])
def test_a_callers_own_mistake_is_raised_without_blaming_the_import(case):
    import mlx.core as mx

    import attnpass.backends.mlx as amx

    def attend(q, k, v, *, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

    q, kv3 = mx.ones((1, 8, 16, 64)), mx.ones((1, 3, 16, 64))
    args, kwargs = {"gqa": ((q, kv3, kv3), {"mask": None}), "mask": ((q, q, q), {"mask": mx.ones((3, 5))}),
                    "keyword": ((q, q, q), {})}[case]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FallbackWarning would fail the test
        with pytest.raises((ValueError, TypeError)) as caught:
            amx.compile(attend)(*args, **kwargs)
    assert not isinstance(caught.value, AttnpassError)
    assert caught.value.__context__ is None or caught.value.__suppress_context__


@requires("mlx.core")
def test_from_mlx_python_scalars_are_static_as_mx_compile_treats_them():
    """A Python int, float or bool argument is part of the graph (no input for it), the lowered program is called
    with the arrays only and computes fn for that value (was MLX's raw '[export_function] Inputs can either be')."""
    import mlx.core as mx

    from attnpass.ir import from_mlx

    x = mx.array(np.arange(4, dtype=np.float32))
    for n in (3, 2.5, True):
        imported = from_mlx(lambda x, n: x * n, x, n)
        assert imported.graph.inputs == ("x",), imported.graph
        expected = np.array(x * n)
        for target in ("numpy", "mlx"):
            np.testing.assert_array_equal(run(lower(imported, target), np.array(x)), expected)
    imported = from_mlx(lambda scale, x, causal: x * scale if causal else x, 0.5, x, True)
    assert imported.graph.inputs == ("x",)
    np.testing.assert_array_equal(run(lower(imported, "mlx"), np.array(x)), np.array(x) * 0.5)


@requires("mlx.core")
def test_from_mlx_names_a_swapped_call_and_an_argument_it_cannot_take():
    import mlx.core as mx

    from attnpass.ir import from_mlx

    q = mx.ones((2,))
    with pytest.raises(
        ArgumentError,
        match=r"from_mlx: fn must be the function to import \(a callable\), got mlx.array f32\[2\]; the arguments "
        r"look swapped: from_mlx\(fn, \*example_args\)",
    ):
        from_mlx(q, lambda x: x)
    valid = r"must be an mx.array, or a Python bool, int or float \(static, as mx.compile treats it\)"
    with pytest.raises(ArgumentError, match=rf"example argument x \(position 1 after fn\) {valid}, got numpy"):
        from_mlx(lambda x: x * 2, np.ones((2,), np.float32))
    with pytest.raises(ArgumentError, match=rf"example argument kv \(position 2 after fn\) {valid}, got tuple.*each"):
        from_mlx(lambda x, kv: x * kv[0], q, (q, q))
    with pytest.raises(ArgumentError, match=rf"example argument mode .* {valid}, got 'causal'"):
        from_mlx(lambda x, mode: x, q, "causal")


@requires("jax")
def test_from_jax_traces_python_scalars_and_names_what_it_cannot_take():
    """JAX's convention: a Python scalar is traced as jax.jit traces it (a weakly typed scalar input)."""
    from attnpass.ir import from_jax

    x = np.arange(4, dtype=np.float32)
    imported = from_jax(lambda x, n: x * n, x, 3)
    assert imported.graph.inputs == ("x", "n") and str(imported.graph.node("n").type) == "i32[]"
    np.testing.assert_array_equal(run(lower(imported, "numpy"), x, np.int32(4)), x * 4)
    with pytest.raises(ArgumentError, match=r"from_jax: fn must be .*got numpy.ndarray f32\[4\]; the arguments look"):
        from_jax(x, lambda x: x)
    with pytest.raises(ArgumentError, match=r"from_jax: example argument mode \(position 2 after fn\) must be arrays"):
        from_jax(lambda x, mode: x, x, "causal")
