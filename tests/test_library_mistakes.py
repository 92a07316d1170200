"""Issue 44 item 7: a library user's mistake is one AttnpassError whose one-line message names the parameter, what
it got and what is valid, never a foreign exception from deeper down (pipeline text: tests/passes/infra/
test_pipeline.py)."""

from __future__ import annotations

import pytest

from attnpass.ir import AttnpassError, ImportedGraph, TensorSpec, ops, trace
from attnpass.ir.core.arguments import ArgumentError
from attnpass.passes import DeadCodeElimination, PassManager


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
