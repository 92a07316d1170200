"""Issue 44 item 7: a library user's mistake is one AttnpassError whose one-line message names the parameter, what
it got and what is valid, never a foreign exception from deeper down (pipeline text: tests/passes/infra/
test_pipeline.py)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from attnpass.ir import (
    AttnpassError,
    GraphFormatError,
    ImportedGraph,
    ModelImportError,
    PrintSettings,
    TensorSpec,
    format_graph,
    from_jax,
    from_mlx,
    ops,
    parse_graph,
    trace,
)
from attnpass.ir.core.arguments import ArgumentError
from attnpass.ir.core.extras import MissingExtraError
from attnpass.passes import DeadCodeElimination, PassManager, PipelineError
from tests.util import lazy_import, requires, target_params

mx = lazy_import("mlx.core")


def one_line(error: pytest.ExceptionInfo) -> str:
    """The message of an AttnpassError, checked to be one line."""
    assert isinstance(error.value, AttnpassError), repr(error.value)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_pass_manager_runs_an_imported_graph_as_lower_takes_it():
    """Was ``AttributeError: 'ImportedGraph' object has no attribute 'verify'``."""

    def model(x, y):
        ops.relu(y)  # dead: dce removes it
        return ops.exp(x)

    graph = trace(model, TensorSpec((2, 3)), TensorSpec((2, 3)))
    imported = ImportedGraph(graph, {})
    result = PassManager("dce").run(imported)
    assert result.changed and result.graph == PassManager("dce").run(graph).graph
    assert DeadCodeElimination()(imported).graph == PassManager("dce").run(graph).graph
    with pytest.raises(ArgumentError) as error:
        PassManager("dce").run("g.json")
    message = one_line(error)
    assert message.startswith("PassManager.run: graph must be a Graph or an ImportedGraph (from_mlx, from_jax), got")
    assert "'g.json'; read a saved graph first: Graph.from_json(text) or ImportedGraph.load(path)" in message


@requires("mlx_lm")
def test_optimize_checks_its_pipeline_at_once():
    """Was accepted until the first generation compiled a program (compile and jit refuse it at once)."""
    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm

    model = tiny_lm("llama", layers=1)
    original = type(model)
    for pipeline, got in (("bogus", "unknown pass 'bogus'"), ("", "the pipeline is the empty text ''")):
        with pytest.raises(PipelineError) as error:
            optimize(model, pipeline=pipeline)
        message = one_line(error)
        assert message.startswith(f"optimize: pipeline: {got}") and "raise-attention, shard-attention" in message
        assert type(model) is original  # refused before anything was patched
    with pytest.raises(ArgumentError, match=r"optimize: pipeline item 1 must be a pass name .*got 3$"):
        optimize(model, pipeline=["dce", 3])
    with optimize(model, pipeline=["raise-attention", "dce"]) as opt:
        assert opt.pipeline == "raise-attention,dce"


def test_optimize_without_mlx_names_the_extras(monkeypatch):
    """Was ``ModuleNotFoundError: mlx`` (the mlx-lm models it routes come with the zoo extra)."""
    from attnpass.backends.mlx import optimize

    monkeypatch.setitem(sys.modules, "mlx.nn", None)
    with pytest.raises(MissingExtraError) as error:
        optimize(object())
    assert one_line(error).startswith('optimize needs mlx.nn, from the extras mlx,zoo: pip install "attnpass[mlx,zoo]"')
    assert isinstance(error.value, ImportError)


def test_tiny_lm_names_the_extras_it_needs_and_checks_its_choices(monkeypatch):
    """Was ``ModuleNotFoundError: mlx`` (an unknown dtype: AttributeError of mlx.core)."""
    from attnpass.models import tiny_lm, tiny_tokenizer

    with pytest.raises(ArgumentError, match=r"^tiny_lm: family must be one of llama, qwen3, got 'gpt2'$"):
        tiny_lm("gpt2")
    with pytest.raises(ArgumentError, match=r"^tiny_lm: dtype must be one of float32, float16, bfloat16, got 'f32'$"):
        tiny_lm(dtype="f32")
    for module in ("mlx_lm.models.qwen3", "mlx_lm.tokenizer_utils"):
        monkeypatch.setitem(sys.modules, module, None)
    for call, needs in ((lambda: tiny_lm("qwen3"), "tiny_lm needs mlx_lm.models.qwen3"),
                        (tiny_tokenizer, "tiny_tokenizer needs mlx_lm.tokenizer_utils")):  # fmt: skip
        with pytest.raises(MissingExtraError) as error:
            call()
        assert one_line(error).startswith(f'{needs}, from the extras mlx,zoo: pip install "attnpass[mlx,zoo]"')
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]  # what the message tells to install installs them
    assert any(d.startswith("mlx-lm") for d in extras["zoo"]) and any(d.startswith("mlx") for d in extras["mlx"])


def project(q, k):
    return q @ k


@requires("jax", "mlx.core")
def test_from_jax_names_an_mlx_array_and_how_to_convert_it():
    """Was JAX's TypeError about jax.jit's static_argnums."""
    with pytest.raises(ArgumentError) as error:
        from_jax(project, np.ones((2, 3), np.float32), mx.ones((3, 4)))
    assert one_line(error) == (
        "from_jax: example argument k (position 2 after fn) must be arrays (JAX, numpy, jax.ShapeDtypeStruct), "
        "Python scalars (traced, as jax.jit traces them) or pytrees of them, got mlx.array f32[3,4]; convert it "
        "with np.array(x), or import MLX code with from_mlx"
    )


@pytest.mark.parametrize("backend", target_params("mlx", "jax"))
def test_importers_name_the_parameters_of_fn_for_wrong_example_arguments(backend):
    """Was Python's TypeError from calling fn (too few, too many) or from the importer itself (a keyword)."""
    importer, array = (from_mlx, mx.ones) if backend == "mlx" else (from_jax, np.ones)
    q = array((2, 3))
    where = f"from_{backend}"
    for args, got in (((q,), "1 argument(s): missing a required argument: 'k'"),
                      ((q, q, q), "3 argument(s): too many positional arguments")):  # fmt: skip
        with pytest.raises(ArgumentError) as error:
            importer(project, *args)
        assert one_line(error) == (
            f"{where}: example_args must be what project(q, k) takes, got {got}; {where}(fn, *example_args) traces "
            "fn(*example_args)"
        )
    with pytest.raises(ArgumentError) as error:
        importer(project, q, k=q)
    message = one_line(error)
    assert message.startswith(f"{where}: its keywords are name and inline_limit, got k=")
    assert message.endswith(
        f"; example arguments are positional, in the order of project(q, k): {where}(fn, *example_args)"
    )

    def attend(q, k, *, mask):
        return q

    with pytest.raises(
        ArgumentError, match=r"attend\(q, k, \*, mask\) takes, .* \(bind keyword-only mask with functools.partial\)$"
    ):
        importer(attend, q, q)


