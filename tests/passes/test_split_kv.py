"""split-kv (flash-decoding): T-shards attended separately and combined by log-sum-exp weights equal one sdpa."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, gather_pipeline, make_inputs, narrowed_inputs, verify_step
from attnpass.passes import PassManager, SplitKV, parse_pipeline
from tests.util import assert_close, random_array, target_params

# The numpy reference's partial of a shard that sees no key is 0/0 = NaN (then discarded by the combine).
NAN_PARTIAL = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
TARGETS = target_params("numpy", "mlx", "jax")


def execute(program, *args, **kwargs) -> np.ndarray:
    """``run``, with a JAX program compiled once (eager JAX compiles every primitive on first use)."""
    if program.target.name != "jax":
        return run(program, *args, **kwargs)
    import jax

    return np.asarray(jax.jit(program.fn)(*program.bind(*args, **kwargs)))


def split(graph, pipeline: str):
    result = PassManager(parse_pipeline(pipeline)).run(graph)
    return result.graph, [str(r) for r in result.remarks]


def verify_inputs(graph, rng, visible: float = 0.7) -> list[np.ndarray]:
    q, k, v, mask = graph.input_types()
    arrays = [random_array(rng, t.shape, t.dtype) for t in (q, k, v)]
    return arrays + [rng.random(mask.shape) < visible]


@pytest.mark.parametrize("target", TARGETS)
def test_the_head_chunked_verify_step_split_four_ways_equals_the_unsplit_one(target, rng):
    graph = verify_step(q_len=4, kv_len=256)
    chunked, _ = split(graph, "head-chunk")
    result, remarks = split(chunked, "split-kv{shards=4}")
    assert sum("applied" in r for r in remarks) == 4
    assert sum(n.op == "sdpa_lse" for n in result.nodes()) == 4
    arrays = verify_inputs(graph, rng)
    expected = run(lower(graph, "numpy"), *arrays)
    assert_close(execute(lower(result, target), *arrays), expected)
    assert_close(execute(lower(result, target), *arrays), execute(lower(chunked, target), *arrays))


@NAN_PARTIAL  # some 8-key shard of a random mask hides every key from a row
def test_in_float64_arithmetic_the_combine_is_exact(rng):
    specs = [
        TensorSpec((2, 6, 3, 16)),
        TensorSpec((2, 2, 64, 16)),
        TensorSpec((2, 2, 64, 8)),
        TensorSpec((2, 1, 3, 64), "bool"),
    ]

    def attention(q, k, v, m):
        return ops.sdpa(q, k, v, scale=0.25, mask=m)

    graph = trace(attention, *specs)
    result, _ = split(graph, "split-kv{shards=8}")
    arrays = [random_array(rng, s.shape, s.dtype) for s in specs]
    arrays[3][..., 0] = True
    assert_close(run(lower(result, "numpy"), *arrays), run(lower(graph, "numpy"), *arrays), rtol=1e-6)


@NAN_PARTIAL  # top-left: the shards past the first S keys see nothing
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
@pytest.mark.parametrize("target", TARGETS)
def test_a_causal_attribute_becomes_a_mask_computed_per_shard(causal, mask, target, rng):
    specs = [TensorSpec((2, 4, 5, 16)), TensorSpec((2, 2, 32, 16)), TensorSpec((2, 2, 32, 16))]
    if mask is not None:
        specs.append(TensorSpec((2, 1, 5, 32), "bool" if mask == "bool" else "float32"))

    def masked(q, k, v, m):
        return ops.sdpa(q, k, v, causal=causal, mask=m)

    def unmasked(q, k, v):
        return ops.sdpa(q, k, v, causal=causal)

    graph = trace(unmasked if mask is None else masked, *specs)
    result, remarks = split(graph, "split-kv{shards=4}")
    assert "applied" in remarks[0]
    assert [n.attrs["axis"] for n in result.nodes() if n.op == "iota"] == [0, 3, 2]  # shard, key, query row
    assert all(len(n.attrs["value"]) == 1 for n in result.nodes() if n.op == "constant")  # no T-sized literal
    arrays = [random_array(rng, s.shape, s.dtype) for s in specs]
    if mask is not None:
        arrays[3][..., 0] = True if mask == "bool" else 0.0  # key 0 stays visible to every row (top-left)
    assert_close(execute(lower(result, target), *arrays), run(lower(graph, "numpy"), *arrays))


@NAN_PARTIAL
@pytest.mark.parametrize("target", TARGETS)
def test_a_shard_whose_keys_are_all_masked_contributes_nothing(target, rng):
    graph = verify_step(q_len=4, kv_len=256)
    result, _ = split(graph, "split-kv{shards=4}")
    arrays = verify_inputs(graph, rng)
    arrays[3][..., 64:128] = False  # shard 1 sees no key: its partial is discarded
    out = execute(lower(result, target), *arrays)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_close(out, run(lower(graph, "numpy"), *arrays))


@NAN_PARTIAL
@pytest.mark.parametrize("target", target_params("numpy", "jax"))
def test_the_gathered_qsa_layer_splits_the_gather_source(target):
    cfg, n_kv = QSAConfig(), 8192
    masked = build_layer(cfg, n_kv)
    gathered = gather_pipeline().run(masked).graph
    result, remarks = split(gathered, "split-kv{shards=8}")
    assert "gathered form: each shard gathers cell_idx % 1024 from its own slice" in remarks[0]
    takes = [n for n in result.nodes() if n.op == "take" and n.type.shape[0] == 8]
    assert {result.node(n.inputs[0]).type.shape for n in takes} == {(8, 2, 1024, 256)}  # each from its own shard
    inputs = make_inputs(cfg, n_kv, np.array([[5000]]), hidden_fraction=0.1)
    expected = run(lower(masked, "numpy"), **inputs)
    assert_close(execute(lower(result, target), **narrowed_inputs(result, inputs)), expected)


def test_preconditions_are_declined_with_their_numbers():
    graph = verify_step(q_len=4, kv_len=96)
    _, remarks = split(graph, "split-kv{shards=64}")
    assert remarks == [r for r in remarks if "kv_len 96 of k_cache is not divisible by 64 shards" in r]
    once, _ = split(graph, "split-kv{shards=2}")
    again, remarks = split(once, "split-kv{shards=2}")
    assert again == once
    assert "declined sdpa_partial: already a split-KV partial" in remarks[0]


def test_shards_must_be_at_least_two():
    with pytest.raises(ValueError, match="shards must be an int >= 2"):
        SplitKV(shards=1)
