"""mla-absorb and dsa-gather in the device default pipelines: where they sit, what they read from DEVICES."""

from __future__ import annotations

import dataclasses

import pytest

from attnpass.backends import run
from attnpass.lowering import lower
from attnpass.passes import DSAGather, MLAAbsorb, PassManager, default_pipeline
from attnpass.passes.analysis.devices import DEVICES
from tests.passes.rewrites.mla_graphs import Geometry, mla_graph, mla_inputs
from tests.passes.rewrites.test_mla_absorb import PROMISED, relative


@pytest.mark.parametrize("keep", [True, False], ids=["keep_signature", "full"])
@pytest.mark.parametrize("device", sorted(DEVICES))
def test_absorb_runs_before_the_gathers_and_decompose_sdpa(device, keep):
    names = [p.name for p in default_pipeline(device, keep_signature=keep)]
    assert names.index("mla-absorb") < names.index("qsa-gather") < names.index("dsa-gather")
    assert names.index("dsa-gather") < names.index("decompose-sdpa")
    (absorb,) = [p for p in default_pipeline(device, keep_signature=keep) if isinstance(p, MLAAbsorb)]
    (gather,) = [p for p in default_pipeline(device, keep_signature=keep) if isinstance(p, DSAGather)]
    assert absorb.crossover_factor == DEVICES[device].mla_crossover_factor
    assert gather.tile_bytes == DEVICES[device].dsa_tile_bytes


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_the_promised_pipeline_keeps_the_signature_and_the_function(device):
    g = Geometry(b=2, h=2, rows=4, t=40, r=16, dn=8, dv=8, top_k=6)
    graph = mla_graph(g)
    passes = [dataclasses.replace(p, **PROMISED) if isinstance(p, (MLAAbsorb, DSAGather)) else p
              for p in default_pipeline(device, keep_signature=True)]  # fmt: skip
    result = PassManager(passes).run(graph)
    assert {r.pass_name for r in result.applied()} >= {"mla-absorb", "dsa-gather"}
    assert result.graph.inputs == graph.inputs and result.graph.input_types() == graph.input_types()
    x = mla_inputs(g, 7)
    assert relative(run(lower(result.graph, "numpy"), **x), run(lower(graph, "numpy"), **x)) < 1e-6
