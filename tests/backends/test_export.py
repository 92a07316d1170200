"""Exports for other compilers: MLX .mlxfn files (round trip, bit for bit) and JAX StableHLO text."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from attnpass.backends import count_primitives, run, to_numpy
from attnpass.backends.export import export_mlx, export_stablehlo, placeholders
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, make_inputs, narrowed_inputs, verify_step
from attnpass.passes import PassManager, parse_pipeline
from tests.util import assert_bits_equal, lazy_import, random_array, requires

pytestmark = requires("mlx.core", "jax")
mx = lazy_import("mlx.core")

SMALL_QSA = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=4, rotary_dim=8)


@pytest.fixture(scope="module")
def chunked():
    """The verify step (24/2/256 bf16, q_len 4) after head-chunk, over a short cache."""
    return PassManager(parse_pipeline("head-chunk")).run(verify_step(4, 64)).graph


def random_inputs(graph, rng) -> list[np.ndarray]:
    return [random_array(rng, t.shape, t.dtype) for t in graph.input_types()]


def test_mlxfn_round_trip_is_bit_exact(chunked, tmp_path, rng):
    program = lower(chunked, "mlx")
    path = export_mlx(program, tmp_path / "verify.mlxfn")  # traced on zero placeholders
    imported, metadata = mx.import_function(str(path), return_metadata=True)
    assert json.loads(metadata) == {
        "graph": "attention", "inputs": ["q", "k_cache", "v_cache", "mask"], "identity": program.identity,
    }  # fmt: skip
    for _ in range(2):
        args = random_inputs(chunked, rng)
        (out,) = imported(*program.bind(*args))
        assert_bits_equal(to_numpy(out), run(program, *args))


def test_mlxfn_of_the_gathered_qsa_layer_matches_on_real_inputs(tmp_path):
    gathered = PassManager(parse_pipeline("qsa-gather,dce,narrow-inputs,dce")).run(build_layer(SMALL_QSA, 128)).graph
    program = lower(gathered, "mlx")
    inputs = make_inputs(SMALL_QSA, 128, np.array([[121]]), hidden_fraction=0.1)
    args = narrowed_inputs(gathered, inputs)
    path = export_mlx(program, tmp_path / "qsa.mlxfn", **args)  # traced on the real inputs this time
    (out,) = mx.import_function(str(path))(*program.bind(**args))
    assert_bits_equal(to_numpy(out), run(program, **args))


def test_stablehlo_text_has_the_graph_signature_and_the_jaxpr_ops(chunked, rng):
    program = lower(chunked, "jax")
    text = export_stablehlo(program)  # ShapeDtypeStruct placeholders
    assert text.startswith("module @jit_attention")
    main = re.search(r"func\.func public @main\((.*?)\) ->", text).group(1)
    kv = "1x2x64x256xbf16"
    assert re.findall(r"tensor<([^>]*)>", main) == ["1x24x4x256xbf16", kv, kv, "1x1x4x64xi1"]
    counts = count_primitives(program, *random_inputs(chunked, rng))
    assert text.count("stablehlo.exponential") == counts["exp"] == 4  # one softmax per head chunk
    assert text.count("stablehlo.dot_general") == counts["dot_general"] == 8
    assert export_stablehlo(program, *random_inputs(chunked, rng)) == text  # values do not matter, only types


def test_placeholders_have_the_input_types(chunked):
    mlx_args = placeholders(lower(chunked, "mlx"))
    assert [(tuple(a.shape), a.dtype) for a in mlx_args] == [
        ((1, 24, 4, 256), mx.bfloat16), ((1, 2, 64, 256), mx.bfloat16), ((1, 2, 64, 256), mx.bfloat16),
        ((1, 1, 4, 64), mx.bool_),
    ]  # fmt: skip
    jax_args = placeholders(lower(chunked, "jax"))
    assert [(a.shape, a.dtype.name) for a in jax_args] == [(t.shape, t.dtype.value) for t in chunked.input_types()]


def test_exports_need_the_matching_target(chunked, tmp_path):
    with pytest.raises(ValueError, match="export_mlx needs a program lowered to 'mlx', got target 'jax'"):
        export_mlx(lower(chunked, "jax"), tmp_path / "x.mlxfn")
    with pytest.raises(ValueError, match="export_stablehlo needs a program lowered to 'jax', got target 'numpy'"):
        export_stablehlo(lower(chunked, "numpy"))
