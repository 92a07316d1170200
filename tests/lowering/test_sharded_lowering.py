"""The sharded JAX lowering in this process (one CPU device): generated source, StableHLO and errors.

Programs are generated for abstract meshes (axis names and sizes, no devices)
or run on a one-device mesh; the 8-device runs are in tests/backends/test_sharded_mesh.py, the
command line's --mesh in tests/cli/test_cli_mesh.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import LoweringError, lower
from attnpass.lowering.targets.jax import export_stablehlo
from attnpass.models import QSAConfig, verify_step
from attnpass.passes import PassManager, parse_pipeline
from tests.sharded_cases import verify_graph, verify_inputs
from tests.util import assert_bits_equal, requires

pytestmark = requires("jax")


def abstract(**axes: int):
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def sharded(pipeline: str = "head-chunk,shard-attention{heads=model}", **axes: int):
    graph = verify_step(q_len=4, kv_len=256)
    graph.set_mesh(axes or {"model": 2})
    return PassManager(parse_pipeline(pipeline)).run(graph).graph


def test_without_a_mesh_the_annotations_are_ignored():
    plain = verify_graph(QSAConfig(n_q_heads=32, n_kv_heads=8), kv_len=256)
    annotated = plain.copy()
    annotated.set_mesh({"model": 8})
    annotated = PassManager(parse_pipeline("shard-attention{heads=model}")).run(annotated).graph
    assert annotated.node("sdpa").sharding is not None
    assert lower(annotated, "jax", comments=False).source == lower(plain, "jax", comments=False).source
    assert lower(annotated, "jax").identity == lower(plain, "jax").identity


def test_every_annotated_value_is_constrained_and_the_entry_point_places_inputs_and_outputs():
    graph = sharded()
    source = lower(graph, "jax", mesh=abstract(model=2)).source
    annotated = [n.name for n in graph.nodes() if n.sharding is not None and n.op != "input"]
    constrained = re.findall(
        r"^    (\w+) = jax\.lax\.with_sharding_constraint\(\1, NamedSharding\(mesh, P\(", source, re.M
    )
    assert constrained == annotated
    assert "from jax.sharding import NamedSharding, PartitionSpec as P" in source
    assert "        NamedSharding(mesh, P(None, 'model', None, None)),  # k_cache\n" in source
    assert "        NamedSharding(mesh, P()),  # mask\n" in source  # unannotated input: replicated
    assert source.rstrip().endswith(
        "    out_shardings=NamedSharding(mesh, P(None, 'model', None, None)),  # sdpa_heads_regrouped\n)"
    )


def test_stablehlo_export_keeps_the_shardings():
    text = export_stablehlo(lower(sharded(), "jax", mesh=abstract(model=2)))
    main_line = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert main_line.count('sdy.sharding = #sdy.sharding<@mesh, [{}, {"model"}, {}, {}]>') == 4  # q, k, v, result
    assert "sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}, {}]>" in main_line  # the replicated mask
    assert "sdy.sharding_constraint" in text
    assert "sdy.sharding" not in export_stablehlo(lower(sharded(), "jax"))


def test_a_one_device_mesh_runs_the_program_and_returns_sharded_outputs():
    import jax
    from jax.sharding import AxisType

    graph = sharded(model=1)
    assert graph.node("k_cache").sharding == (None, "model", None, None)
    mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
    program = lower(graph, "jax", mesh=mesh)
    arrays = verify_inputs(graph)
    out = program(**arrays)
    assert out.sharding.spec == jax.sharding.PartitionSpec(None, "model", None, None)
    assert_bits_equal(np.asarray(out), np.asarray(jax.jit(lower(graph, "jax").fn)(*lower(graph, "jax").bind(**arrays))))


def test_generated_names_never_shadow_the_mesh_helpers():
    def clash(mesh, P, NamedSharding):  # noqa: N803
        return ops.add(ops.add(mesh, P), NamedSharding)

    graph = trace(clash, *[TensorSpec((2, 4))] * 3)
    graph.set_mesh({"model": 2})
    graph.set_sharding("add", ("model", None))
    source = lower(graph, "jax", mesh=abstract(model=2)).source
    assert "def clash(mesh_1, P_1, NamedSharding_1):" in source


@pytest.mark.parametrize(
    ("target", "mesh", "message"),
    [
        ("mlx", {"model": 2}, "lower(mesh=): target 'mlx' has no sharded lowering; targets with one: jax"),
        ("jax", {"data": 2}, "annotated for mesh axes model=2, but the mesh has data=2"),
        ("jax", {"model": 4}, "annotated for mesh axes model=2, but the mesh has model=4"),
    ],
)
def test_a_mesh_that_does_not_fit_is_a_lowering_error(target, mesh, message):
    with pytest.raises(LoweringError, match=re.escape(message)):
        lower(sharded(), target, mesh=abstract(**mesh))


def test_explicit_mesh_axes_are_rejected_with_the_fix():
    import jax
    from jax.sharding import AbstractMesh, AxisType

    explicit = AbstractMesh((2,), ("model",), axis_types=(AxisType.Explicit,))
    with pytest.raises(
        LoweringError, match=re.escape("build the mesh with axis_types=(jax.sharding.AxisType.Auto,) * n")
    ):
        lower(sharded(), "jax", mesh=explicit)
    with pytest.raises(LoweringError, match="mesh must be a jax.sharding.Mesh or AbstractMesh, got dict"):
        lower(sharded(), "jax", mesh={"model": 2})
    assert jax.device_count() == 1  # this process keeps one device; 8-device runs live in a subprocess
