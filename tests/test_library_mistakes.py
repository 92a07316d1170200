"""Issue 44 item 7: a library user's mistake is one AttnpassError whose one-line message names the parameter, what
it got and what is valid, never a foreign exception from deeper down (pipeline text: tests/passes/infra/
test_pipeline.py)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from attnpass.ir import AttnpassError, ImportedGraph, TensorSpec, ops, trace
from attnpass.ir.core.arguments import ArgumentError
from attnpass.ir.core.extras import MissingExtraError
from attnpass.passes import DeadCodeElimination, PassManager, PipelineError
from tests.util import requires


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
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(d.startswith("mlx-lm") for d in extras["zoo"]) and any(d.startswith("mlx") for d in extras["mlx"])
