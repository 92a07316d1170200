"""The differential fuzzer in CI (issue 14, item 7): a fixed seed, 2,000 graphs x pipelines, 1,000 JSON mutations.

Every differential case builds a random valid graph (tests/fuzz/families.py),
a random pipeline over the pass registry, and compares the rewritten graph
with the original on the numpy reference; a failure prints a shrunk
reproducer (graph text, pipeline text, inputs) and its replay command.
``make fuzz N=100000`` runs more and prints the rate. Sized for two minutes
on a quiet 2-core machine (measured: ~45 s for both tests).
"""

from __future__ import annotations

import json

import pytest

from attnpass.ir import Graph
from tests.fuzz import fuzz, report
from tests.fuzz.families import FAMILIES
from tests.fuzz.json_mutation import check_loader

SEED = 0
N_GRAPHS = 2000
N_JSON = 1000


def test_pipelines_preserve_what_graphs_compute():
    failures, _seconds = fuzz(N_GRAPHS, SEED, tuple(FAMILIES), shrink_seconds=30)
    assert not failures, report(failures[0])


def test_the_loader_loads_or_refuses_with_an_attnpass_error():
    failures, _seconds = fuzz(N_JSON, SEED, ("json",), shrink_seconds=30)
    assert not failures, report(failures[0])


def _doc(**attrs) -> dict:
    """A one-sdpa graph document; ``attrs`` replace the sdpa attributes."""

    def node(name, op, inputs, node_attrs, shape):
        loc = {"file": "model.py", "line": 3, "function": "f"}
        return {"name": name, "op": op, "inputs": inputs, "attrs": node_attrs,
                "type": {"shape": shape, "dtype": "float32"}, "loc": loc}  # fmt: skip

    inputs = [
        node(n, "input", [], {"shape": [1, 1, 2, 4], "dtype": "float32", "role": "streamed"}, [1, 1, 2, 4])
        for n in "qkv"
    ]
    sdpa = node("o", "sdpa", ["q", "k", "v"], {"scale": None, "causal": "none", **attrs}, [1, 1, 2, 4])
    return {"format": "attnpass.graph", "version": 1, "name": "g", "inputs": list("qkv"), "outputs": ["o"],
            "nodes": inputs + [sdpa]}  # fmt: skip


REPRODUCERS = {
    "deep-nesting": json.dumps(_doc())[:-1] + ', "extra": ' + "[" * 3000 + "]" * 3000 + "}",
    "long-int": json.dumps(_doc()).replace('"line": 3', '"line": ' + "9" * 5000, 1),
    "huge-scale": json.dumps(_doc()).replace('"scale": null', '"scale": 1' + "0" * 400),
    "nan-location": json.dumps(_doc()).replace('"function": "f"', '"function": NaN', 1),
}


def test_a_valid_document_loads():
    assert check_loader(json.dumps(_doc())) is None
    assert Graph.from_json(json.dumps(_doc())).node("o").op == "sdpa"


@pytest.mark.parametrize("name", sorted(REPRODUCERS))
def test_loader_crashes_the_fuzzer_found_are_clean_errors_now(name):
    failure = check_loader(REPRODUCERS[name])
    assert failure is None, f"{failure.kind}: {failure.message}"
