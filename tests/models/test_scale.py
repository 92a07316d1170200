"""Whole-model scale: the 48-layer Qwen3.8-Flash-Next-shaped step traces, rewrites and lowers, in linear work."""

from __future__ import annotations

import time
from collections import Counter

import networkx as nx
import numpy as np

from attnpass.backends import run
from attnpass.lowering import lower
from attnpass.models import (
    EXAMPLES,
    LAYER_QSA_INPUTS,
    SHARED_QSA_INPUTS,
    QSAConfig,
    build_model,
    is_qsa_layer,
    make_inputs,
    narrowed_inputs,
)
from attnpass.passes import PassManager, parse_pipeline
from tests.util import assert_close, requires

PIPELINE = EXAMPLES["qwen38-model"].pipeline  # qsa-gather{max_rows=4},head-chunk,dce,narrow-inputs,dce
SMALL = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=4, rotary_dim=8)


@requires("mlx.core")
def test_48_layers_trace_rewrite_and_lower_to_mlx():
    start = time.perf_counter()
    graph = build_model(48)
    result = PassManager(parse_pipeline(PIPELINE)).run(graph)
    program = lower(result.graph, "mlx")
    seconds = time.perf_counter() - start

    assert [is_qsa_layer(layer) for layer in range(8)] == [False, False, False, True] * 2
    assert Counter(n.op for n in graph.nodes())["sdpa"] == 48 and len(graph.inputs) == 1 + 4 + 2 * 48 + 4 * 12
    applied = Counter(r.pass_name for r in result.applied())
    assert applied["qsa-gather"] == 12 and applied["head-chunk"] == 36 and applied["narrow-inputs"] == 1
    ops = Counter(n.op for n in result.graph.nodes())
    assert ops["qsa_mask"] == 0 and ops["qsa_cells"] == 12
    assert (
        ops["sdpa"] == 12 * 1 + 36 * 4
    )  # the 4 rows of a QSA layer in one gathered call, 4 head chunks per dense layer
    assert result.graph.node("mask").type.shape == (1, 4, 8192)  # the padded [1, 64, T] mask, narrowed to 4 rows
    assert program.source.count("mx.fast.scaled_dot_product_attention(") == ops["sdpa"]
    assert seconds < 20, f"trace + pipeline + lowering of 48 layers took {seconds:.1f} s"


def test_pipeline_work_does_not_grow_with_the_number_of_rewrites(monkeypatch):
    """Full topological sorts are the O(N log N) step; their count must not depend on depth."""
    sorts = []
    original = nx.lexicographical_topological_sort

    def counting(*args, **kwargs):
        sorts.append(1)
        return original(*args, **kwargs)

    counts = {}
    for n_layers in (4, 16):
        graph = build_model(n_layers, n_kv=4608)
        sorts.clear()
        monkeypatch.setattr(nx, "lexicographical_topological_sort", counting)
        PassManager(parse_pipeline(PIPELINE)).run(graph)
        monkeypatch.setattr(nx, "lexicographical_topological_sort", original)
        counts[n_layers] = len(sorts)
    assert counts[4] == counts[16] <= 12, counts


def model_inputs(n_layers: int, n_kv: int, positions: np.ndarray) -> dict[str, np.ndarray]:
    """Random inputs for ``build_model(..., cfg=SMALL)``: each layer draws its own caches and indexer tensors."""
    shared = make_inputs(SMALL, n_kv, positions, seed=0, hidden_fraction=0.05)
    inputs = {"hidden": shared["q"], **{name: shared[name] for name in SHARED_QSA_INPUTS}}
    for layer in range(n_layers):
        own = make_inputs(SMALL, n_kv, positions, seed=layer + 1)
        inputs[f"k_cache_{layer}"], inputs[f"v_cache_{layer}"] = own["k_cache"], own["v_cache"]
        if is_qsa_layer(layer):
            inputs.update({f"{name}_{layer}": own[name] for name in LAYER_QSA_INPUTS})
    return inputs


@requires("mlx.core")
def test_the_rewritten_model_computes_the_same_step():
    n_layers, n_kv = 8, 128
    masked = build_model(n_layers, q_len=4, n_kv=n_kv, cfg=SMALL)
    result = PassManager(parse_pipeline(PIPELINE.replace("head-chunk", "head-chunk{budget=4}"))).run(masked)
    assert Counter(r.pass_name for r in result.applied())["head-chunk"] == 6  # gqa 2 x 4 rows = 8 > 4
    inputs = model_inputs(n_layers, n_kv, np.array([[120, 121, 122, 123]]))
    expected = run(lower(masked, "numpy"), **inputs)
    narrowed = narrowed_inputs(result.graph, inputs)
    for target in ("numpy", "mlx"):
        assert_close(run(lower(result.graph, target), **narrowed), expected)
