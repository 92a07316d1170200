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


def declines(graph, pipeline: str) -> list[tuple[str | None, str]]:
    """(node, reason) of each decline when ``pipeline`` runs on ``graph``."""
    result = PassManager(parse_pipeline(pipeline)).run(graph)
    return [(r.node, r.reason) for r in result.declined()]


def traced_sdpa(specs: list[TensorSpec], causal: str | None, *, masked: bool):
    """One traced ``ops.sdpa`` over ``specs`` (q, k, v and, when ``masked``, the mask)."""

    def with_mask(q, k, v, m):
        return ops.sdpa(q, k, v, causal=causal, mask=m)

    def without_mask(q, k, v):
        return ops.sdpa(q, k, v, causal=causal)

    return trace(with_mask if masked else without_mask, *specs)


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


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
@pytest.mark.parametrize("target", TARGETS)
def test_a_causal_attribute_becomes_a_mask_computed_per_shard(causal, mask, target, rng):
    specs = [TensorSpec((2, 4, 5, 16)), TensorSpec((2, 2, 32, 16)), TensorSpec((2, 2, 32, 16))]
    if mask is not None:
        specs.append(TensorSpec((2, 1, 5, 32), "bool" if mask == "bool" else "float32"))

    graph = traced_sdpa(specs, causal, masked=mask is not None)
    result, remarks = split(graph, "split-kv{shards=4}")
    assert "applied" in remarks[0]
    assert [n.attrs["axis"] for n in result.nodes() if n.op == "iota"] == [0, 3, 2]  # shard, key, query row
    assert all(len(n.attrs["value"]) == 1 for n in result.nodes() if n.op == "constant")  # no T-sized literal
    arrays = [random_array(rng, s.shape, s.dtype) for s in specs]
    if mask is not None:
        arrays[3][..., 0] = True if mask == "bool" else 0.0  # key 0 stays visible to every row (top-left)
    assert_close(execute(lower(result, target), *arrays), run(lower(graph, "numpy"), *arrays))


@pytest.mark.parametrize("target", TARGETS)
def test_a_shard_whose_keys_are_all_masked_contributes_nothing(target, rng):
    graph = verify_step(q_len=4, kv_len=256)
    result, _ = split(graph, "split-kv{shards=4}")
    arrays = verify_inputs(graph, rng)
    arrays[3][..., 64:128] = False  # shard 1 sees no key: its partial is discarded
    out = execute(lower(result, target), *arrays)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_close(out, run(lower(graph, "numpy"), *arrays))


@pytest.mark.parametrize("target", target_params("numpy", "jax"))
def test_the_gathered_qsa_layer_splits_the_gather_source(target):
    cfg, n_kv = QSAConfig(), 8192
    masked = build_layer(cfg, n_kv)
    gathered = gather_pipeline().run(masked).graph
    result, remarks = split(gathered, "split-kv{shards=8}")
    # one qsa_gather per cache, every shard (the leading 8 of [8*B, Hkv, T/8, D]) from its own slice
    assert "gathered form (qsa_gather): each shard gathers qsa_cells % 1024 from its own slice" in remarks[0]
    gathers = [n for n in result.nodes() if n.op == "qsa_gather"]
    assert {result.node(n.inputs[0]).type.shape for n in gathers} == {(8, 2, 1024, 256)} and len(gathers) == 2
    assert {result.node(n.inputs[1]).type.shape for n in gathers} == {(8, 1, 2051)}
    kv_reads = [n for n in result.nodes() if {"k_cache", "v_cache"} & set(n.inputs)]  # only the split reads them
    assert {n.op for n in kv_reads} == {"reshape"} and {n.type.shape for n in kv_reads} == {(1, 2, 8, 1024, 256)}
    inputs = make_inputs(cfg, n_kv, np.array([[5000]]), hidden_fraction=0.1)
    expected = run(lower(masked, "numpy"), **inputs)
    assert_close(execute(lower(result, target), **narrowed_inputs(result, inputs)), expected)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("visibility", ["additive", "none"])
def test_the_batched_gather_of_several_streams_and_rows_splits_exactly(target, visibility):
    """Each (stream, row) of the batched gather attends its own cells; each shard gathers those it owns."""
    cfg, n_kv = QSAConfig(n_q_heads=8, budget=512), 4096
    masked = build_layer(cfg, n_kv, batch=2, rows=3, visibility=visibility)
    gathered = gather_pipeline().run(masked).graph
    result, remarks = split(gathered, "split-kv{shards=4}")
    assert "gathered form (qsa_gather)" in remarks[0] and "applied" in remarks[0]
    positions = np.array([[3000, 3001, 3002], [4000, 4093, 4095]])
    inputs = make_inputs(cfg, n_kv, positions, hidden_fraction=0.1)
    expected = run(lower(masked, "numpy"), **inputs)
    assert_close(execute(lower(result, target), **narrowed_inputs(result, inputs)), expected)


