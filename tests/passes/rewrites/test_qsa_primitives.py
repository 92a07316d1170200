"""Primitive counts of the masked and gathered QSA layer, read from the backends themselves.

MLX: ``mx.export_function`` records (names and shapes). JAX: the jaxpr, walked into nested jits.
N_KV = 128 is chosen so no other axis of the small model has that size.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import assert_primitive_counts
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, gather_pipeline, make_inputs, narrowed_inputs
from tests.util import requires

SMALL = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=4, rotary_dim=8)
N_KV, W = 128, 35
K_ROWS = (2 * N_KV, 16)  # MLX's qsa_gather reads K and V as [B * Hkv * T, D] rows (its flat-view lowering)
K_PLANES = (1, 1, 2, N_KV, 16)  # JAX's reads them as [B, 1, Hkv, T, D] (one take_along_axis)


@pytest.fixture(scope="module")
def layers():
    masked = build_layer(SMALL, N_KV)
    gathered = gather_pipeline().run(masked).graph
    inputs = make_inputs(SMALL, N_KV, np.array([[121]]))
    return {"masked": (masked, inputs), "gather": (gathered, narrowed_inputs(gathered, inputs))}


@requires("mlx.core")
def test_mlx_gather_has_one_softmax_of_width_w_and_gathers_k_and_v_once(layers):
    from attnpass.lowering.targets.mlx import primitives

    graph, inputs = layers["gather"]
    program = lower(graph, "mlx")
    prims = primitives(program, **inputs)
    (softmax,) = [p for p in prims if p.name == "Softmax"]
    assert softmax.inputs[0][0][-1] == W
    kv_gathers = [p for p in prims if p.name == "Gather" and p.inputs[0][0] == K_ROWS]
    assert [p.outputs[0][0] for p in kv_gathers] == [(1, 1, 2, W, 1, 16)] * 2  # K once, V once, W cells each
    wide = {p.name for p in prims if any(shape and shape[-1] == N_KV for shape, _ in p.inputs)}
    assert wide == {"Reshape", "GatherAxis"}  # the mask row is only reshaped and gathered, never attended
    attention = [p for p in prims if p.name in ("Matmul", "Softmax", "Select", "Add")]
    assert all(N_KV not in shape for p in attention for shape, _ in p.inputs + p.outputs)
    assert_primitive_counts(
        program,
        {"Softmax": 1, "Matmul": 3, "Gather": 4, "GatherAxis": 1, "Partition": 1, "Sort": 1, "ScatterAxis": 0},
        **inputs,
    )  # Matmul: indexer scores, q k^T, p v; Gather: 2 RoPE rows, K, V; GatherAxis: visibility; Partition: top-k


@requires("mlx.core")
def test_mlx_masked_attends_the_whole_cache(layers):
    from attnpass.lowering.targets.mlx import primitives

    graph, inputs = layers["masked"]
    program = lower(graph, "mlx")
    (softmax,) = [p for p in primitives(program, **inputs) if p.name == "Softmax"]
    assert softmax.inputs[0][0][-1] == N_KV
    assert_primitive_counts(
        program, {"Softmax": 1, "Matmul": 3, "Gather": 3, "ScatterAxis": 1, "Partition": 1}, **inputs
    )


def _leaf_equations(jaxpr):
    """Equations of the jaxpr and its nested jaxprs, containers (jit, custom_jvp, ...) left out."""
    from attnpass.lowering.targets.jax.target import _subjaxprs

    for eqn in jaxpr.eqns:
        subs = [s for p in eqn.params.values() for s in _subjaxprs(p)]
        if subs:
            for sub in subs:
                yield from _leaf_equations(sub)
        else:
            yield eqn


def _shapes(variables):
    return [tuple(getattr(v.aval, "shape", ())) for v in variables]


@requires("jax")
def test_jax_gather_has_one_exp_of_width_w_and_gathers_k_and_v_once(layers):
    from attnpass.lowering.targets.jax import jaxpr

    graph, inputs = layers["gather"]
    program = lower(graph, "jax")
    eqns = list(_leaf_equations(jaxpr(program, **inputs).jaxpr))
    (exp,) = [e for e in eqns if e.primitive.name == "exp"]
    assert _shapes(exp.invars)[0][-1] == W
    kv_gathers = [e for e in eqns if e.primitive.name == "gather" and _shapes(e.invars)[0] == K_PLANES]
    assert [_shapes(e.outvars)[0] for e in kv_gathers] == [(1, 1, 2, W, 16)] * 2
    wide = {e.primitive.name for e in eqns if any(s and s[-1] == N_KV for s in _shapes(e.invars))}
    assert wide == {"reshape", "gather"}
    assert_primitive_counts(
        program, {"exp": 1, "dot_general": 3, "gather": 5, "top_k": 1, "sort": 1, "scatter": 0}, **inputs
    )


@requires("jax")
def test_jax_masked_attends_the_whole_cache(layers):
    from attnpass.lowering.targets.jax import jaxpr

    graph, inputs = layers["masked"]
    program = lower(graph, "jax")
    (exp,) = [e for e in _leaf_equations(jaxpr(program, **inputs).jaxpr) if e.primitive.name == "exp"]
    assert _shapes(exp.invars)[0][-1] == N_KV
    assert_primitive_counts(program, {"exp": 1, "dot_general": 3, "gather": 3, "scatter": 1, "top_k": 1}, **inputs)
