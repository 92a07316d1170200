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