@pytest.mark.parametrize("target", TARGETS)
def test_a_batched_gathered_row_without_any_slot_is_the_mean_of_the_gathered_values(target, rng):
    """The batched form's bool mask [B*S, 1, 1, W]: a (stream, row) without slots averages its own W slots."""
    b, s, hkv, t, w = 2, 2, 2, 64, 6
    cells = np.array([[[1, 2, 17, 40, 41, 63], [0, 5, 6, 7, 50, 33]],
                      [[3, 4, 20, 21, 22, 60], [9, 10, 11, 12, 13, 14]]], np.int32)  # fmt: skip
    graph = masked_gather_graph(b, s, hkv, t, w)
    result, remarks = split(graph, "split-kv{shards=4}")
    assert "gathered form (qsa_gather)" in remarks[0]
    q = random_array(rng, (b * s, 4, 1, 16), "float32")
    k, v = random_array(rng, (b, hkv, t, 16), "float32"), random_array(rng, (b, hkv, t, 8), "float32")
    m = rng.random((b * s, 1, 1, w)) < 0.6
    m[1] = False  # stream 0, row 1 attends no slot
    m[2] = np.arange(w) < 2  # stream 1, row 0 attends shard 0's slots only
    args = (q, k, v, cells, m)
    expected = run(lower(graph, "numpy"), *args)
    np.testing.assert_allclose(expected[1, :, 0], mean_of_v(v[:1, :, cells[0, 1]], 4)[0], rtol=1e-6)
    out = execute(lower(result, target), *args)
    assert np.isfinite(out).all()
    assert_close(out, expected)


def masked_gather_graph(b: int, s: int, hkv: int, t: int, w: int):
    """The gather form of ``qsa-gather`` over given cells [B, S, W] and a bool mask [B*S, 1, 1, W]."""
    specs = [TensorSpec((b * s, 4, 1, 16)), TensorSpec((b, hkv, t, 16)), TensorSpec((b, hkv, t, 8)),
             TensorSpec((b, s, w), "int32"), TensorSpec((b * s, 1, 1, w), "bool")]  # fmt: skip

    def gathered(q, k, v, cells, m):
        return ops.sdpa(q, ops.qsa_gather(k, cells), ops.qsa_gather(v, cells), mask=m)

    return trace(gathered, *specs)


def qsa_take_graph():
    """K/V gathered from ``qsa_cells`` by ``take`` along T (the per-row form qsa-gather no longer makes)."""

    def per_row(q, k, v, selection, positions):
        cells = ops.reshape(ops.qsa_cells(selection, positions, ratio=4, width=12, kv_len=64), (12,))
        return ops.sdpa(q, ops.take(k, cells, 2), ops.take(v, cells, 2))

    specs = [TensorSpec((1, 4, 1, 16)), TensorSpec((1, 2, 64, 16)), TensorSpec((1, 2, 64, 16)),
             TensorSpec((1, 1, 2), "int32"), TensorSpec((1, 1), "int32")]  # fmt: skip
    return trace(per_row, *specs)


def test_a_qsa_gather_of_another_form_is_declined_not_split_densely():
    graph = qsa_take_graph()
    result, remarks = split(graph, "split-kv{shards=4}")
    assert result == graph
    assert declines(graph, "split-kv{shards=4}") == [("sdpa", "gather_form")], remarks


def test_preconditions_are_declined_with_their_numbers():
    graph = verify_step(q_len=4, kv_len=96)
    result, remarks = split(graph, "split-kv{shards=64}")
    assert result == graph and not any(n.op == "sdpa_lse" for n in result.nodes())  # left as it was
    assert declines(graph, "split-kv{shards=64}") == [("sdpa", "not_divisible")]
    assert "kv_len 96 of k_cache is not divisible by 64 shards" in remarks[0]  # the length, the cache, the shards
    once, _ = split(graph, "split-kv{shards=2}")
    again, remarks = split(once, "split-kv{shards=2}")
    assert again == once
    assert declines(once, "split-kv{shards=2}")[0] == ("sdpa_partial", "already_done")