@pytest.mark.parametrize("backend", target_params("mlx", "jax"))
def test_an_error_fn_raises_while_traced_names_fn_its_line_and_the_backends_message(backend):
    """Was MLX's (or JAX's) own exception from inside the trace: the user's function itself is wrong."""
    importer, array = (from_mlx, mx.ones) if backend == "mlx" else (from_jax, np.ones)
    q = array((2, 3), dtype=mx.float32 if backend == "mlx" else np.float32)
    with pytest.raises(ModelImportError) as error:
        importer(project, q, q)
    message = one_line(error)
    line = project.__code__.co_firstlineno + 1
    assert message.startswith(f"from_{backend}: fn project raised ")
    assert f"on its example arguments ({backend if backend == 'mlx' else 'numpy'}." in message
    assert f" f32[2,3]) at {__file__}:{line} in project: " in message
    native = {
        "mlx": "[matmul] Last dimension of first input with shape (2,3) must match second to last dimension",
        "jax": "dot_general requires contracting dimensions to have the same shape, got (3,) and (2,)",
    }
    assert native[backend] in message
    assert isinstance(error.value.__cause__, (ValueError, TypeError))  # the backend's own error, chained


def test_print_summarises_a_large_constant_numpy_style():
    """Was one 23,531-character line for ``jnp.arange(4096)``: now its shape, dtype and ends around '...'."""
    graph = trace(lambda x: x + ops.constant(np.arange(4096, dtype=np.int32)), TensorSpec((4096,), "int32"))
    printed = str(graph)
    assert max(map(len, printed.splitlines())) < 120, printed
    assert (
        "constant:i32[4096] = constant[value=(0, 1, 2, ..., 4093, 4094, 4095), shape=(4096,), dtype='int32']" in printed
    )
    with pytest.raises(GraphFormatError) as error:
        parse_graph(printed)  # elided text cannot read back, and says how to get text that does
    assert one_line(error) == (
        "line 2: the value of constant was elided when printed (more than 64 values by default): read the graph "
        "from its JSON (graph.to_json()) or from format_graph(graph, PrintSettings(max_values=None))"
    )
    full = format_graph(graph, PrintSettings(max_values=None))
    assert "4093, 4094, 4095)" in full and "..." not in full and parse_graph(full) == graph
    small = trace(lambda x: x + ops.constant(np.arange(64, dtype=np.int32)), TensorSpec((64,), "int32"))
    assert "..." not in str(small) and parse_graph(str(small)) == small  # up to 64 values print whole
