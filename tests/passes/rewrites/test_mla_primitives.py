"""Primitive counts of the rewritten MLA/DSA programs as the backends report them (MLX export, JAX jaxprs).

Absorbed, no matmul writes per-head K or V over the cache (``[B, H, T, Dn|Dv]``); gathered, the dense selection
mask is never built (no scatter) and the latent is gathered once per tile, its mask values once.
"""

from __future__ import annotations

import pytest

from attnpass.backends import count_primitives
from attnpass.lowering import lower
from attnpass.lowering.targets.mlx import target as mlx_backend
from attnpass.passes import DeadCodeElimination, DSAGather, MLAAbsorb, PassManager
from tests.passes.rewrites.mla_graphs import Geometry, mla_graph, mla_inputs
from tests.passes.rewrites.test_mla_absorb import PROMISED
from tests.util import available, lazy_import, requires

pytestmark = requires("mlx.core", "jax")
mx = lazy_import("mlx.core")
mlx_cpu_only = pytest.mark.skipif(
    available("mlx.core") and mx.default_device().type != mx.DeviceType.cpu, reason="MLX CPU routing"
)
G = Geometry(b=1, h=2, rows=3, t=32, r=16, dn=8, dv=4, top_k=6)


def rewritten(g: Geometry, *, tile_bytes: int = 0):
    passes = [MLAAbsorb(**PROMISED), DSAGather(tile_bytes=tile_bytes, **PROMISED), DeadCodeElimination()]
    return PassManager(passes).run(mla_graph(g)).graph


def expansions(graph, g: Geometry) -> list:
    """The MLX matmuls whose output is a per-head K or V over the whole cache."""
    expanded = {(g.b, g.h, g.t, g.dn), (g.b, g.h, g.t, g.dv)}
    records = mlx_backend.primitives(lower(graph, "mlx"), **mla_inputs(g))
    return [r for r in records if r.name == "Matmul" and r.outputs[0][0] in expanded]


@mlx_cpu_only
def test_mlx_absorbed_program_never_expands_the_latent():
    plain = Geometry(b=1, h=2, rows=3, t=32, r=16, dn=8, dv=4, top_k=None)
    assert len(expansions(mla_graph(plain), plain)) == 2  # the traced form: K and V over all T
    assert expansions(rewritten(plain), plain) == []
    counts = count_primitives(lower(rewritten(plain), "mlx"), **mla_inputs(plain))
    assert counts["Matmul"] == 4 and counts["Softmax"] == 1  # q·W_ukᵀ, scores, P·c, ·W_uv


@mlx_cpu_only
@pytest.mark.parametrize("tile_bytes, tiles", [(0, 1), (1, 3)])
def test_mlx_gathered_program_gathers_the_latent_once_per_tile_and_builds_no_mask(tile_bytes, tiles):
    before = count_primitives(lower(mla_graph(G), "mlx"), **mla_inputs(G))
    assert before["ScatterAxis"] == 1 and before["Gather"] == 0  # put_along_axis over [B, 1, L, T]
    counts = count_primitives(lower(rewritten(G, tile_bytes=tile_bytes), "mlx"), **mla_inputs(G))
    assert (counts["Gather"], counts["GatherAxis"], counts["ScatterAxis"], counts["Select"]) == (tiles, tiles, 0, 0)
    assert counts["Softmax"] == tiles and expansions(rewritten(G, tile_bytes=tile_bytes), G) == []


def test_jax_gathered_program_gathers_and_never_scatters():
    before = count_primitives(lower(mla_graph(G), "jax"), **mla_inputs(G))
    assert before["scatter"] == 1 and before["gather"] == 0
    counts = count_primitives(lower(rewritten(G), "jax"), **mla_inputs(G))
    assert (counts["gather"], counts["scatter"], counts["exp"], counts["dot_general"]) == (2, 0, 1, 4)