def test_shards_must_be_at_least_two():
    with pytest.raises(ValueError, match="shards must be an int >= 2"):
        SplitKV(shards=1)


def mean_of_v(v: np.ndarray, hq: int) -> np.ndarray:
    """``[B, Hq, Dv]``: the mean of V over its keys, per query head (GQA: head h reads KV head h // G)."""
    return np.repeat(v.astype(np.float64).mean(axis=2), hq // v.shape[1], axis=1)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("mask", "causal"), [("bool", None), (None, "bottom_right"), ("bool", "bottom_right"),
                                              ("additive", "bottom_right")])  # fmt: skip
def test_a_row_that_attends_no_key_stays_the_mean_of_v_after_the_split(target, mask, causal, rng):
    """docs/semantics.md §4: no key at all -> the mean of V over all keys, split or not, on every target."""
    s, t = 40, 32  # bottom-right with S > T: rows 0..7 see no key; the bool mask hides every key from row 9
    specs = [TensorSpec((2, 4, s, 16)), TensorSpec((2, 2, t, 16)), TensorSpec((2, 2, t, 8))]
    if mask is not None:
        specs.append(TensorSpec((2, 1, s, t), "bool" if mask == "bool" else "float32"))

    graph = traced_sdpa(specs, causal, masked=mask is not None)
    result, remarks = split(graph, "split-kv{shards=4}")
    assert "applied" in remarks[0]
    arrays = [random_array(rng, sp.shape, sp.dtype) for sp in specs]
    dead = list(range(8)) if causal else []
    if mask == "bool":
        arrays[3][..., 9, :] = False
        arrays[3][..., 10, 8:] = False  # row 10 sees keys of shard 0 only: shards 1-3 are dropped
        dead.append(9)
    expected = run(lower(graph, "numpy"), *arrays)
    np.testing.assert_allclose(expected[:, :, dead], mean_of_v(arrays[2], 4)[:, :, None].repeat(len(dead), 2), 1e-6)
    out = execute(lower(result, target), *arrays)
    assert np.isfinite(out).all()
    assert_close(out, expected)


@pytest.mark.parametrize("target", TARGETS)
def test_a_gathered_row_without_any_slot_is_the_mean_of_the_gathered_values(target, rng):
    """Shards own different numbers of the gathered slots; the combine weighs each by the slots it owns."""
    specs = [TensorSpec((1, 4, 3, 16)), TensorSpec((1, 2, 64, 16)), TensorSpec((1, 2, 64, 8)),
             TensorSpec((1, 1, 10), "int32"), TensorSpec((1, 1, 3, 10), "bool")]  # fmt: skip

    def gathered(q, k, v, cells, m):  # three query rows attend the same gathered cells
        return ops.sdpa(ops.cast(q, "float32"), ops.qsa_gather(k, cells), ops.qsa_gather(v, cells), mask=m)

    graph = trace(gathered, *specs)
    result, remarks = split(graph, "split-kv{shards=4}")
    assert "gathered form" in remarks[0]
    q, k, v, _, m = (random_array(rng, sp.shape, sp.dtype) for sp in specs)
    cells = np.array([[[1, 2, 3, 5, 17, 40, 41, 42, 43, 63]]], np.int32)  # shards own 4, 1, 4 and 1 slots
    m[..., 1, :] = False  # row 1 attends no slot
    m[..., 2, :] = np.arange(10) < 4  # row 2 attends shard 0's slots only
    expected = run(lower(graph, "numpy"), q, k, v, cells, m)
    np.testing.assert_allclose(expected[:, :, 1], mean_of_v(v[:, :, cells[0, 0]], 4), rtol=1e-6)
    out = execute(lower(result, target), q, k, v, cells, m)
    assert np.isfinite(out).all()
    assert_close(out, expected)


def test_k_and_v_gathered_at_different_cells_are_declined():
    specs = [TensorSpec((2, 4, 1, 16)), TensorSpec((1, 2, 64, 16)), TensorSpec((1, 2, 64, 16)),
             TensorSpec((1, 2, 8), "int32"), TensorSpec((1, 2, 8), "int32")]  # fmt: skip

    def gathered(q, k, v, k_cells, v_cells):
        return ops.sdpa(q, ops.qsa_gather(k, k_cells), ops.qsa_gather(v, v_cells))

    graph = trace(gathered, *specs)
    result, remarks = split(graph, "split-kv{shards=4}")
    assert result == graph
    assert declines(graph, "split-kv{shards=4}") == [("sdpa", "gather_form")], remarks
